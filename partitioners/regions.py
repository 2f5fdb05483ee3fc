"""Per-region budgets: each part of a graph planned with its own budget.

A region is the set of forward nodes one budget covers: the nodes whose
module path (Dynamo's ``nn_module_stack``, after ``Config.module_prefix``)
starts with a prefix of ``memory_budget={"vision_tower": 0.0, ...}`` (the
longest prefix wins), or the nodes under one
``torch.autograd.graph.region_activation_memory_budget(b)``. What no region
claims is the rest, planned with the budget's rest (runtime-optimal if none).

Regions are searched one at a time in graph order with budget.py's search,
scoped to the region: its saved bytes, segment boundaries and heavy ops are
its own, the other regions held as last decided (at first, as the graph's
lowest-peak plan has them), in passes until no region's cut changes. A
``peak:`` cap is the limit over the preferences: if the plan's predicted
step peak breaks it, every region's
fraction (the runtime-optimal ones as 1.0) is scaled by TIGHTENING in turn
until one fits, and if none does, the cap's own plan is used (a warning says
the preferences were dropped).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re
import time
import warnings
from collections.abc import Mapping

import torch
import torch.fx as fx

import ckpt_compat as compat
from .budget import (
    BudgetSolution, Scope, _Cut, _cut_of, _min_cut, _planned_peak, _Search, optimal_rung,
    _solve_for_peak, _target_bytes, _within_fraction_or_bytes,
)
from .canonical import DYNAMO_ROOT, module_path
from .classify import GraphFacts, activation_bytes, recomputed_nodes
from .config import Config, MemoryBudget, module_path_key
from .cost import DeviceProfile
from .mincut import build_flow_graph
from .step import StepContext

REST = ""
"""The region of nodes no prefix or PyTorch region claims."""
# Under a peak: cap the preferences are scaled by these factors in turn, so
# the regions keep their order of tightness while the plan comes down.
TIGHTENING = (0.5, 0.25, 0.0)
# Regions are planned again with the others as last decided until no cut
# changes: two passes settle the bench's models, a third catches a late move.
PASSES = 3


@dataclasses.dataclass(frozen=True)
class Region:
    """A part of the graph and the budget it asked for (None: runtime-optimal)."""

    key: str
    """The module path prefix, REST, or ``region_activation_memory_budget(b)``."""
    budget: MemoryBudget | None


@dataclasses.dataclass(frozen=True)
class RegionOutcome:
    """What one region asked and got: a row of the report's regions table."""

    key: str
    budget: str
    nodes: int
    """Forward ops in the region."""
    optimal_bytes: int
    """What the region saves in the runtime-optimal plan."""
    target_bytes: int
    saved_bytes: int
    saved: tuple[str, ...]
    """Names of the region's values saved for backward, in graph order."""
    recomputed_heavy: tuple[str, ...]
    """Matmuls, attention and shrinking reductions recomputed because of the budget."""
    note: str | None = None


def region_key_of(node: fx.Node, budget: MemoryBudget, prefix: str = "") -> Region:
    """The region ``node`` belongs to under ``budget``."""
    if budget.pytorch_regions:
        annotated = compat.region_budget_of(node)
        if annotated is not None:
            return Region(
                f"region_activation_memory_budget({annotated:g})",
                MemoryBudget(fraction=annotated, pytorch_meaning=True),
            )
    path = module_path_key(".".join(p for p in (prefix, _path(node)) if p))
    matches = [key for key, _ in budget.regions if path == key or path.startswith(key + ".")]
    if not matches:
        return Region(REST, budget.rest)
    key = max(matches, key=len)
    return Region(key, MemoryBudget(fraction=dict(budget.regions)[key]))


def _path(node: fx.Node) -> str:
    path = module_path(node)
    return "" if path == "-" else path


# Dynamo's source of a parameter: L['self']._modules['up']._parameters['weight'].
_SOURCE_ATTRIBUTES = re.compile(r"\.?_(modules|parameters|buffers)(?=\[)")  # the root took its dot


@dataclasses.dataclass(frozen=True)
class FramePlace:
    """Where a Dynamo graph's frame sits in the model, and how a call tells
    it: graph input ``index`` is the model's parameter ``prefix.local``."""

    prefix: str
    index: int
    local: str

    def of_call(self, value, names: dict[int, str]) -> str | None:
        """The prefix of the module whose parameter ``value`` is (None: unknown)."""
        full = names.get(value.data_ptr()) if isinstance(value, torch.Tensor) else None
        if full is None or not (full == self.local or full.endswith("." + self.local)):
            return None
        return full[: -len(self.local)].rstrip(".")


