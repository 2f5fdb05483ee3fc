"""The peak model, measured: ckpt's predicted step peak against the measured one.

    python -m bench.peak_model                 # into bench/results/peak/
    python -m bench.peak_model --models gpt llama8

For every model (the default preset's built-ins and the real transformers
models) and every budget point (no budget, 0.5, 0.0), one training step's
peak is measured (CPU: profiler memory events), once ckpt's step view has
settled on the plans it runs on (the steps that took are in the table), and
printed next to
``Plan.estimated_peak_bytes`` (graphs composed as the harness does). Then
three ``peak:`` budgets between the measured peaks of the lowest-peak plan
and the default plan are run, each checked against its target. Writes ``peak.md``, ``peak.json``
and ``peak_scatter.png`` (predicted vs measured, one point per run).
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from bench import real
from bench.cases import BUILTIN, builtin_case
from bench.harness import Settings, fresh_inductor_cache, run_case, warm_up_compiler
from bench.modes import parse_modes
from bench.report import MiB, machine_info, machine_line, mib

POINTS = ("ckpt", "ckpt+budget=0.5", "ckpt+budget=0.0")
# Peak targets at these shares of the way from the measured peak of the
# lowest-peak plan (budget 0.0) up to the default plan's, as a user would
# place them after one run of each.
TARGET_SHARES = (0.25, 0.5, 0.75)
# The bar: predictions within 10% of the measurement, and two plans
# whose measured peaks differ by more than 10% ranked alike.
TOLERANCE = 0.10


def cases(names):
    for name in names:
        if name in BUILTIN:
            yield builtin_case(name, "default")
        elif (reason := real.missing(name)) is None:
            yield real.real_case(name)
        else:
            print(f"skipping {name}: {reason}")


def measure_model(case, settings: Settings) -> list[dict]:
    """Every budget point, then the peak targets between its extremes."""
    rows = _rows(case, run_case(case, parse_modes(POINTS), settings, speed=False, grads=False))
    measured = {r["mode"]: r["measured_bytes"] for r in rows}
    low, high = measured.get("ckpt+budget=0.0"), measured.get("ckpt")
    if low is None or high is None or high <= low:
        return rows
    targets = [int(low + share * (high - low)) for share in TARGET_SHARES]
    modes = parse_modes([f"ckpt+budget=peak:{t}B" for t in targets])
    peak_rows = _rows(case, run_case(case, modes, settings, speed=False, grads=False))
    for row, target in zip(peak_rows, targets):
        row["target_bytes"] = target
        row["within_target"] = row["measured_bytes"] is not None and row["measured_bytes"] <= target
    return rows + peak_rows


def _rows(case, result) -> list[dict]:
    return [
        {
            "model": case.name,
            "mode": r.mode,
            "predicted_bytes": r.predicted_peak_bytes,
            "measured_bytes": r.peak_bytes,
            "saved_bytes": r.saved_bytes,
            "settle_steps": r.settle_steps,
            "error": r.error,
        }
        for r in result.modes
    ]


def relative_error(row: dict) -> float | None:
    if row["predicted_bytes"] is None or not row["measured_bytes"]:
        return None
    return row["predicted_bytes"] / row["measured_bytes"] - 1


def misordered(rows: list[dict]) -> list[tuple[str, str, str]]:
    """Pairs of runs of one model whose measured peaks differ by more than
    TOLERANCE but whose predictions are in the other order."""
    bad = []
    for i, a in enumerate(rows):
        for b in rows[i + 1:]:
            if a["model"] != b["model"] or None in (a["predicted_bytes"], b["predicted_bytes"],
                                                    a["measured_bytes"], b["measured_bytes"]):
                continue
            low, high = sorted((a, b), key=lambda r: r["measured_bytes"])
            if high["measured_bytes"] > (1 + TOLERANCE) * low["measured_bytes"] \
                    and high["predicted_bytes"] < low["predicted_bytes"]:
                bad.append((a["model"], low["mode"], high["mode"]))
    return bad


def above_looser(rows: list[dict]) -> list[tuple[str, str, str]]:
    """Budgets whose measured peak is above a looser point's of the same
    model: any budget above the default plan ("ckpt"), 0.0 above 0.5."""
    measured = {(r["model"], r["mode"]): r["measured_bytes"] for r in rows if r["measured_bytes"]}
    bad = []
    for (model, mode), peak in measured.items():
        looser = ["ckpt"] if mode != "ckpt" else []
        looser += ["ckpt+budget=0.5"] if mode == "ckpt+budget=0.0" else []
        bad += [(model, mode, other) for other in looser
                if (model, other) in measured and peak > measured[(model, other)]]
    return bad


def to_markdown(data: dict) -> str:
    rows = data["rows"]
    errors = [e for e in map(relative_error, rows) if e is not None]
    lines = [
        "# Peak model: predicted vs measured step peak", "", machine_line(data["machine"]), "",
        "| model | mode | predicted MiB | measured MiB | error | target MiB | within target | steps to settle |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        error = relative_error(r)
        target = r.get("target_bytes")
        lines.append(
            f"| {r['model']} | {r['mode']} | {mib(r['predicted_bytes'])} | {mib(r['measured_bytes'])} | "
            + ("-" if error is None else f"{100 * error:+.1f}%")
            + f" | {mib(target)} | "
            + ("-" if target is None else "yes" if r["within_target"] else "NO")
            + f" | {r.get('settle_steps', '-')} |"
            + (f" {r['error']}" if r["error"] else "")
        )
    bad_order = misordered(rows)
    peak_runs = [r for r in rows if "target_bytes" in r]
    lines += [
        "",
        f"- runs: {len(errors)}; within {100 * TOLERANCE:.0f}%: "
        f"{sum(abs(e) <= TOLERANCE for e in errors)}; largest error: "
        + (f"{100 * max(errors, key=abs):+.1f}%" if errors else "-"),
        f"- pairs measured more than {100 * TOLERANCE:.0f}% apart but predicted in the other order: "
        + (", ".join(f"{m}: {a} < {b}" for m, a, b in bad_order) or "none"),
        "- budgets measured above a looser point (any above no budget, 0.0 above 0.5): "
        + (", ".join(f"{m}: {a} > {b}" for m, a, b in above_looser(rows)) or "none"),
        f"- peak budgets whose measured peak is within the target: "
        f"{sum(r['within_target'] for r in peak_runs)} of {len(peak_runs)}",
    ]
    return "\n".join(lines)


def scatter(rows: list[dict], path: str) -> None:
    """Predicted (y) against measured (x), log-log, with the 10% band."""
    from bench.plots import plt, save

    points = [r for r in rows if relative_error(r) is not None]
    fig, ax = plt.subplots(figsize=(6.4, 5.6))
    models = sorted({r["model"] for r in points})
    for model in models:
        mine = [r for r in points if r["model"] == model]
        ax.scatter([r["measured_bytes"] / MiB for r in mine], [r["predicted_bytes"] / MiB for r in mine],
                   label=model, s=18)
    if points:
        low = min(min(r["measured_bytes"], r["predicted_bytes"]) for r in points) / MiB / 1.3
        high = max(max(r["measured_bytes"], r["predicted_bytes"]) for r in points) / MiB * 1.3
        ax.plot([low, high], [low, high], color="black", linewidth=0.8)
        for factor in (1 - TOLERANCE, 1 + TOLERANCE):
            ax.plot([low, high], [low * factor, high * factor], color="gray", linewidth=0.6, linestyle="--")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured step peak (MiB)")
    ax.set_ylabel("predicted step peak, Plan.estimated_peak_bytes (MiB)")
    ax.set_title("ckpt's peak model: every model and budget point (dashed: +-10%)", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, ncol=2)
    save(fig, path)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=[*BUILTIN, *real.REAL])
    parser.add_argument("--out", default="bench/results/peak")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    data = {"machine": machine_info("cpu"), "rows": []}
    settings = Settings(probes=0)
    with fresh_inductor_cache():  # every mode compiles afresh and records its Plans
        warm_up_compiler("cpu")
        for case in cases(args.models):
            rows = measure_model(case, settings)
            data["rows"] += rows
            for r in rows:
                print(f"{r['model']} {r['mode']}: predicted {mib(r['predicted_bytes'])} MiB, "
                      f"measured {mib(r['measured_bytes'])} MiB", flush=True)
    text = to_markdown(data)
    with open(os.path.join(args.out, "peak.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out, "peak.json"), "w") as f:
        json.dump(data, f, indent=1, default=str)
    scatter(data["rows"], os.path.join(args.out, "peak_scatter.png"))
    print(text)
    torch._dynamo.reset()


if __name__ == "__main__":
    main()
