"""results.json (every raw number, and the machine) and results.md (tables)."""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import re

import torch

from bench.harness import CaseResult, ModeResult

MiB = 2**20


def cpu_name() -> str:
    """The processor's model name (Linux's /proc/cpuinfo), else platform's guess."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info(device: str) -> dict:
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        # oneDNN's kernels (and so CPU peaks near convolutions) follow the
        # instruction set: ConvNeXt's eager step peaks at 20.96 MiB on an
        # AVX2 EPYC and 31.25 on the machine of an earlier run.
        "cpu": cpu_name(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "device": device,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if device.startswith("cuda"):
        info["device_name"] = torch.cuda.get_device_name(device)
    return info


def machine_line(info: dict) -> str:
    """The machine in one line, for a results.md header: CPU peaks depend on it."""
    return (f"torch {info['torch']}, {info['threads']} threads, {info.get('cpu', 'unknown CPU')} "
            f"({info.get('cpu_capability', '?')}), {info['device']}")


def sweep_depth(name: str) -> int:
    """The depth from a sweep case's name, ``gpt-depth-16`` -> 16."""
    return int(name.rsplit("-", 1)[1])


def to_json(models: list[CaseResult], sweep: list[CaseResult], meta: dict) -> dict:
    return {
        **meta,
        "models": [dataclasses.asdict(case) for case in models],
        "sweep": [
            {"depth": sweep_depth(case.name), **dataclasses.asdict(mode)}
            for case in sweep for mode in case.modes
        ],
    }


