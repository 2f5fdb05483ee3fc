"""Calibrate the peak model on one model and budget: where is the peak, and why.

    python -m bench.calibrate llama8 --budget 0.0
    python -m bench.calibrate gpt --budget 0.5 --code   # and print Inductor's code

Compiles the model with ckpt, runs one step and prints, per phase (forward,
backward), the predicted peak next to the measured one, the op running when
the measured peak is reached and the sizes of the buffers alive then (CPU
profiler memory events: +bytes on allocation, -bytes on free, a size
multiset), and whether Inductor's reorder_for_peak_memory kept graph order
for each compiled graph. This is the calibration method of docs/peak_model.md in one
command: a missing term in the model shows up as a buffer size nobody
predicted.
"""
from __future__ import annotations

import argparse
import ast
import collections
import contextlib
import dataclasses
import logging

import torch
from torch.profiler import ProfilerActivity, profile

from bench.harness import fresh_inductor_cache, prepare, predicted_step_peak
from ckpt.step_meter import quiet_native_stderr
from bench.measure import memory_events, peak_of
from bench.modes import parse_mode
from bench.peak_model import cases
from bench.report import MiB
from ckpt.backend import plan_settings
from partitioners import peak


@dataclasses.dataclass
class PhasePeak:
    """One phase's measured peak above what was live before it."""

    peak_bytes: int
    end_bytes: int  # live at the end of the phase, above the start
    op_at_peak: str
    live_at_peak: collections.Counter  # size in bytes -> how many buffers


def measure_phase(fn) -> tuple[object, PhasePeak]:
    """Run ``fn`` under the profiler; return its result and its PhasePeak."""
    with quiet_native_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    # Memory as the bench measures it (bench.measure), ops for naming the peak.
    memory = memory_events(prof)
    peak, reached = peak_of(memory)
    ops = [
        (event.start_ns(), event.start_ns() + event.duration_ns(), event.name())
        for event in prof.profiler.kineto_results.events()
        if event.device_type() == torch.autograd.DeviceType.CPU and event.name() != "[memory]"
        and event.duration_ns() > 0
    ]
    sizes: collections.Counter = collections.Counter()
    for event in memory[:reached]:
        sizes[abs(event.nbytes)] += 1 if event.nbytes > 0 else -1
    peak_time = memory[reached - 1].time_ns if reached else None
    live = sum(event.nbytes for event in memory)
    return out, PhasePeak(peak, live, _innermost(ops, peak_time), +sizes)


def _innermost(ops, time) -> str:
    """The shortest op whose time range holds ``time``."""
    holding = [op for op in ops if time is not None and op[0] <= time <= op[1]]
    return min(holding, key=lambda op: op[1] - op[0])[2] if holding else "-"


@contextlib.contextmanager
def capture_reorders():
    """Inductor's ``reorder_for_peak_memory`` decisions meanwhile, one list
    of ``(order, estimated peak bytes)`` per compiled graph, baseline first
    (torch/_inductor/memory.py logs them at INFO). The model follows the
    baseline order: where another wins, its prediction may miss (the training
    GPT's forward is reordered least-peak-first)."""
    decisions: list[list[tuple[str, int]]] = []

    class Collect(logging.Handler):
        def emit(self, record):
            message = record.getMessage()
            if message.startswith("Reordering for peak memory"):
                decisions.append([])
            elif " peak memory: " in message and decisions:
                name, value = message.split(" peak memory: ")
                decisions[-1].append((name.removeprefix("topological_sort_").lower(), int(value)))

    logger, handler = logging.getLogger("torch._inductor.memory"), Collect(logging.INFO)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield decisions
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def describe_reorder(estimates: list[tuple[str, int]]) -> str:
    """One graph's decision: the order Inductor keeps (the first lowest
    estimate, as its ``min`` picks) and every estimate."""
    chosen = min(estimates, key=lambda item: item[1])[0]
    listed = ", ".join(f"{name} {value / MiB:.2f}" for name, value in estimates)
    verdict = "keeps graph order" if chosen == "baseline" else f"reorders ({chosen})"
    return f"{verdict}; Inductor's estimates MiB: {listed}"


@contextlib.contextmanager
def capture_partitions():
    """Every Partition ckpt builds meanwhile (its GraphFacts and Plan)."""
    from partitioners import partition as module

    captured, real = [], module.partition

    def partition(*args, **kwargs):
        captured.append(real(*args, **kwargs))
        return captured[-1]

    module.partition = partition
    try:
        yield captured
    finally:
        module.partition = real


