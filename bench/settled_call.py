"""What a settled call costs: ckpt's compiled callable against Inductor's
callable inside it, once the step view has settled (issue 49: at most 5 us).

    python -m bench.settled_call [--calls 10000]

A 1-layer MLP at batch 1 under budget 0.0, trained until the view settles;
then the same arguments through both callables, interleaved, 10,000 calls a
run; medians of the runs' per-call times.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from ckpt import make_backend
from ckpt.planned_graph import PlannedGraph


def per_call_us(fn, args, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    return (time.perf_counter() - start) / calls * 1e6


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=10_000)
    parser.add_argument("--runs", type=int, default=9)
    options = parser.parse_args(argv)

    made = []
    real_compile_first = PlannedGraph.compile_first

    def capture(graph, example_inputs):
        made.append((graph, list(example_inputs)))
        return real_compile_first(graph, example_inputs)

    PlannedGraph.compile_first = capture
    try:
        torch.manual_seed(0)
        backend = make_backend(memory_budget=0.0)
        net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 1))
        model = torch.compile(net, backend=backend)
        x = torch.randn(1, 8)
        for _ in range(10):
            model(x).sum().backward()
    finally:
        PlannedGraph.compile_first = real_compile_first
    if not backend.step_view.settled_keys:
        raise SystemExit("the step view did not settle in 10 steps")
    ((planned, example),) = made
    (inductor,) = planned._compiled.values()
    # The graph's arguments in its order: parameters by shape, then the input.
    parameters, args = list(net.parameters()), []
    for value in example:
        match = next((p for p in parameters if p.shape == value.shape and not any(p is a for a in args)), None)
        args.append(match if match is not None else x)
    inner, outer = [], []
    for _ in range(options.runs):
        inner.append(per_call_us(inductor, args, options.calls))
        outer.append(per_call_us(planned, args, options.calls))
    a, b = statistics.median(inner), statistics.median(outer)
    print(f"Inductor's callable {a:.2f} us/call; ckpt's settled call {b:.2f} us/call; "
          f"overhead {b - a:.2f} us (medians of {options.runs} interleaved runs of {options.calls} calls)")
    backend.close()


if __name__ == "__main__":
    main()
