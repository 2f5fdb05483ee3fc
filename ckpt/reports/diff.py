"""Readable diffs between partition reports: changed decisions first, then
values only one side keeps, then byte totals."""
from __future__ import annotations

from partitioners.plan import SAVED

from .report import NOT_KEPT, _size


def diff_reports(a: dict, b: dict, a_label: str = "A", b_label: str = "B") -> str:
    """Compare ckpt's decisions in two reports (two budgets, two commits, ...)."""
    return _diff(
        _by_name(a, "ckpt"),
        _by_name(b, "ckpt"),
        a_label,
        b_label,
        (a["totals"]["ckpt_saved_bytes"], b["totals"]["ckpt_saved_bytes"]),
    )


def diff_against_pytorch(report: dict) -> str:
    """Compare ckpt with PyTorch's partitioner within one report."""
    return _diff(
        _by_name(report, "ckpt"),
        _by_name(report, "pytorch"),
        "ckpt",
        "PyTorch",
        (report["totals"]["ckpt_saved_bytes"], report["totals"]["pytorch_saved_bytes"]),
    )


def _by_name(report: dict, partitioner: str) -> dict:
    """value name -> (decision of ``partitioner``, bytes, op)."""
    return {v["name"]: (v[partitioner], v["bytes"], v["op"]) for v in report["values"]}


def _diff(a: dict, b: dict, a_label: str, b_label: str, saved_totals: tuple[int, int]) -> str:
    names = list(a) + [n for n in b if n not in a]
    saved_changes, other_changes = [], []
    for name in names:
        left = a.get(name, (NOT_KEPT, 0, ""))
        right = b.get(name, (NOT_KEPT, 0, ""))
        if left[0] != right[0]:
            op = left[2] or right[2]
            line = f"  {name} ({op}, {max(left[1], right[1])} bytes): {left[0]} -> {right[0]}"
            # What is saved decides memory: those changes come first.
            (saved_changes if SAVED in (left[0], right[0]) else other_changes).append(line)
    changed = saved_changes + other_changes
    saved_a, saved_b = saved_totals
    lines = [f"--- {a_label}", f"+++ {b_label}", f"{len(changed)} decision(s) differ"]
    lines += changed
    lines += [
        "",
        f"saved for backward: {_size(saved_a)} -> {_size(saved_b)} ({saved_b - saved_a:+d} bytes)",
    ]
    return "\n".join(lines) + "\n"