def predicted_backward(part, top: int = 12) -> None:
    """The backward walk of the peak model: the node at its peak and the
    largest buffers it holds alive then."""
    facts = part.facts
    by_name = {node.name: node for node in facts.nodes}
    saved = {by_name[name] for name in part.plan.saved}
    trace: list = []
    peak.estimate_step_peak(facts, saved, backward_trace=trace)
    held = facts.saved_storages(saved)
    gradients = {peak.owner(n, facts) for n in facts.backward_outputs}
    node, now, alive, _ = max(trace, key=lambda step: step[1])
    ceiling = max(step[3] for step in trace)
    print(f"  model of Inductor's estimate for this backward (its reuse pool's ceiling): {ceiling / MiB:.2f} MiB")
    print(f"  predicted backward peak {now / MiB:.2f} MiB at {node.name} ({node.target}); largest alive:")
    for buffer in sorted(alive, key=lambda b: -facts.nodes[b].nbytes)[:top]:
        tangent = buffer.op == "placeholder" and buffer not in facts.inputs
        role = "saved" if buffer in held else "gradient" if buffer in gradients else "tangent" if tangent else ""
        print(f"    {facts.nodes[buffer].nbytes / MiB:8.3f} MiB  {buffer.name} {role}")
    first_node, _, first_alive, _ = trace[0]
    before = set(first_alive) - {first_node}  # what the walk started with: saved values, tangents
    # Net by size, as the measured phase's own: a saved value freed cancels one made of its size.
    made = collections.Counter(facts.nodes[b].nbytes for b in alive if b not in before)
    made.subtract(facts.nodes[b].nbytes for b in before - alive)
    print("  buffers the model holds then, made in backward less saved ones freed (as the measured phase's own):")
    _print_sizes(+made)


def calibrate(case, budget: str | None, show_code: bool = False, inductor: dict | None = None) -> None:
    mode = parse_mode("ckpt" if budget is None else f"ckpt+budget={budget}")
    torch.manual_seed(0)
    base = case.build()
    logs = {"output_code": True} if show_code else {}
    with fresh_inductor_cache(), _logs(**logs), torch._inductor.config.patch(inductor or {}), \
            capture_partitions() as parts, capture_reorders() as reorders:
        prep = prepare(case, base, mode, case.batch, "cpu")
        torch.manual_seed(0)
        prep.step()  # compiles
    prep.model.zero_grad(set_to_none=True)
    loss, forward = measure_phase(prep.loss)
    _, backward = measure_phase(loss.backward)
    del loss
    plans = prep.runner.plans_called()  # this step's (a model may recompile on its second)
    print(f"{case.name} {mode}: {len(plans)} graph(s)")
    for i, plan in enumerate(plans):
        e = plan.peak_estimate
        print(f"  graph {i}: predicted forward {e.forward_bytes / MiB:.2f} MiB, held {e.held_bytes / MiB:.2f}, "
              f"backward {e.backward_bytes / MiB:.2f} (saved by plan {plan.saved_activation_bytes / MiB:.2f})")
    print(f"  predicted step peak {predicted_step_peak(plans) / MiB:.2f} MiB")
    for i, estimates in enumerate(reorders):
        if estimates:
            print(f"  Inductor graph {i} (in compile order: forward, then backward): {describe_reorder(estimates)}")
    print(f"  measured forward {forward.peak_bytes / MiB:.2f} MiB, live after forward {forward.end_bytes / MiB:.2f}, "
          f"backward {(forward.end_bytes + backward.peak_bytes) / MiB:.2f} (from the step's start)")
    # The walk reads Inductor's settings: those the graphs compiled with.
    settings = plan_settings(budget, inductor or {})
    with torch._inductor.config.patch(settings):
        for part in parts:
            predicted_backward(part)
    for name, phase in (("forward", forward), ("backward", backward)):
        print(f"  {name} peak reached in {phase.op_at_peak}; buffers alive then (phase's own):")
        _print_sizes(phase.live_at_peak)


def _print_sizes(sizes: collections.Counter, top: int = 12) -> None:
    """Buffer sizes, the most bytes first."""
    for size, count in sorted(sizes.items(), key=lambda kv: -kv[0] * kv[1])[:top]:
        print(f"    {count:3d} x {size / MiB:8.3f} MiB")


@contextlib.contextmanager
def _logs(**kinds):
    if not kinds:
        yield
        return
    torch._logging.set_logs(**kinds)
    try:
        yield
    finally:
        torch._logging.set_logs()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--budget", default=None, help="a CKPT_MEMORY_BUDGET value; none by default")
    parser.add_argument("--code", action="store_true", help="print Inductor's generated code")
    parser.add_argument("--inductor", nargs="*", default=[], metavar="NAME=VALUE",
                        help="torch._inductor.config settings for the compile, e.g. reorder_for_peak_memory=False")
    args = parser.parse_args(argv)
    inductor = {name: ast.literal_eval(value) for name, value in (s.split("=", 1) for s in args.inductor)}
    for case in cases([args.model]):
        calibrate(case, args.budget, args.code, inductor)


if __name__ == "__main__":
    main()