def write_json(path: str, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


def mib(nbytes) -> str:
    return "-" if nbytes is None else f"{nbytes / MiB:.2f}"


def _num(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _notes(r: ModeResult) -> str:
    notes = []
    if r.fallback:
        notes.append(f"fell back to PyTorch's partitioner: {r.fallback}")
    if r.error:
        notes.append(f"error: {r.error}")
    return "; ".join(notes).replace("|", "/")


def _partitioner(r: ModeResult) -> str:
    text = _num(r.partitioner_s, ".2f")
    return text + (f" (solve {r.solve_s:.2f})" if r.solve_s is not None else "")


def model_table(case: CaseResult) -> str:
    base = next((r for r in case.modes if r.mode == "compile" and r.step_s), None)
    rate = f"{case.unit}/s"
    lines = [
        f"### {case.name}: {case.description}, batch {case.batch}",
        "",
        f"Memory cap for the batch search: {mib(case.cap_bytes)} MiB ({case.cap_source})."
        if case.cap_bytes is not None else "No batch search (--probes 0).",
        "",
        f"| mode | saved MiB | peak MiB | step ms (median) | vs compile | {rate} "
        f"| max grad diff vs {case.reference} | compile s | partitioner s "
        f"| largest batch under cap | {rate} there | notes |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in case.modes:
        ratio = f"{r.step_s / base.step_s:.2f}" if base and r.step_s else "-"
        lines.append(
            f"| {r.mode} | {mib(r.saved_bytes)} | {mib(r.peak_bytes)} "
            f"| {_num(r.step_s and r.step_s * 1e3, '.1f')} | {ratio} | {_num(r.throughput, ',.0f')} "
            f"| {_num(r.max_grad_diff, '.1e')} | {_num(r.compile_s, '.1f')} | {_partitioner(r)} "
            f"| {_num(r.cap_batch, 'd')} | {_num(r.cap_throughput, ',.0f')} | {_notes(r)} |"
        )
    return "\n".join(lines)


def ledger_table(rows: list[tuple[str, object, int | None, int | None]]) -> str:
    """The memory ledger of each mode, from ``(mode, Ledger, plan's saved
    bytes or None, predicted peak bytes or None)`` rows: the full size of
    each part, then what is alive at the step's peak. ckpt's estimates
    stand beside the measurements they estimate."""
    lines = [
        "| mode | parameters MiB | optimizer state MiB | gradients MiB | saved MiB (plan) "
        "| peak MiB (predicted) | peak in | at the peak: gradients / saved / temporaries MiB "
        "| total at the peak MiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, ledger, plan_saved, predicted in rows:
        lines.append(
            f"| {mode} | {mib(ledger.parameters_bytes)} | {mib(ledger.optimizer_state_bytes)} "
            f"| {mib(ledger.gradients_bytes)} | {mib(ledger.saved_activations_bytes)}{_estimate(plan_saved)} "
            f"| {mib(ledger.peak_bytes)}{_estimate(predicted)} | {ledger.peak_phase} "
            f"| {mib(ledger.gradients_at_peak)} / {mib(ledger.saved_at_peak)} / {mib(ledger.temporaries_at_peak)} "
            f"| {mib(ledger.total_at_peak)} |"
        )
    return "\n".join(lines)


def _estimate(nbytes) -> str:
    return "" if nbytes is None else f" ({mib(nbytes)})"


def sweep_table(sweep: list[CaseResult]) -> str:
    # The sizes but the depth, which the rows give.
    shape = re.sub(r"\d+ layers, ", "", sweep[0].description) if sweep else ""
    lines = [
        f"### depth sweep: {shape}, batch {sweep[0].batch if sweep else '-'}",
        "",
        "| depth | mode | saved MiB | peak MiB | compile s | partitioner s | notes |",
        "|---|---|---|---|---|---|---|",
    ]
    for case in sweep:
        for r in case.modes:
            lines.append(
                f"| {sweep_depth(case.name)} | {r.mode} | {mib(r.saved_bytes)} | {mib(r.peak_bytes)} "
                f"| {_num(r.compile_s, '.1f')} | {_partitioner(r)} | {_notes(r)} |"
            )
    return "\n".join(lines)


LEGEND = """\
saved MiB: bytes autograd keeps for backward (saved_tensors_hooks, each storage
once, parameters and inputs excluded). peak MiB: peak allocated during one
training step (forward and backward), above parameters and inputs (CPU:
profiler memory events; CUDA: max_memory_allocated). step ms: median of the
timed steps, modes interleaved; vs compile: its ratio to `compile`'s (times
on a shared machine are noisy: read ratios near 1 as "the same speed").
compile s: wall time of the first step, compile included, in a fresh Inductor
cache (kernels shared with an earlier mode of the same run may be reused).
partitioner s: time in the partitioner call (PyTorch's record of it), with
ckpt's own solve time where its plans give one. max grad diff: largest
|grad - reference grad| after one step from the same seed; with dropout the
reference is `compile` (eager draws other masks, so eager modes differ).
largest batch under cap: the largest batch whose peak fits under the cap
given above each table, found by doubling or halving, then bisection, on one
more compile per mode with the batch dimension dynamic (so a probe is two
steps, not a compile). Without --cap, the cap is `compile`'s peak at the
default batch in that same dynamic graph (it may differ a little from the
static peak in the table); the throughput there is the median of a few steps."""


LEDGER_LEGEND = (
    "parameters and buffers and the optimizer state live before the step; the step's peak is above "
    "them; at the peak, each allocation of the step is a gradient, a saved activation, or a temporary "
    "(the rest); in parentheses, ckpt's plan and predicted peak"
)


def busy_machine_note(meta: dict) -> list[str]:
    """A warning when other processes competed for the CPUs: the suite itself
    keeps at most one CPU per thread busy, so a load average clearly above
    that means contention, and step times (not memory) are then unreliable."""
    load, threads = meta.get("max_load_average"), meta["machine"]["threads"]
    if load is None or load <= threads + 0.5:
        return []
    return [f"**The machine was busy** (load average up to {load:.1f} with {threads} threads): "
            "step times and throughput are unreliable in this run; memory numbers are not affected.", ""]


def to_markdown(models: list[CaseResult], sweep: list[CaseResult], meta: dict) -> str:
    m = meta["machine"]
    lines = [
        "# ckpt bench results",
        "",
        f"{m['date']}; {m['platform']}, {m['cpu_count']} CPUs, {m['threads']} threads, "
        f"torch {m['torch']}, device {m.get('device_name', m['device'])}; "
        f"preset {meta['settings']['preset']}, {meta['elapsed_s']:.0f} s in all.",
        "",
        *busy_machine_note(meta),
        LEGEND,
        "",
    ]
    for case in models:
        lines += [model_table(case), ""]
        rows = [(r.mode, r.ledger, r.plan_saved_bytes, r.predicted_peak_bytes) for r in case.modes if r.ledger]
        if rows:
            lines += [f"Memory ledger of one step (no optimizer in this step; {LEDGER_LEGEND}):", "",
                      ledger_table(rows), "", f"![{case.name} memory ledger]({case.name}_memory_ledger.png)", ""]
    if sweep:
        lines += [sweep_table(sweep), ""]
    for skipped in meta.get("skipped", []):
        lines.append(f"- skipped {skipped['model']}: {skipped['reason']}")
    return "\n".join(lines).rstrip() + "\n"
