"""`python -m ckpt diff A.json [B.json]` and `python -m ckpt svg REPORT.json`.

Any input that is not a report (unreadable, not UTF-8, not JSON, another
shape) ends with one line on stderr naming the file and exit code 2.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys

from .reports.diff import diff_against_pytorch, diff_reports
from .reports.graph_svg import GraphvizMissing, write_svg
from .reports.report import shape_problem

BAD_INPUT = 2
"""Exit code for input the CLI cannot use (argparse's own code for bad arguments)."""

_WRITTEN_BY = "pass a .json report written under CKPT_REPORT"


class BadReport(Exception):
    """A file the CLI cannot read as a report; the message names the file."""


def load_report(path: str) -> dict:
    """The report at ``path``; anything else is a BadReport saying what is wrong."""
    try:
        text = pathlib.Path(path).read_bytes().decode("utf-8")
    except OSError as error:
        raise BadReport(f"cannot read {path}: {error.strerror or error}") from None
    except UnicodeDecodeError as error:
        raise BadReport(f"{path} is not UTF-8 text ({error.reason} at byte {error.start}); {_WRITTEN_BY}") from None
    try:
        report = json.loads(text)
    except json.JSONDecodeError as error:
        raise BadReport(
            f"{path} is not valid JSON ({error.msg} at line {error.lineno} column {error.colno}; "
            f"truncated?); {_WRITTEN_BY}"
        ) from None
    problem = shape_problem(report)
    if problem:
        raise BadReport(f"{path} is not a ckpt report: {problem}; {_WRITTEN_BY}")
    return report


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    paths = [args.a] + ([args.b] if args.b else []) if args.command == "diff" else [args.report]
    try:
        reports = [load_report(path) for path in paths]
    except BadReport as error:
        return _fail(str(error))
    for path, report in zip(paths, reports):
        if report["fallback"]:
            return _fail(f"{path} has no decisions: ckpt fell back to PyTorch's partitioner "
                         f"for that graph ({report['fallback']})")
    if args.command == "diff":
        a, *rest = reports
        text = diff_against_pytorch(a) if not rest else diff_reports(a, rest[0], args.a, args.b)
        sys.stdout.write(text)
        return 0
    (report,) = reports
    output = args.output or str(pathlib.Path(args.report).with_suffix(".svg"))
    try:
        print(write_svg(report, output))
    except GraphvizMissing as error:
        return _fail(str(error))
    except (OSError, subprocess.CalledProcessError) as error:
        return _fail(f"cannot write {output}: {error}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m ckpt")
    commands = parser.add_subparsers(dest="command", required=True)
    diff = commands.add_parser("diff", help="diff two reports, or one report against PyTorch's partitioner")
    diff.add_argument("a", help="report JSON written under CKPT_REPORT")
    diff.add_argument("b", nargs="?", help="second report; without it, ckpt vs PyTorch in A")
    svg = commands.add_parser("svg", help="draw a report's forward graph as SVG (needs graphviz)")
    svg.add_argument("report")
    svg.add_argument("-o", "--output", help="SVG path (default: next to the report)")
    return parser


def _fail(message: str) -> int:
    # One line, whatever the message holds: scripts and people read the first.
    print("ckpt: " + " ".join(message.splitlines()), file=sys.stderr)
    return BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