def parameter_names(model: torch.nn.Module) -> dict[int, str]:
    """``data_ptr() -> name`` of the model's parameters and buffers (by
    address: at run time a graph is handed plain tensors, not the Parameters)."""
    named = [*model.named_buffers(remove_duplicate=False), *model.named_parameters(remove_duplicate=False)]
    return {value.data_ptr(): name for name, value in named if value.numel()}


def frame_place(gm: fx.GraphModule, example_inputs, names: dict[int, str]) -> FramePlace | None:
    """Where the module of Dynamo graph ``gm``'s frame sits in the model of
    ``names`` (parameter_names), found through a parameter it reads:
    prefix ``"text.1"`` for a frame that starts at ``model.text[1]`` (after
    a graph break inside it, or compiled per block). None: no parameter of
    the model among the graph's inputs."""
    for index, (node, value) in enumerate(zip(gm.graph.find_nodes(op="placeholder"), example_inputs)):
        source = compat.placeholder_source(node)
        if source is None or not isinstance(value, torch.Tensor) or value.data_ptr() not in names:
            continue
        local = module_path_key(_SOURCE_ATTRIBUTES.sub("", DYNAMO_ROOT.sub("", source)))
        place = FramePlace("", index, local)
        prefix = place.of_call(value, names)
        if prefix is not None:
            return dataclasses.replace(place, prefix=prefix)
    return None


def region_keys(gm: fx.GraphModule, budget: MemoryBudget, prefix: str) -> tuple[str, ...]:
    """The regions ``gm``'s ops fall in at ``prefix``: two places with the
    same keys get the same plan."""
    return tuple(sorted({
        region_key_of(node, budget, prefix).key for node in gm.graph.nodes if node.op == "call_function"
    }))


def label_regions(facts: GraphFacts, budget: MemoryBudget, prefix: str = "") -> dict[Region, frozenset[fx.Node]]:
    """The forward nodes of each region, regions in graph order of their first node."""
    members: dict[Region, list[fx.Node]] = {}
    for node in facts.nodes:
        if node in facts.forward and node.op == "call_function":
            members.setdefault(region_key_of(node, budget, prefix), []).append(node)
    return {region: frozenset(nodes) for region, nodes in members.items()}


def solve_regions(
    facts: GraphFacts, budget: MemoryBudget, regions: dict[Region, frozenset[fx.Node]],
    profile: DeviceProfile, context: StepContext | None = None, optimal_settings: Mapping | None = None,
) -> BudgetSolution:
    """The plan where each region keeps its own budget, under the cap if any;
    ``optimal_settings``: the Inductor settings of the runtime-optimal rung."""
    start = time.perf_counter()
    flow = build_flow_graph(facts)
    whole = _Search(flow, profile, context)
    optimal = whole.optimal()
    lowest = whole.lowest_peak(optimal)
    plan, outcomes, cuts = _preferred(whole, regions, 1.0, lowest)
    cuts += whole.cuts
    fits, note = True, None
    cap = budget.cap
    if cap is not None and plan.estimated_peak_bytes > _planned_peak(cap, context):
        for scale in TIGHTENING:
            plan, outcomes, more = _preferred(whole, regions, scale, lowest)
            cuts += more
            if plan.estimated_peak_bytes <= _planned_peak(cap, context):
                note = f"the regions' fractions were scaled by {scale:g} to fit the cap {cap}"
                break
        else:
            search = _Search(flow, profile, context)
            plan = _solve_for_peak(search, cap, optimal, context)
            cuts += search.cuts
            optimal_of = {r: activation_bytes(facts, [n for n in optimal.saved if n in nodes]) for r, nodes in regions.items()}
            outcomes = _outcomes(facts, regions, plan, {}, optimal_of, optimal_of)
            fits = plan.estimated_peak_bytes <= _planned_peak(cap, context)
            note = f"no plan keeping the regions' preferences fits the cap {cap}: planned for the cap alone"
            warnings.warn(f"ckpt: {note}", stacklevel=3)
    over = [o for o in outcomes if o.saved_bytes > o.target_bytes]
    for row in over:
        warnings.warn(
            f"ckpt: region {row.key} ({row.budget}) saves {row.saved_bytes} bytes, above the {row.target_bytes} "
            "it allows: the smallest plan the regions around it leave it; loosen its budget or the "
            "budgets of the regions next to it",
            stacklevel=3,
        )
    # A fallback to the runtime-optimal plan would break a hard limit:
    # PyTorch's region budgets and byte budgets get none.
    hard = any(r.budget is not None and (r.budget.pytorch_meaning or r.budget.nbytes is not None) for r in regions)
    return BudgetSolution.of(
        plan, target_bytes=cap.peak_bytes if cap is not None else plan.saved_bytes,
        optimal_bytes=optimal.saved_bytes, fits=fits and not over,
        note=note, cuts=cuts + 1, solve_time_s=time.perf_counter() - start,
        rungs=(optimal_rung(facts, optimal, context, optimal_settings),)
        if plan.saved != optimal.saved and not hard else (),
        regions=outcomes,
    )


