"""A picture of a report's forward graph: nodes colored by decision and sized
by bytes, drawn with graphviz's ``dot`` when it is installed."""
from __future__ import annotations

import math
import pathlib
import shutil
import subprocess

from .report import NOT_KEPT

COLORS = {"saved": "#e4572e", "recomputed": "#76b041", NOT_KEPT: "#d9d9d9"}
# Node widths grow with the square root of bytes (area ~ bytes), clamped to
# stay legible: 0.3 inch for tiny values, 3 inches at most.
MIN_WIDTH, MAX_WIDTH, INCHES_PER_SQRT_BYTE = 0.3, 3.0, 1 / 512


class GraphvizMissing(RuntimeError):
    pass


def to_dot(report: dict) -> str:
    graph = report["forward_graph"]
    lines = [
        "digraph forward {",
        "  rankdir=TB;",
        '  node [shape=box, style=filled, fontname="Helvetica", fontsize=9];',
    ]
    for name, decision, nbytes in graph["nodes"]:
        width = min(MAX_WIDTH, max(MIN_WIDTH, math.sqrt(nbytes) * INCHES_PER_SQRT_BYTE))
        label = f"{name}\\n{decision}, {nbytes} B"
        lines.append(f'  "{name}" [label="{label}", fillcolor="{COLORS[decision]}", width={width:.2f}];')
    lines += [f'  "{a}" -> "{b}";' for a, b in graph["edges"]]
    lines.append("}")
    return "\n".join(lines) + "\n"


def write_svg(report: dict, path: str | pathlib.Path) -> pathlib.Path:
    """Render the forward graph to ``path`` (SVG); needs graphviz's ``dot``."""
    dot = shutil.which("dot")
    if dot is None:
        raise GraphvizMissing(
            "graphviz's `dot` program is not installed, so no SVG can be drawn; "
            "install it (e.g. `apt-get install graphviz`) and run "
            "`python -m ckpt svg REPORT.json` again"
        )
    path = pathlib.Path(path)
    subprocess.run([dot, "-Tsvg", "-o", str(path)], input=to_dot(report), text=True, check=True)
    return path
