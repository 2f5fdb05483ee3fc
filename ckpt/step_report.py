"""The step view as a reader sees it: steps measured against predictions,
the plans each graph runs, written as ``step.md`` beside the graph reports."""
from __future__ import annotations

import hashlib
import pathlib

from partitioners.budget import rung_budget

OWN = "own"
"""The rung label of the budget's own plans."""


def describe(view) -> str:
    """``view`` (a StepView) as markdown: graphs, calls, predicted and measured peaks."""
    lines = [
        "# ckpt step view",
        "",
        f"steps seen: {view.steps}; recompiles for step plans: {view.recompiles}",
        "",
        "| step | sequence | plans for | predicted MiB | measured MiB | measured / predicted | used to plan |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in view.measurements:
        lines.append(
            f"| {m.step} | {m.sequence_id} | {rung_name(m.rung)} | {m.predicted_bytes / 2**20:.2f} | "
            f"{m.measured_bytes / 2**20:.2f} | {m.ratio:.3f} | {'yes' if m.judged else 'no'} |"
        )
    for sequence, state in view.sequences.items():
        if any(g.forward for g in state.gathered):
            largest = max(g.backward for g in state.gathered)
            lines += [
                "",
                f"{sequence_id(sequence)}: parameters a sharding gathers in the step (freed by its end), "
                f"in the predictions: {sum(1 for g in state.gathered if g.forward)} of {len(sequence)} calls, "
                f"up to {largest / 2**20:.2f} MiB around a call's backward",
            ]
        if len(state.tried) > 1 or state.rung != OWN:
            lines += [
                "",
                f"{sequence_id(sequence)}: measured step peaks {tried_text(state.tried)}; "
                f"{'runs' if state.settled else 'trying'} the plans of {rung_name(state.rung)}",
            ]
    lines += ["", "| graph | plan made for | saved bytes | predicted step peak MiB |", "|---|---|---|---|"]
    for key, plan in view.plans.items():
        lines.append(
            f"| {key} | {plan.step or 'the graph alone'} | {plan.saved_activation_bytes} | "
            f"{plan.estimated_peak_bytes / 2**20:.2f} |"
        )
    return "\n".join(lines) + "\n"



def write_step_report(view, folder: str) -> None:
    path = pathlib.Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    (path / "step.md").write_text(describe(view))


def rung_name(rung: str) -> str:
    if rung == OWN:
        return "its own budget"
    return "the runtime-optimal plan" if rung_budget(rung) is None else f"budget {rung}"


def tried_text(tried: dict[str, int]) -> str:
    return ", ".join(f"{rung_name(rung)} {nbytes / 2**20:.2f} MiB" for rung, nbytes in tried.items())


def sequence_id(sequence: tuple[str, ...]) -> str:
    return "s" + hashlib.sha256(" ".join(sequence).encode()).hexdigest()[:8] + f"x{len(sequence)}"
