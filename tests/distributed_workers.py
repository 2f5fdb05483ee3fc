"""Worker processes for test_distributed.py: real gloo process groups on CPU.

Each worker writes what it saw to ``<out>/<name>-<rank>.json``; the test
reads those files. Runs under torch.multiprocessing.spawn.
"""
import copy
import json
import os
import pathlib
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from bench.models import TPMLP, tp_mlp_plan


class TPAttention(nn.Module):
    """Causal self-attention whose heads split across ranks."""

    def __init__(self, width=32, head_dim=8):
        super().__init__()
        self.head_dim = head_dim
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
        self.o = nn.Linear(width, width)

    def forward(self, x):
        batch, seq, _ = x.shape
        q, k, v = (
            lin(x).view(batch, seq, -1, self.head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v)
        )
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(torch.tanh(attn).transpose(1, 2).reshape(batch, seq, -1)).square().mean()


def _init(rank, world, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)  # two ranks share two cores
    torch.compiler.config.force_disable_caches = True


def _write(out, name, rank, result):
    pathlib.Path(out, f"{name}-{rank}.json").write_text(json.dumps(result))


def _grad_diff(sharded, reference):
    diffs = []
    for p, q in zip(sharded.parameters(), reference.parameters(), strict=True):
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        diffs.append((grad - q.grad).abs().max().item())
    return max(diffs)


def tensor_parallel(rank, world, port, out):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from ckpt import make_backend

    _init(rank, world, port)
    mesh = init_device_mesh("cpu", (world,))
    cases = {
        "mlp": (TPMLP, tp_mlp_plan(), (8, 16), None),
        "attention": (TPAttention, {"q": ColwiseParallel(), "k": ColwiseParallel(),
                                    "v": ColwiseParallel(), "o": RowwiseParallel()}, (2, 8, 32), None),
        # The smallest plan each rank allows, from its local shard sizes.
        "mlp-budget": (TPMLP, tp_mlp_plan(), (8, 16), "1B"),
    }
    result = {}
    for name, (cls, plan, shape, budget) in cases.items():
        torch.manual_seed(0)
        reference, x = cls(), torch.randn(*shape)
        model = copy.deepcopy(reference)
        parallelize_module(model, mesh, plan)
        backend = make_backend(strict=True, memory_budget=budget)
        torch._dynamo.reset()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "below the smallest plan"
            loss = torch.compile(model, backend=backend)(x)
        loss.backward()
        reference_loss = reference(x)
        reference_loss.backward()
        collectives = [
            [d.decision, d.reason] for p in backend.plans for d in p.decisions if "collective" in d.reason
        ]
        result[name] = {
            "loss_diff": abs(loss.item() - reference_loss.item()),
            "grad_diff": _grad_diff(model, reference),
            "fingerprints": [p.fingerprint for p in backend.plans],
            "fallbacks": [p.fallback for p in backend.plans],
            "collectives": collectives,
            "recomputed_matmuls": sum(
                d.reason.endswith("to fit the memory budget") for p in backend.plans for d in p.decisions
            ),
        }
    _write(out, "tp", rank, result)
    dist.destroy_process_group()


def fsdp(rank, world, port, out):
    """FSDP2 per block and at the root, the whole model compiled."""
    _fsdp_training(rank, world, port, out, "fsdp", per_block=False)


def fsdp_per_block(rank, world, port, out):
    """FSDP2 per block and at the root, then each block compiled on its own
    (``block.compile``), as torchtitan does; two steps."""
    _fsdp_training(rank, world, port, out, "fsdp_per_block", per_block=True, steps=2)


def _fsdp_training(rank, world, port, out, name, *, per_block, steps=3):
    """``steps`` SGD steps of a sharded, compiled GPT beside an unsharded eager
    one; writes both losses per step, the largest parameter difference at the
    end, and the Plans' count and fallbacks."""
    from torch.distributed.fsdp import fully_shard

    from bench.models import GPT, GPTConfig, gpt_batch
    from ckpt import make_backend

    _init(rank, world, port)
    torch.manual_seed(0)
    cfg = GPTConfig(depth=2, width=32, heads=2, seq=16, vocab=64)
    reference = GPT(cfg)
    model = copy.deepcopy(reference)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    backend = make_backend(strict=True)
    if per_block:
        for block in model.blocks:
            block.compile(backend=backend)
        compiled = model
    else:
        compiled = torch.compile(model, backend=backend)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        batch = gpt_batch(cfg, 2, seed=step)
        for fn, opt in ((compiled, optimizer), (reference, reference_optimizer)):
            loss = fn(*batch)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    params = [
        (p.full_tensor() - q).abs().max().item()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True)
    ]
    _write(out, name, rank, {
        "losses": losses,
        "param_diff": max(params),
        "plans": len(backend.plans),
        "fallbacks": [p.fallback for p in backend.plans],
    })
    dist.destroy_process_group()


def _tp_mlp_step_error(rank, world, port, out, name, *, strict, break_rank_1):
    """One compiled TP-MLP step after ``break_rank_1()`` ran on rank 1 only;
    writes the error the step raised (None if it ran)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from ckpt import make_backend

    _init(rank, world, port)
    if rank == 1:
        break_rank_1()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = TPMLP()
    parallelize_module(model, mesh, tp_mlp_plan())
    try:
        torch.compile(model, backend=make_backend(strict=strict))(torch.randn(8, 16)).backward()
        error = None
    except Exception as exc:  # Dynamo wraps the backend's error
        error = str(exc)
    _write(out, name, rank, {"error": error})
    dist.destroy_process_group()


def _treat_erf_as_compute_heavy():
    import partitioners.ops as ops

    ops.COMPUTE_OPS = ops.COMPUTE_OPS | {torch.ops.aten.erf.default}


def _failing_solve(*args):
    raise RuntimeError("injected failure")


def _make_partitioning_fail():
    import partitioners.partition as partition_module

    partition_module.solve_with_budget = _failing_solve


def mismatch(rank, world, port, out):
    """Rank 1 runs a different op policy: both ranks must stop with a clear error."""
    _tp_mlp_step_error(rank, world, port, out, "mismatch", strict=True,
                       break_rank_1=_treat_erf_as_compute_heavy)


def lone_fallback(rank, world, port, out):
    """Only rank 1 fails to partition: both ranks must stop, not run apart."""
    _tp_mlp_step_error(rank, world, port, out, "lone_fallback", strict=False,
                       break_rank_1=_make_partitioning_fail)



def profiled_rank(rank, world, port, out):
    """A model compiled at budget 0.0 on each rank (under a process group, so
    measurements are agreed); rank 0 runs its first steps under a profiler
    of its own (so it measures nothing then): neither rank waits for the
    other's measurement, and both plan from the same agreed numbers."""
    import time

    import contextlib

    from ckpt import make_backend

    _init(rank, world, port)
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(4)])
    backend = make_backend(strict=True, memory_budget=0.0)
    model = torch.compile(net, backend=backend)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(rank))
    start = time.perf_counter()
    for step in range(10):
        profiling = rank == 0 and step < 4
        with torch.profiler.profile(profile_memory=True) if profiling else contextlib.nullcontext():
            model(x).square().mean().backward()
    view = backend.step_view
    view.finish_step()
    _write(out, "profiled_rank", rank, {
        "seconds": time.perf_counter() - start,
        "settled": view.settled,
        "judged": [(m.step, m.measured_bytes) for m in view.measurements if m.judged],
        "saved": [sorted(plan.saved) for plan in backend.plans],
        "profiler_on": torch._C._autograd._profiler_enabled(),
    })
    backend.close()
    dist.destroy_process_group()
