"""PNG plots of the results (matplotlib, Agg backend: no display needed)."""
from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

from bench.harness import CaseResult  # noqa: E402
from bench.ledger import Ledger  # noqa: E402
from bench.report import MiB, sweep_depth  # noqa: E402

LEDGER_PARTS = (  # bottom to top: what lives before the step, then what the step allocates
    ("parameters", "parameters_bytes", "tab:gray"),
    ("optimizer state", "optimizer_state_bytes", "tab:purple"),
    ("gradients at the peak", "gradients_at_peak", "tab:blue"),
    ("saved activations at the peak", "saved_at_peak", "tab:orange"),
    ("temporaries at the peak", "temporaries_at_peak", "tab:red"),
)


def style_axes(ax, xlabel: str, ylabel: str, title: str, legend: bool = False) -> None:
    """Labels, a title, a y axis from zero and a light grid: every plot's look."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    if legend:
        ax.legend(fontsize=8)


def save(fig, path: str) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def memory_vs_time(case: CaseResult, path: str) -> bool:
    """Peak memory (y) against median step time (x), one labelled point per
    mode; False (and no file) when no mode has both numbers."""
    points = [(r.step_s * 1e3, r.peak_bytes / MiB, r.mode) for r in case.modes
              if r.step_s is not None and r.peak_bytes is not None]
    if not points:
        return False
    fig, ax = plt.subplots(figsize=(6.4, 4.8))
    for x, y, label in points:
        ax.scatter(x, y)
        ax.annotate(label, (x, y), textcoords="offset points", xytext=(5, 5), fontsize=8)
    style_axes(ax, "step time, median (ms)", "peak memory of one step (MiB)", f"{case.name}: {case.description}")
    save(fig, path)
    return True


def depth_sweep(sweep: list[CaseResult], path: str) -> bool:
    """Peak (and saved) memory and partitioner time against depth, a line per mode."""
    series: dict[str, list] = {}
    for case in sweep:
        for r in case.modes:
            series.setdefault(r.mode, []).append((sweep_depth(case.name), r))
    if not series:
        return False
    fig, (mem, part) = plt.subplots(1, 2, figsize=(11, 4.5))
    for mode, rows in series.items():
        rows = [(d, r) for d, r in rows if r.peak_bytes is not None]
        depths = [d for d, _ in rows]
        line, = mem.plot(depths, [r.peak_bytes / MiB for _, r in rows], marker="o", label=f"{mode} peak")
        mem.plot(depths, [r.saved_bytes / MiB for _, r in rows], marker="x", linestyle="--",
                 color=line.get_color(), label=f"{mode} saved")
        timed = [(d, r.partitioner_s) for d, r in rows if r.partitioner_s is not None]
        if timed:
            part.plot(*zip(*timed), marker="o", label=mode)
    style_axes(mem, "depth (layers)", "MiB", "peak and saved memory vs depth", legend=True)
    style_axes(part, "depth (layers)", "partitioner time (s)", "partitioner time vs depth", legend=True)
    save(fig, path)
    return True


def largest_batch(case: CaseResult, path: str) -> bool:
    """Per mode, the largest batch under the cap (bars) and the throughput
    there (dots, right axis); False (and no file) without a batch search."""
    rows = [r for r in case.modes if r.cap_batch is not None]
    if not rows or case.cap_bytes is None:
        return False
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    positions = range(len(rows))
    ax.bar(positions, [r.cap_batch for r in rows], color="tab:blue", alpha=0.7)
    ax.set_xticks(list(positions), [r.mode for r in rows], rotation=25, ha="right", fontsize=8)
    style_axes(ax, "", "largest batch under the cap (bars)",
               f"{case.name}: cap {case.cap_bytes / MiB:.1f} MiB")
    speed = ax.twinx()
    speed.scatter(list(positions), [r.cap_throughput or 0 for r in rows], color="tab:red", zorder=3)
    speed.set_ylabel(f"{case.unit}/s at that batch (dots)")
    speed.set_ylim(bottom=0)
    save(fig, path)
    return True


def memory_ledger(rows: list[tuple[str, Ledger, int | None]], title: str, path: str) -> bool:
    """Stacked bars of each mode's memory at its step's peak, from the
    ``(mode, ledger, predicted peak bytes or None)`` rows; a black tick marks
    ckpt's predicted peak on the same scale. False (and no file) without rows."""
    if not rows:
        return False
    fig, ax = plt.subplots(figsize=(max(6.4, 1.1 * len(rows) + 2.5), 4.8))
    positions = list(range(len(rows)))
    bottoms = [0.0] * len(rows)
    for label, field, color in LEDGER_PARTS:
        heights = [(getattr(ledger, field) or 0) / MiB for _, ledger, _ in rows]
        if any(heights):
            ax.bar(positions, heights, bottom=bottoms, color=color, label=label, width=0.6)
            bottoms = [b + h for b, h in zip(bottoms, heights)]
    predicted = [(x, (ledger.total_at_peak - ledger.peak_bytes + peak) / MiB)
                 for x, (_, ledger, peak) in zip(positions, rows) if peak is not None]
    if predicted:
        ax.scatter(*zip(*predicted), marker="_", s=900, color="black", zorder=3, label="predicted peak (ckpt)")
    ax.set_xticks(positions, [f"{mode}\n(peak in {ledger.peak_phase})" for mode, ledger, _ in rows],
                  rotation=20, ha="right", fontsize=8)
    style_axes(ax, "", "MiB alive at the step's peak", title)
    handles, labels = ax.get_legend_handles_labels()  # top of the stack first, as drawn
    ax.legend(handles[::-1], labels[::-1], fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), markerscale=0.4)
    save(fig, path)
    return True


def loss_curves(runs: list, path: str) -> bool:
    """Training loss per step (left) and validation loss (right) of each
    training Run, one line per mode. Modes whose losses are the same overlay:
    each is drawn thinner than the one before, so every line stays visible."""
    if not runs:
        return False
    fig, (train, valid) = plt.subplots(1, 2, figsize=(12, 4.5))
    for index, run in enumerate(runs):
        width = max(0.6, 3.0 - 0.6 * index)
        steps = range(run.start, run.start + len(run.losses))
        train.plot(steps, run.losses, linewidth=width, alpha=0.8, label=run.mode)
        valid.plot(*zip(*run.validation), marker="o", markersize=2 + width, linewidth=width, label=run.mode)
    style_axes(train, "step", "training loss (one batch)", "training loss per step", legend=True)
    style_axes(valid, "steps trained", "validation loss (dropout off)", "validation loss", legend=True)
    save(fig, path)
    return True


def write_plots(models: list[CaseResult], sweep: list[CaseResult], out: str) -> list[str]:
    """Every plot into ``out``; the paths written."""
    written = []
    for case in models:
        path = os.path.join(out, f"{case.name}_memory_vs_time.png")
        if memory_vs_time(case, path):
            written.append(path)
        path = os.path.join(out, f"{case.name}_largest_batch.png")
        if largest_batch(case, path):
            written.append(path)
        path = os.path.join(out, f"{case.name}_memory_ledger.png")
        rows = [(r.mode, r.ledger, r.predicted_peak_bytes) for r in case.modes if r.ledger is not None]
        if memory_ledger(rows, f"{case.name}: memory at the peak of one step (no optimizer)", path):
            written.append(path)
    path = os.path.join(out, "depth_sweep.png")
    if sweep and depth_sweep(sweep, path):
        written.append(path)
    return written
