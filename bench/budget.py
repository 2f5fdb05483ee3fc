"""The memory budget, measured: honored, monotone, against PyTorch's budget.

    python -m bench.budget                       # all parts, into bench/results/budget/
    python -m bench.budget --parts sweep depth   # some of them

Parts:
- ``sweep``: a 12-layer GPT-style decoder under ckpt fractions and PyTorch's
  activation_memory_budget, with eager + checkpoint per block and the
  default compile: peak, saved bytes, step time side by side; is ckpt's peak
  monotone in its budget, and does every PyTorch point have a ckpt point
  with no more peak and no more step time? One PNG with both frontiers.
- ``honored``: byte budgets from the runtime-optimal size down to 10% of it
  on every built-in model: measured saved bytes against the budget.
- ``depth``: the depth sweep at the tightest budget vs the default compile,
  with the exponent of peak ~ depth^k fitted on a log-log scale.
- ``solver``: the partitioner's own time at 6, 24 and 48 layers, ckpt with a
  budget against PyTorch with one (joint graphs only, no codegen).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os

import torch

from bench.cases import builtin_case, gpt_case
from bench.harness import CaseResult, Settings, fresh_inductor_cache, run_case, warm_up_compiler
from bench.models import GPTConfig
from bench.modes import parse_mode, parse_modes
from bench.report import machine_info

MiB = 2**20
PARTS = ("sweep", "honored", "depth", "solver")
CKPT_FRACTIONS = (1.0, 0.7, 0.4, 0.2, 0.0)
PYTORCH_FRACTIONS = (0.5, 0.2, 0.05)
# The bench's GPT, 12 layers deep, at a width that compiles
# in well under a minute on 2 cores.
SWEEP_GPT = GPTConfig(depth=12, width=128, heads=4, seq=256, vocab=512)
SWEEP_BATCH = 4
HONORED_MODELS = ("mlp", "gpt", "gpt-dropout", "convnet")
HONORED_FRACTIONS = (1.0, 0.7, 0.4, 0.1)
# Activations dominate gradients here (2048 tokens of width 64), so the
# sweep shows how saved activations grow, not how parameters do.
DEPTH_GPT = GPTConfig(width=64, heads=4, seq=256, vocab=256)
DEPTH_BATCH = 8
DEPTHS = (4, 8, 16, 32)
DEPTH_CKPT_MODES = ("ckpt", "ckpt+budget=0.5", "ckpt+budget=0.0")
SOLVER_DEPTHS = (6, 24, 48)


def sweep(settings: Settings) -> dict:
    """ckpt's fractions against PyTorch's on the 12-layer decoder."""
    modes = parse_modes(
        ["eager+checkpoint", "compile"]
        + [f"compile+budget={f}" for f in PYTORCH_FRACTIONS]
        + [f"ckpt+budget={f}" for f in CKPT_FRACTIONS]
    )
    case = gpt_case(SWEEP_GPT, SWEEP_BATCH, name="gpt-12")
    result = run_case(case, modes, dataclasses.replace(settings, probes=0))
    rows = {r.mode: r for r in result.modes}
    ckpt = [rows[f"ckpt+budget={f}"] for f in CKPT_FRACTIONS]
    pytorch = [rows[f"compile+budget={f}"] for f in PYTORCH_FRACTIONS]
    peaks = [r.peak_bytes for r in ckpt]
    dominated = {
        p.mode: [c.mode for c in ckpt if c.peak_bytes <= p.peak_bytes and c.step_s <= p.step_s]
        for p in pytorch
    }
    checkpoint = rows["eager+checkpoint"]
    tight = ckpt[-1]
    return {
        "case": case.description,
        "batch": case.batch,
        "modes": [dataclasses.asdict(r) for r in result.modes],
        "monotone": all(a >= b for a, b in zip(peaks, peaks[1:])),
        "pytorch_points_matched": dominated,
        "tight_vs_eager_checkpoint": {
            "peak_ratio": tight.peak_bytes / checkpoint.peak_bytes,
            "step_ratio": tight.step_s / checkpoint.step_s,
        },
        "_result": result,
    }


def honored(settings: Settings, preset: str) -> list[dict]:
    """Per model: the runtime-optimal saved bytes, then byte budgets below it."""
    rows = []
    for name in HONORED_MODELS:
        case = builtin_case(name, preset)
        optimal = run_case(case, [parse_mode("ckpt")], settings, speed=False, grads=False).modes[0]
        budgets = [max(1, int(optimal.plan_saved_bytes * f)) for f in HONORED_FRACTIONS]
        modes = [parse_mode(f"ckpt+budget={b}B") for b in budgets]
        for budget, r in zip(budgets, run_case(case, modes, settings, speed=False).modes):
            rows.append({
                "model": name,
                "budget_bytes": budget,
                "fraction_of_optimal": budget / optimal.plan_saved_bytes,
                "measured_saved_bytes": r.saved_bytes,
                "plan_saved_bytes": r.plan_saved_bytes,
                "peak_bytes": r.peak_bytes,
                "max_grad_diff": r.max_grad_diff,
                "honored": r.saved_bytes is not None and r.saved_bytes <= budget,
                "error": r.error,
            })
    return rows


def depth(settings: Settings) -> dict:
    """Peak vs depth: the default compile, and ckpt at fractions from 1.0 (no
    budget) to its tightest, whose peaks must not rise as the budget falls."""
    modes = parse_modes(["compile", *DEPTH_CKPT_MODES])
    results = []
    for layers in DEPTHS:
        case = gpt_case(dataclasses.replace(DEPTH_GPT, depth=layers), DEPTH_BATCH, name=f"depth-{layers}")
        results.append(run_case(case, modes, settings, speed=False, grads=False))
    fits = {}
    for index, mode in enumerate(modes):
        peaks = [case.modes[index].peak_bytes for case in results]
        fits[str(mode)] = {
            "peaks": peaks,
            "saved": [case.modes[index].saved_bytes for case in results],
            "exponent": _loglog_slope(DEPTHS, peaks),
        }
    ckpt_peaks = [fits[mode]["peaks"] for mode in DEPTH_CKPT_MODES]
    monotone = [all(a >= b for a, b in zip(column, column[1:])) for column in zip(*ckpt_peaks)]
    return {"depths": list(DEPTHS), "modes": fits, "monotone": monotone}


def solver_times() -> list[dict]:
    """Seconds each partitioner takes at budget 0.2 (ckpt) and 0.2 (PyTorch)."""
    from bench.partition_time import time_partitioners

    return [time_partitioners(layers, ckpt_budget=0.2, pytorch_budget=0.2) for layers in SOLVER_DEPTHS]


def _loglog_slope(xs, ys) -> float:
    """Least-squares slope of log y on log x: y ~ x^slope."""
    lx = [math.log(x) for x in xs]
    ly = [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def frontier_plot(result: CaseResult, path: str) -> None:
    """Peak vs step time: ckpt's budget frontier and PyTorch's, one PNG."""
    from bench.plots import plt, save, style_axes

    fig, ax = plt.subplots(figsize=(7, 5))
    groups = {"ckpt+budget": [], "compile+budget": []}
    for r in result.modes:
        point = (r.step_s * 1e3, r.peak_bytes / MiB, r.mode)
        for prefix, points in groups.items():
            if r.mode.startswith(prefix):
                points.append(point)
                break
        else:
            ax.scatter(point[0], point[1], marker="s", color="gray")
            ax.annotate(r.mode, point[:2], textcoords="offset points", xytext=(5, -10), fontsize=8)
    for (prefix, points), style in zip(groups.items(), ("o-", "^--")):
        points.sort(key=lambda p: -p[1])
        ax.plot([p[0] for p in points], [p[1] for p in points], style,
                label="ckpt, CKPT_MEMORY_BUDGET" if prefix == "ckpt+budget" else "PyTorch, activation_memory_budget")
        for x, y, label in points:
            ax.annotate(label.split("=")[1], (x, y), textcoords="offset points", xytext=(5, 3), fontsize=8)
    style_axes(ax, "step time, median (ms)", "peak memory of one training step (MiB)",
               f"{result.description}, batch {result.batch}", legend=True)
    save(fig, path)


def to_markdown(data: dict) -> str:
    lines = [f"# Memory budget: {data['machine']['torch']}, {data['machine']['threads']} threads", ""]
    if "sweep" in data:
        s = data["sweep"]
        lines += [f"## Budget sweep: {s['case']}, batch {s['batch']}", "",
                  "| mode | saved MiB | peak MiB | step ms | max grad diff |", "|---|---|---|---|---|"]
        for r in s["modes"]:
            lines.append(f"| {r['mode']} | {_mib(r['saved_bytes'])} | {_mib(r['peak_bytes'])} | "
                         f"{_ms(r['step_s'])} | {_sci(r['max_grad_diff'])} |")
        tight = s["tight_vs_eager_checkpoint"]
        lines += ["", f"- ckpt peak monotone as its budget falls: {'yes' if s['monotone'] else 'NO'}",
                  "- each PyTorch budget point, and the ckpt points with no more peak and no more step time: "
                  + "; ".join(f"{p}: {', '.join(m) or 'NONE'}" for p, m in s["pytorch_points_matched"].items()),
                  f"- ckpt+budget=0.0 vs eager+checkpoint: peak x{tight['peak_ratio']:.2f}, step x{tight['step_ratio']:.2f}",
                  ""]
    if "honored" in data:
        lines += ["## Byte budgets honored", "",
                  "| model | budget | of optimal | measured saved | peak MiB | honored | max grad diff |",
                  "|---|---|---|---|---|---|---|"]
        for r in data["honored"]:
            lines.append(f"| {r['model']} | {r['budget_bytes']} | {r['fraction_of_optimal']:.2f} | "
                         f"{r['measured_saved_bytes']} | {_mib(r['peak_bytes'])} | {'yes' if r['honored'] else 'NO'} | "
                         f"{_sci(r['max_grad_diff'])} |")
        lines.append("")
    if "depth" in data:
        d = data["depth"]
        lines += ["## Peak memory vs depth", "", "| mode | " + " | ".join(f"{x} layers" for x in d["depths"])
                  + " | fitted exponent |", "|---" * (len(d["depths"]) + 2) + "|"]
        for mode, row in d["modes"].items():
            lines.append(f"| {mode} | " + " | ".join(_mib(p) for p in row["peaks"]) + f" | {row['exponent']:.2f} |")
        if "monotone" in d:
            verdicts = ", ".join(f"{x} layers: {'yes' if ok else 'NO'}" for x, ok in zip(d["depths"], d["monotone"]))
            lines += ["", f"- ckpt peak monotone as its budget falls ({' > '.join(DEPTH_CKPT_MODES)}): {verdicts}"]
        lines.append("")
    if "solver" in data:
        lines += ["## Partitioner time with a budget (joint graphs, no codegen)", "",
                  "| layers | nodes | ckpt s (budget 0.2) | PyTorch s (budget 0.2) |", "|---|---|---|---|"]
        for r in data["solver"]:
            lines.append(f"| {r['depth']} | {r['nodes']} | {r['ckpt_s']:.2f} | {r['pytorch_s']:.2f} |")
        lines.append("")
    return "\n".join(lines)


def _mib(nbytes) -> str:
    return "-" if nbytes is None else f"{nbytes / MiB:.1f}"


def _ms(seconds) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f}"


def _sci(value) -> str:
    return "-" if value is None else f"{value:.1e}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--repeats", type=int, default=5, help="interleaved timed steps per mode")
    parser.add_argument("--preset", default="default", help="sizes of the honored part's models")
    parser.add_argument("--out", default="bench/results/budget")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    with fresh_inductor_cache():  # every mode compiles (and records its plan) afresh
        data = _run_parts(args)
    previous = os.path.join(args.out, "budget.json")
    if os.path.exists(previous):  # parts not run this time keep their last results
        with open(previous) as f:
            data = {**json.load(f), **data}
    text = to_markdown(data)
    with open(os.path.join(args.out, "budget.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out, "budget.json"), "w") as f:
        json.dump(data, f, indent=1, default=str)
    print(text)
    torch._dynamo.reset()


def _run_parts(args) -> dict:
    settings = Settings(repeats=args.repeats, probes=0)
    data: dict = {"machine": machine_info("cpu")}
    warm_up_compiler("cpu")
    if "sweep" in args.parts:
        data["sweep"] = sweep(settings)
        frontier_plot(data["sweep"].pop("_result"), os.path.join(args.out, "budget_frontier.png"))
        print(to_markdown({"machine": data["machine"], "sweep": data["sweep"]}), flush=True)
    if "honored" in args.parts:
        data["honored"] = honored(settings, args.preset)
    if "depth" in args.parts:
        data["depth"] = depth(settings)
    if "solver" in args.parts:
        data["solver"] = solver_times()
    return data


if __name__ == "__main__":
    main()
