import pytest
import torch
import torch._dynamo
import torch.compiler.config
import torch.nn as nn
from functorch.compile import aot_function, nop

from partitioners.config import Config
from partitioners.partition import partition


@pytest.fixture(autouse=True)
def _fresh_compiles():
    """Each test compiles from scratch: no Dynamo cache carried over, and no
    Inductor/AOT cache hit that would skip the partitioner (and its Plan)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    with torch.compiler.config.patch(force_disable_caches=True):
        yield
    torch._dynamo.reset()


def aot_plan(fn, *args, tag=None, config=Config()):
    """Trace ``fn`` with AOTAutograd, partition with ckpt (no Inductor codegen),
    run forward and backward; return (plan, output).

    ``tag(joint_gm)`` may edit node metadata first, as a checkpoint region would.
    """
    result, out = aot_partition(fn, *args, tag=tag, config=config)
    return result.plan, out


def aot_partition(fn, *args, tag=None, config=Config()):
    """As aot_plan, returning the whole Partition (graphs, plan, facts)."""
    results = []

    def partition_fn(joint_gm, joint_inputs, **kwargs):
        if tag is not None:
            tag(joint_gm)
        result = partition(
            joint_gm,
            num_fwd_outputs=kwargs["num_fwd_outputs"],
            static_lifetime_input_indices=kwargs.get("static_lifetime_input_indices"),
            config=config,
        )
        results.append(result)
        return result.forward, result.backward

    compiled = aot_function(fn, fw_compiler=nop, bw_compiler=nop, partition_fn=partition_fn)
    out = compiled(*args)
    out.sum().backward()
    (result,) = results
    return result, out


def node_named(gm, name):
    (node,) = [n for n in gm.graph.nodes if n.name == name]
    return node


class Block(nn.Module):
    """A residual MLP block (d=64)."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(64, 256), nn.Linear(256, 64)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class GraphBrokenBlocks(nn.Module):
    """Three Blocks with a graph break between each: three graphs a step."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))

    def forward(self, x):
        x = self.blocks[0](x)
        torch._dynamo.graph_break()
        x = self.blocks[1](x)
        torch._dynamo.graph_break()
        return self.blocks[2](x).square().mean()
