"""Partitioner time vs depth: ckpt and PyTorch's partitioner on the same joint graphs.

    python -m bench.partition_time --depths 6 24 48 [--budget 0.2]

Traces the GPT-style decoder with AOTAutograd (no Inductor codegen, so it is
quick) and times both partitioners on copies of each joint graph.
"""
from __future__ import annotations

import argparse
import copy
import time

import torch
from functorch.compile import nop
from torch._dynamo.backends.common import aot_autograd

from bench.models import GPT, GPTConfig, gpt_batch
from ckpt_compat import torch_default_partition
from partitioners.config import Config
from partitioners.partition import partition


def time_partitioners(depth: int, ckpt_budget=None, pytorch_budget: float = 1.0) -> dict:
    """Seconds each partitioner takes on the joint graph of a ``depth``-layer
    GPT, each under its own memory budget (None and 1.0: none)."""
    timings = {"depth": depth}
    config = Config(memory_budget=ckpt_budget)

    def partition_fn(joint_gm, joint_inputs, **kwargs):
        for_torch = copy.deepcopy(joint_gm)
        start = time.perf_counter()
        result = partition(
            joint_gm,
            num_fwd_outputs=kwargs["num_fwd_outputs"],
            static_lifetime_input_indices=kwargs.get("static_lifetime_input_indices"),
            config=config,
        )
        timings["ckpt_s"] = time.perf_counter() - start
        timings["ckpt_cuts_s"] = result.plan.solve_time_s
        start = time.perf_counter()
        with torch._functorch.config.patch(activation_memory_budget=pytorch_budget):
            torch_default_partition(for_torch, joint_inputs, **kwargs)
        timings["pytorch_s"] = time.perf_counter() - start
        timings["nodes"] = len(joint_gm.graph.nodes)
        return result.forward, result.backward

    torch._dynamo.reset()
    cfg = GPTConfig(depth=depth, width=64, heads=4, seq=32, vocab=128)
    backend = aot_autograd(fw_compiler=nop, bw_compiler=nop, partition_fn=partition_fn)
    torch.compile(GPT(cfg), backend=backend)(*gpt_batch(cfg, 2)).backward()
    return timings


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[6, 24, 48])
    parser.add_argument("--budget", type=float, default=None,
                        help="a fraction: CKPT_MEMORY_BUDGET and activation_memory_budget alike")
    args = parser.parse_args(argv)
    print("| layers | joint-graph nodes | ckpt s | PyTorch s |")
    print("|---|---|---|---|")
    for depth in args.depths:
        t = time_partitioners(depth, args.budget, 1.0 if args.budget is None else args.budget)
        print(f"| {depth} | {t['nodes']} | {t['ckpt_s']:.2f} | {t['pytorch_s']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
