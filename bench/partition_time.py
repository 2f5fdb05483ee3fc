"""Partitioner time vs depth: ckpt and PyTorch's partitioner on the same joint graphs.

    python -m bench.partition_time --depths 6 24 48 [--budget 0.2]
    python -m bench.partition_time --families swin t5 mamba2 --budget 0.5

Traces the GPT-style decoder (or transformers families at their bench size,
bench/families.py, with Inductor's decompositions, as torch.compile traces
them) with AOTAutograd (no Inductor codegen, so it is quick) and times both
partitioners on copies of each joint graph.
"""
from __future__ import annotations

import argparse
import copy
import time

import torch
from functorch.compile import nop
from torch._dynamo.backends.common import aot_autograd

from torch._inductor.decomposition import select_decomp_table

from bench import families
from bench.models import GPT, GPTConfig, gpt_batch
from ckpt_compat import torch_default_partition
from partitioners.config import Config
from partitioners.partition import partition


def time_partitioners(depth: int, ckpt_budget=None, pytorch_budget: float = 1.0) -> dict:
    """Seconds each partitioner takes on the joint graph of a ``depth``-layer
    GPT, each under its own memory budget (None and 1.0: none)."""
    cfg = GPTConfig(depth=depth, width=64, heads=4, seq=32, vocab=128)
    timings = _time_on(lambda model: model(*gpt_batch(cfg, 2)), GPT(cfg), ckpt_budget, pytorch_budget)
    return {"depth": depth, **timings}


def time_family(name: str, ckpt_budget=None, pytorch_budget: float = 1.0) -> dict:
    """The same on a transformers family at its bench size, traced with
    Inductor's decompositions (its joint graph as torch.compile makes it)."""
    layers, width, seq, batch = families.FAMILIES[name].size
    inputs = families.batches(name, 1, batch, seq)[0]
    loss = lambda model: families.FAMILIES[name].loss(model, inputs)  # noqa: E731
    timings = _time_on(loss, families.build(name, layers, width, seq), ckpt_budget, pytorch_budget,
                       decompositions=select_decomp_table())
    return {"depth": name, **timings}


def _time_on(loss, model, ckpt_budget, pytorch_budget: float, decompositions=None) -> dict:
    timings = {}
    config = Config(memory_budget=ckpt_budget)

    def partition_fn(joint_gm, joint_inputs, **kwargs):
        try:
            for_torch = copy.deepcopy(joint_gm)
        except RuntimeError:  # a constant tensor in its metadata (T5): PyTorch's not timed
            for_torch = None
        start = time.perf_counter()
        result = partition(
            joint_gm,
            num_fwd_outputs=kwargs["num_fwd_outputs"],
            static_lifetime_input_indices=kwargs.get("static_lifetime_input_indices"),
            config=config,
        )
        timings["ckpt_s"] = time.perf_counter() - start
        timings["ckpt_cuts_s"] = result.plan.solve_time_s
        if for_torch is not None:
            start = time.perf_counter()
            with torch._functorch.config.patch(activation_memory_budget=pytorch_budget):
                torch_default_partition(for_torch, joint_inputs, **kwargs)
            timings["pytorch_s"] = time.perf_counter() - start
        timings["nodes"] = len(joint_gm.graph.nodes)
        return result.forward, result.backward

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=nop, bw_compiler=nop, partition_fn=partition_fn,
                           decompositions=decompositions)
    loss(torch.compile(model, backend=backend)).backward()
    return timings


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[6, 24, 48])
    parser.add_argument("--families", nargs="+", choices=sorted(families.FAMILIES), default=None,
                        help="instead of the GPT's depths")
    parser.add_argument("--budget", type=float, default=None,
                        help="a fraction: CKPT_MEMORY_BUDGET and activation_memory_budget alike")
    args = parser.parse_args(argv)
    print(f"| {'family' if args.families else 'layers'} | joint-graph nodes | ckpt s | PyTorch s |")
    print("|---|---|---|---|")
    pytorch_budget = 1.0 if args.budget is None else args.budget
    for depth in args.families or args.depths:
        t = (time_family if args.families else time_partitioners)(depth, args.budget, pytorch_budget)
        pytorch = f"{t['pytorch_s']:.2f}" if "pytorch_s" in t else "-"
        print(f"| {depth} | {t['nodes']} | {t['ckpt_s']:.2f} | {pytorch} |", flush=True)


if __name__ == "__main__":
    main()
