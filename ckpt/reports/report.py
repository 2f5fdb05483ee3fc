"""Partition reports: what was saved and recomputed, why, and what PyTorch's
partitioner decided on the same joint graph. JSON for tools, markdown for people.

Everything in a report is a pure function of the graph and the config (no
times, no addresses), so two runs of the same compile write identical files.
"""
from __future__ import annotations

import hashlib
import json
import math
import operator
import pathlib

import torch

from partitioners.canonical import canonical_names, op_label, shape_of, structure_digest
from partitioners.budget import priced_runtimes
from partitioners.classify import activation_bytes
from partitioners.cost import profile_for
from partitioners.ops import OpCategory
from partitioners.partition import Outcome
from partitioners.peak import estimate_step_peak
from partitioners.plan import RECOMPUTED, SAVED

MiB = 2**20
LARGEST_TEMPORARIES = 5
NOT_KEPT = "-"


def build_report(outcome: Outcome) -> dict:
    """The report of one graph: what ckpt decided, and what PyTorch's
    partitioner decided (``outcome.pytorch``, needed unless ckpt fell back)."""
    plan = outcome.plan
    if outcome.partition is None:
        report = {"fallback": plan.fallback, "values": [], "totals": {}, "ledger": {}, "forward_graph": {}}
        report["graph"] = "fallback-" + hashlib.sha256((plan.fallback or "").encode()).hexdigest()[:12]
        return report
    facts, pytorch = outcome.partition.facts, outcome.pytorch
    graph = next(iter(facts.nodes)).graph
    names = canonical_names(graph)
    by_name = {node.name: node for node in facts.nodes}
    decisions = {d.name: d for d in plan.decisions}
    pytorch_saved = {by_name[n] for n in pytorch.saved if n in by_name}
    pytorch_recomputed = {
        by_name[n] for n in pytorch.in_backward if n in by_name and by_name[n] in facts.forward
    }
    pytorch_kept = pytorch_saved | pytorch_recomputed
    values = []
    for node, node_facts in facts.nodes.items():
        decision = decisions.get(node.name)
        # Parameters are free to save, unless Inductor copies them (channels-last).
        if node in facts.static_inputs - facts.relaid_inputs or (decision is None and node not in pytorch_kept):
            continue
        value = node.meta.get("val")
        values.append({
            "name": names[node],
            "node": node.name,
            "op": op_label(node),
            "shape": shape_of(node),
            "dtype": str(value.dtype).removeprefix("torch.") if isinstance(value, torch.Tensor) else type(value).__name__,
            "bytes": node_facts.nbytes,
            "ckpt": decision.decision if decision else NOT_KEPT,
            "reason": decision.reason if decision else "",
            "pytorch": SAVED if node in pytorch_saved else RECOMPUTED if node in pytorch_recomputed else NOT_KEPT,
        })
    recomputed = [n for n in facts.nodes if decisions.get(n.name) and decisions[n.name].decision == RECOMPUTED]
    runtimes = priced_runtimes(facts, profile_for(graph, outcome.device_profile))
    ckpt_heavy, ckpt_heavy_us = _heavy_recompute(recomputed, runtimes)
    pytorch_heavy, pytorch_heavy_us = _heavy_recompute(pytorch_recomputed, runtimes)
    report = {
        "fallback": None,
        "values": values,
        "totals": {
            "ckpt_saved_bytes": plan.saved_activation_bytes,
            "pytorch_saved_bytes": activation_bytes(facts, pytorch_saved),
            "ckpt_recomputed_ops": len(recomputed),
            "pytorch_recomputed_ops": len(pytorch_recomputed),
            "ckpt_recompute_bytes_written": sum(
                facts.nodes[n].nbytes for n in recomputed if _allocates(facts.nodes[n].category)
            ),
            "budget": plan.budget,
            "budget_bytes": plan.budget_bytes if plan.budget else None,
            "optimal_saved_bytes": plan.optimal_bytes,
            "fits_budget": plan.fits_budget,
            "budget_note": plan.budget_note,
            "estimated_budget_recompute_us": round(plan.recompute_time_s * 1e6, 1),
            "estimated_peak_bytes": plan.estimated_peak_bytes,
            # PyTorch's saved set priced by ckpt's models: why ckpt chose otherwise.
            "pytorch_estimated_peak_bytes": estimate_step_peak(facts, pytorch_saved).step_bytes,
            "ckpt_heavy_recomputed_ops": ckpt_heavy,
            "ckpt_heavy_recompute_us": ckpt_heavy_us,
            "pytorch_heavy_recomputed_ops": pytorch_heavy,
            "pytorch_heavy_recompute_us": pytorch_heavy_us,
        },
        "ledger": {
            "parameters_bytes": sum(facts.nodes[n].nbytes for n in facts.static_inputs),
            "gradients_bytes": sum(facts.nodes[n].nbytes for n in facts.backward_outputs),
            "saved_activation_bytes": plan.saved_activation_bytes,
            "largest_temporaries": _largest_temporaries(facts, names),
        },
        "forward_graph": _forward_graph(facts, names, decisions),
    }
    if plan.regions:
        report["regions"] = [_region_row(row, by_name, names) for row in plan.regions]
    # The id depends on the graph alone, not on decisions: reports of one
    # graph under two settings share it and can be diffed.
    report["graph"] = structure_digest(facts.nodes, names)
    return report


