"""`python -m ckpt diff A.json [B.json]` and `python -m ckpt svg REPORT.json`."""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

from passes.diff import diff_against_pytorch, diff_reports
from passes.graph_svg import GraphvizMissing, write_svg


def _load(path: str) -> dict:
    try:
        return json.loads(pathlib.Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise SystemExit(f"ckpt: cannot read report {path}: {error}") from None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ckpt")
    commands = parser.add_subparsers(dest="command", required=True)
    diff = commands.add_parser("diff", help="diff two reports, or one report against PyTorch's partitioner")
    diff.add_argument("a", help="report JSON written under CKPT_REPORT")
    diff.add_argument("b", nargs="?", help="second report; without it, ckpt vs PyTorch in A")
    svg = commands.add_parser("svg", help="draw a report's forward graph as SVG (needs graphviz)")
    svg.add_argument("report")
    svg.add_argument("-o", "--output", help="SVG path (default: next to the report)")
    args = parser.parse_args(argv)

    paths = [args.a] + ([args.b] if args.b else []) if args.command == "diff" else [args.report]
    reports = [_load(path) for path in paths]
    for path, report in zip(paths, reports):
        if report.get("fallback"):
            print(f"ckpt: {path} has no decisions: ckpt fell back to PyTorch's partitioner "
                  f"for that graph ({report['fallback']})", file=sys.stderr)
            return 2
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
        print(f"ckpt: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