def _preferred(whole: _Search, regions, scale: float, start: _Cut):
    """Each region's cut for its budget with fractions times ``scale``
    (runtime-optimal regions as 1.0): the whole plan, the outcomes, and the
    cuts made.

    Every region starts held at its part of ``start`` (the graph's
    lowest-peak cut), then each is planned in graph order with the others
    held as last decided, in passes until no region's cut changes (at most
    PASSES). Starting from the runtime-optimal plan instead, a tight region
    planned first can only lower the peak by recomputing all of itself,
    after which no other region's recomputation lowers it: the regions at
    0.0 then peak above one uniform 0.0, and a looser region's fraction
    changes nothing. A region's floor is its lowest-peak cut or the one it
    had, whichever predicts the lower peak."""
    flow, context = whole.flow, whole.context
    held = {region: _part_of(start, nodes) for region, nodes in regions.items()}
    cuts = 0
    for _ in range(PASSES):
        before = dict(held)
        asked, notes, optimal_of = {}, {}, {}
        for region, nodes in regions.items():
            price, boundaries = _joined(part for other, part in held.items() if other != region)
            search = _Search(flow, whole.profile, context, Scope(nodes, price, boundaries))
            own = search.optimal()
            optimal_of[region] = own.saved_bytes
            budget = _scaled(region.budget, scale)
            target = _target_bytes(budget, own.saved_bytes, context)
            had = functools.partial(search.cut_priced, held[region][1], held[region][0])
            cut, asked[region], notes[region] = _within_fraction_or_bytes(search, budget, target, own, had)
            held[region] = (dict(cut.price), cut.boundaries)
            cuts += search.cuts + 1
        if held == before:
            break
    price, boundaries = _joined(held.values())
    saved = _min_cut(flow, price, boundaries)
    recomputed = frozenset(recomputed_nodes(flow.facts, set(saved)) & price.keys())
    plan = _cut_of(
        flow.facts, saved, context, boundaries=boundaries, priced_recomputed=recomputed, price=price,
        recompute_time_s=math.fsum(whole.runtime[node] for node in recomputed),
    )
    outcomes = _outcomes(flow.facts, regions, plan, notes, optimal_of, asked, scale)
    return plan, outcomes, cuts


def _part_of(cut: _Cut, nodes: frozenset[fx.Node]) -> tuple[dict, frozenset]:
    """The prices and boundaries of ``cut`` within a region's ``nodes``."""
    return {node: p for node, p in cut.price.items() if node in nodes}, cut.boundaries & nodes


def _joined(parts) -> tuple[dict, frozenset]:
    """The prices and boundaries of several regions' parts, as one."""
    price, boundaries = {}, frozenset()
    for own_price, own_boundaries in parts:
        price.update(own_price)
        boundaries |= own_boundaries
    return price, boundaries


def _scaled(budget: MemoryBudget | None, scale: float) -> MemoryBudget | None:
    if scale == 1.0:
        return budget
    if budget is None:
        return MemoryBudget(fraction=scale)
    if budget.fraction is None:  # bytes: a hard limit already
        return budget
    return dataclasses.replace(budget, fraction=budget.fraction * scale)


def _outcomes(facts, regions, plan, notes, optimal_of, asked, scale: float = 1.0) -> tuple[RegionOutcome, ...]:
    return tuple(
        _outcome(facts, region, nodes, plan, notes, optimal_of, asked, scale) for region, nodes in regions.items()
    )


def _outcome(facts, region, nodes, plan, notes, optimal_of, asked, scale: float) -> RegionOutcome:
    saved = [n for n in facts.nodes if n in nodes and n in plan.saved]  # in graph order
    return RegionOutcome(
        key=region.key or "(rest)",
        budget=str(_scaled(region.budget, scale) or "runtime-optimal"),
        nodes=len(nodes),
        optimal_bytes=optimal_of[region],
        target_bytes=asked[region],
        saved_bytes=activation_bytes(facts, saved),
        saved=tuple(n.name for n in saved),
        recomputed_heavy=tuple(n.name for n in facts.nodes if n in plan.priced_recomputed and n in nodes),
        note=notes.get(region),
    )