def render_markdown(report: dict) -> str:
    """The report as markdown; the text golden-file tests compare."""
    lines = [f"# ckpt report: graph {report['graph']}", ""]
    if report["fallback"]:
        lines += [f"ckpt fell back to PyTorch's partitioner for this graph: {report['fallback']}", ""]
        return "\n".join(lines)
    totals, ledger = report["totals"], report["ledger"]
    lines += [
        "| totals | ckpt | PyTorch |",
        "|---|---|---|",
        f"| saved for backward | {_size(totals['ckpt_saved_bytes'])} | {_size(totals['pytorch_saved_bytes'])} |",
        f"| ops recomputed in backward | {totals['ckpt_recomputed_ops']} | {totals['pytorch_recomputed_ops']} |",
        f"| heavy ops recomputed (cost model) | {totals['ckpt_heavy_recomputed_ops']}, "
        f"{totals['ckpt_heavy_recompute_us']} us | {totals['pytorch_heavy_recomputed_ops']}, "
        f"{totals['pytorch_heavy_recompute_us']} us |",
        f"| predicted step peak (ckpt's peak model) | {_size(totals['estimated_peak_bytes'])} | "
        f"{_size(totals['pytorch_estimated_peak_bytes'])} |",
        "",
        f"- recompute writes {_size(totals['ckpt_recompute_bytes_written'])} (outputs of recomputed non-view ops, before fusion)",
        f"- memory budget: {_budget_line(totals)}",
        "- predicted step peak: above parameters and inputs (partitioners/peak.py); the PyTorch "
        "column is ckpt's models applied to PyTorch's saved set",
        "",
        "## Values backward needs",
        "",
        "| value | op | shape | dtype | bytes | ckpt | reason | PyTorch |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for v in report["values"]:
        shape = "x".join(map(str, v["shape"])) or "scalar"
        lines.append(
            f"| {v['name']} | {v['op']} | {shape} | {v['dtype']} | {v['bytes']} | "
            f"{v['ckpt']} | {v['reason']} | {v['pytorch']} |"
        )
    lines += _regions_section(report.get("regions", []))
    lines += [
        "",
        "## Memory ledger (what this graph knows)",
        "",
        f"- parameters and buffers: {_size(ledger['parameters_bytes'])}",
        f"- gradients it returns: {_size(ledger['gradients_bytes'])}",
        f"- activations saved for backward: {_size(ledger['saved_activation_bytes'])}",
        *_optimizer_state_line(ledger),
        "- largest temporaries:",
    ]
    lines += [f"  - {t['name']} ({t['op']}, {t['where']}): {_size(t['bytes'])}" for t in ledger["largest_temporaries"]]
    return "\n".join(lines) + "\n"


def _region_row(row, by_name: dict, names: dict) -> dict:
    """One region of a per-region budget, with canonical value names."""
    return {
        "region": row.key, "budget": row.budget, "forward_ops": row.nodes,
        "optimal_saved_bytes": row.optimal_bytes, "allowed_bytes": row.target_bytes,
        "saved_bytes": row.saved_bytes, "saved": [names[by_name[n]] for n in row.saved],
        "heavy_recomputed": [names[by_name[n]] for n in row.recomputed_heavy], "note": row.note,
    }


def _regions_section(regions: list[dict]) -> list[str]:
    """Per-region budgets: each region's budget, bytes and decisions."""
    if not regions:
        return []
    lines = [
        "", "## Regions (per-region budgets)", "",
        "| region | budget | forward ops | runtime-optimal saves | allowed | saves | heavy ops recomputed |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['region']} | {r['budget']} | {r['forward_ops']} | {_size(r['optimal_saved_bytes'])} | "
        f"{_size(r['allowed_bytes'])} | {_size(r['saved_bytes'])} | {len(r['heavy_recomputed'])} |"
        for r in regions
    ]
    lines.append("")
    for r in regions:
        lines += [f"- {r['region']}: saves {', '.join(r['saved']) or 'nothing'}; recomputes "
                      f"{', '.join(r['heavy_recomputed']) or 'no heavy op'}" + (f"; {r['note']}" if r["note"] else "")]
    return lines


# The optimizer's state: the backend compiles before any optimizer step and
# cannot see it; a training loop that runs one (bench/training.py) adds it.

def add_optimizer_state(report: dict, nbytes: int, optimizer: str) -> dict:
    """A copy of ``report`` whose ledger also lists ``nbytes``, the state of
    ``optimizer`` (a name, e.g. ``AdamW``) for all the parameters it trains.
    A fallback report is returned as is."""
    if report["fallback"]:
        return report
    ledger = {**report["ledger"], "optimizer_state_bytes": nbytes, "optimizer": optimizer}
    return {**report, "ledger": ledger}


def _optimizer_state_line(ledger: dict) -> list[str]:
    if "optimizer_state_bytes" not in ledger:  # the backend alone does not know it
        return []
    return [f"- optimizer state ({ledger['optimizer']}, all its parameters, measured by the training loop): "
            f"{_size(ledger['optimizer_state_bytes'])}"]


def write_report(report: dict, folder: str | pathlib.Path) -> pathlib.Path:
    """Write ``<graph>.json`` and ``<graph>.md`` into ``folder``; returns the JSON path."""
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{report['graph']}.json"
    path.write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")
    path.with_suffix(".md").write_text(render_markdown(report))
    return path


def _budget_line(totals: dict) -> str:
    if not totals["budget"]:
        return f"none set (runtime-optimal plan, {_size(totals['optimal_saved_bytes'])})"
    verdict = "fits" if totals["fits_budget"] else "does not fit: smallest plan used"
    asked = "" if totals["budget"].endswith("bytes") else f" ({totals['budget']})"
    note = totals.get("budget_note")  # reports written before the field have none
    return (
        f"{_size(totals['budget_bytes'])}{asked}, {verdict}; runtime-optimal saves "
        f"{_size(totals['optimal_saved_bytes'])}; heavy ops recomputed for it: "
        f"{totals['estimated_budget_recompute_us']} us (cost model)"
        + (f"; {note}" if note else "")
    )


def _heavy_recompute(recomputed, runtimes: dict) -> tuple[int, float]:
    """How many of the budget search's priced ops backward re-runs, and their
    time in microseconds as the search prices it. A tuple op counts once; its
    getitems count in the time, as in the search, so ckpt's figure under a
    budget equals the budget line's."""
    priced = [n for n in recomputed if n in runtimes]
    ops = sum(1 for n in priced if n.target is not operator.getitem)
    return ops, round(math.fsum(runtimes[n] for n in priced) * 1e6, 1)


def _size(nbytes: int) -> str:
    return f"{nbytes / MiB:.2f} MiB ({nbytes} bytes)"


def _allocates(category: OpCategory) -> bool:
    return category not in (OpCategory.VIEW, OpCategory.GETITEM)


def _largest_temporaries(facts, names) -> list[dict]:
    candidates = [
        (node, f) for node, f in facts.nodes.items()
        if node.op == "call_function" and _allocates(f.category) and f.nbytes
    ]
    candidates.sort(key=lambda item: -item[1].nbytes)  # stable: ties stay in graph order
    return [
        {
            "name": names[node],
            "op": op_label(node),
            "bytes": f.nbytes,
            "where": "forward" if node in facts.forward else "backward",
        }
        for node, f in candidates[:LARGEST_TEMPORARIES]
    ]


def _forward_graph(facts, names, decisions) -> dict:
    """Forward nodes and edges with their decisions, for drawing."""
    nodes = [
        [names[n], decisions[n.name].decision if n.name in decisions else NOT_KEPT, facts.nodes[n].nbytes]
        for n in facts.nodes
        if n in facts.forward
    ]
    edges = [
        [names[arg], names[n]]
        for n in facts.nodes
        if n in facts.forward
        for arg in n.all_input_nodes
        if arg in facts.forward
    ]
    return {"nodes": nodes, "edges": edges}



_JSON_NAMES = {dict: "object", list: "array", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}
_REPORT_KEYS = ("fallback", "values", "totals", "forward_graph")
_ROW_FIELDS = {"name": str, "op": str, "bytes": int, "ckpt": str, "pytorch": str}
_TOTALS_READ = ("ckpt_saved_bytes", "pytorch_saved_bytes")  # what reports/diff.py reads
_DECISIONS = (SAVED, RECOMPUTED, NOT_KEPT)


def shape_problem(report) -> str | None:
    """What keeps parsed JSON from being a report ``build_report`` wrote, in
    the parts the diff and the SVG read; None if nothing. A fallback report
    has no decisions and is not checked further."""
    if not isinstance(report, dict):
        return f"it holds a JSON {_JSON_NAMES.get(type(report), 'value')}, not a report object"
    if report.get("fallback"):
        return None
    missing = [key for key in _REPORT_KEYS if key not in report]
    if missing:
        return f"it has no {', '.join(map(repr, missing))} key(s)"
    if not isinstance(report["values"], list) or not all(map(_is_row, report["values"])):
        return f"'values' is not a list of objects with {', '.join(_ROW_FIELDS)}, decisions one of {_DECISIONS}"
    totals = report["totals"]
    if not isinstance(totals, dict) or not all(isinstance(totals.get(k), int) for k in _TOTALS_READ):
        return f"'totals' lacks the integers {' and '.join(_TOTALS_READ)}"
    if not _is_forward_graph(report["forward_graph"]):
        return "'forward_graph' is not {'nodes': [[name, decision, bytes], ...], 'edges': [[name, name], ...]}"
    return None


def _is_row(row) -> bool:
    return (
        isinstance(row, dict)
        and all(isinstance(row.get(key), kind) for key, kind in _ROW_FIELDS.items())
        and row["ckpt"] in _DECISIONS
        and row["pytorch"] in _DECISIONS
    )


def _is_forward_graph(graph) -> bool:
    if not isinstance(graph, dict):
        return False
    nodes, edges = graph.get("nodes"), graph.get("edges")
    return (
        isinstance(nodes, list)
        and isinstance(edges, list)
        and all(_is_list_of(n, str, str, int) and n[1] in _DECISIONS for n in nodes)
        and all(_is_list_of(e, str, str) for e in edges)
    )


def _is_list_of(item, *kinds) -> bool:
    return isinstance(item, list) and len(item) == len(kinds) and all(map(isinstance, item, kinds))
