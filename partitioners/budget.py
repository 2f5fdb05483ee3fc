"""The memory-budget solver: the least estimated recompute time whose saved
bytes fit the budget, with recomputation kept segment by segment.

Two knobs shape a plan, each searched with the minimum cut of mincut.py:

- Segment boundaries. A *spine value* is a forward activation that alone
  carries everything later layers need (after it, no other activation is
  still waiting for a forward user): the residual stream between blocks.
  Saving some of them splits the forward into segments, and backward then
  recomputes one segment at a time instead of re-running the whole forward
  at its start with every result alive at once. Where the ops between spine
  values repeat (a stack of identical blocks), boundaries sit at the same
  place in every block, or every second, third... block; elsewhere they
  split the forward into equal bytes. The family the budget moves along is
  the one with the lowest predicted step peak (peak/).
- A price on recomputing heavy ops (matmuls, attention, shrinking
  reductions): ``rate x estimated runtime`` in bytes. The cut then minimizes
  ``saved bytes + rate x recompute time``; a lower rate recomputes more and
  saves less (a Lagrangian relaxation of "least time within the bytes"), so
  a binary search on the rate finds the fastest plan that fits.

When even the smallest plan of that family is over the budget, fewer
boundaries are tried; when nothing fits, the smallest plan is used with a
warning.
"""
from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
import math
import time
import warnings
from collections.abc import Mapping

import torch
import torch.fx as fx

import ckpt_compat as compat

from .classify import GraphFacts, activation_bytes, read_by_backward, recomputed_nodes
from .config import ConfigError, MemoryBudget
from .cost import DeviceProfile, estimate_runtime_s
from .peak import PeakEstimate, estimate_step_peak
from .step import MAX_UNKNOWN_STEP_CALLS, GraphCost, StepContext, repeated_step
from .mincut import FlowGraph, build_flow_graph, byte_scale, solve
from .ops import OpCategory

# Heavy ops a budget may recompute. UNKNOWN ops stay saved: nothing says
# replaying them is safe.
PRICED_CATEGORIES = frozenset({OpCategory.COMPUTE, OpCategory.SHRINKING_REDUCTION})

# Rates sit this far above a breakpoint (any factor > 1 below the next
# breakpoint would do; 1/1024 is far below the gaps between op ratios).
TIE_TO_SAVING = 1 + 2**-10

# Without repeated blocks, boundary counts tried: the spine count halved
# until one (a handful of cuts).
HALVING = 2
# Families are tried from most boundaries to fewest until this many in a row
# have not lowered the estimated peak (it is roughly convex in the boundary
# count: saved boundaries against segment working sets). The same holds
# along the recompute rates.
STALE_TO_STOP = 2
# Under a peak budget, the rate search runs on this many of the fitting
# families, those of lowest peak (three keep the solve within PyTorch's time).
FAMILIES_TRIED = 3


@dataclasses.dataclass(frozen=True)
class _Cut:
    """One min cut the search made: what it saves and what that costs."""

    saved: tuple[fx.Node, ...]
    saved_bytes: int
    estimated_peak_bytes: int
    peak: PeakEstimate
    boundaries: frozenset[fx.Node] = frozenset()
    """Spine values saved as segment boundaries."""
    rate: float = 0.0
    """The recompute price (bytes per second of heavy ops) of the cut."""
    priced_recomputed: frozenset[fx.Node] = frozenset()
    """Heavy ops recomputed because of the budget."""
    recompute_time_s: float = 0.0
    """Estimated runtime of the heavy ops recomputed because of the budget."""
    price: Mapping[fx.Node, int] = dataclasses.field(default_factory=dict, compare=False)
    """The recompute price of each heavy op the cut was made with (absent:
    never recomputed), so that a region's choice can be held fixed."""


@dataclasses.dataclass(frozen=True)
class BudgetSolution(_Cut):
    """The cut the solver chose, what it was chosen for, and what choosing cost."""

    target_bytes: int = 0
    """Saved bytes (fraction, bytes) or predicted step peak (peak) allowed."""
    optimal_bytes: int = 0
    """Saved bytes of the runtime-optimal plan (what fraction budgets scale)."""
    fits: bool = True
    note: str | None = None
    """Why the plan saves what it does when that is not plain from the budget
    (a fraction stopped at the plan of lowest predicted peak)."""
    cuts: int = 1
    solve_time_s: float = 0.0
    rungs: tuple["Rung", ...] = ()
    """Looser plans a measured step may fall back to (LADDER), tight to loose."""
    regions: tuple = ()
    """Per-region budgets: what each region asked and got (regions.RegionOutcome)."""

    @classmethod
    def of(cls, cut: _Cut, **outcome) -> "BudgetSolution":
        return cls(**{field.name: getattr(cut, field.name) for field in dataclasses.fields(_Cut)}, **outcome)


@dataclasses.dataclass(frozen=True)
class Rung:
    """The plan of a looser budget on the same graph: what the step view
    (ckpt/step_view.py) may fall back to when the budget's own plan
    measures above what that plan is predicted to peak."""

    label: str
    """The looser budget: a fraction, or ``RUNTIME_OPTIMAL``."""
    peak: PeakEstimate
    saved: tuple[str, ...]
    """Names of the values it saves (two rungs with equal ones are one plan)."""


# The fallbacks of a fraction or peak budget, tight to loose: the fractions
# above it, then the runtime-optimal plan (no budget). Quarter steps: a
# user comparing fractions compares these, and each rung the step view
# tries costs a recompile and a measured step.
LADDER_FRACTIONS = (0.25, 0.5, 0.75)
RUNTIME_OPTIMAL = "1.0"


def ladder(budget: MemoryBudget | None) -> tuple[str, ...]:
    """The rungs a measured step under ``budget`` may fall back to. Byte
    budgets and PyTorch's fractions are hard limits: none."""
    if budget is None or budget.nbytes is not None or budget.pytorch_meaning:
        return ()
    if budget.is_peak:
        return (RUNTIME_OPTIMAL,)
    looser = tuple(str(f) for f in LADDER_FRACTIONS if f > budget.fraction)
    return looser + (RUNTIME_OPTIMAL,) if budget.fraction < 1 else ()


def rung_budget(label: str) -> MemoryBudget | None:
    """The budget a rung plans with (None: runtime-optimal)."""
    return None if label == RUNTIME_OPTIMAL else MemoryBudget(fraction=float(label))


def solve_with_budget(
    facts: GraphFacts, budget: MemoryBudget | None, profile: DeviceProfile, context: StepContext | None = None,
    optimal_settings: Mapping | None = None,
) -> BudgetSolution:
    """The saved set for ``budget`` (None: the runtime-optimal one), a
    resolved one (``resolved_budget``: no ``peak:auto`` left).

    A byte budget is a hard limit. A fraction never goes below the plan of
    lowest estimated peak: saving less than that plan would only raise the
    peak (the non-monotone budget PyTorch users report). A peak budget takes
    the fastest plan whose predicted step peak is at most its bytes.

    With a step ``context`` (partitioners/step.py), every predicted peak is
    the step's with this graph's plan in it, and a byte budget is the step's
    total, of which this graph gets its share. A regional budget is
    regions.py's (its rungs too).
    """
    start = time.perf_counter()
    flow = build_flow_graph(facts)  # once: the search's cuts differ in terminal edges only
    search = _Search(flow, profile, context)
    optimal = search.optimal()
    if budget is not None and budget.is_peak:
        cut, target, note = _solve_for_peak(search, budget, optimal, context), budget.peak_bytes, None
        fits = cut.estimated_peak_bytes <= _planned_peak(budget, context)
        rungs = (optimal_rung(facts, optimal, context, optimal_settings),)
    else:
        asked = _target_bytes(budget, optimal.saved_bytes, context)
        cut, target, note = _within_fraction_or_bytes(search, budget, asked, optimal)
        fits = cut.saved_bytes <= target
        rungs = tuple(
            optimal_rung(facts, optimal, context, optimal_settings) if label == RUNTIME_OPTIMAL
            else _rung(label, _within_fraction_or_bytes(
                search, rung_budget(label), _target_bytes(rung_budget(label), optimal.saved_bytes), optimal)[0])
            for label in ladder(budget)
        ) if asked < optimal.saved_bytes else ()
        if not fits:
            warnings.warn(
                f"ckpt: memory budget {budget} ({target} bytes) is below the smallest plan "
                f"this graph allows ({cut.saved_bytes} bytes); using that plan",
                stacklevel=2,
            )
    return BudgetSolution.of(
        cut, target_bytes=target, optimal_bytes=optimal.saved_bytes, fits=fits, note=note,
        cuts=search.cuts + 1, solve_time_s=time.perf_counter() - start, rungs=rungs,
    )


def solve_before_the_step(
    facts: GraphFacts, budget: MemoryBudget, profile: DeviceProfile, optimal_settings: Mapping | None = None,
) -> BudgetSolution:
    """A peak cap's plan before the step is known: the fastest plan that fits
    the cap in a step of the most calls of this graph that one fits, up to
    MAX_UNKNOWN_STEP_CALLS (the graph alone, at least). A plan that fits n
    calls fits fewer, so the calls are doubled from 2 while a plan fits,
    then bisected: two searches where two calls do not fit (a whole model
    under a tight cap). The step view plans again once the step is known."""

    def solve(repeats: int) -> BudgetSolution:
        with warnings.catch_warnings():
            if repeats > 1:  # a trial: only the graph alone may warn that nothing fits
                warnings.simplefilter("ignore")
            return solve_with_budget(facts, budget, profile, repeated_step(repeats), optimal_settings)

    fitting, failing = (1, None), None
    repeats = 2
    while repeats <= MAX_UNKNOWN_STEP_CALLS:
        solution = solve(repeats)
        if not solution.fits:
            failing = repeats
            break
        fitting, repeats = (repeats, solution), repeats * 2
    if failing is not None:
        low, high = fitting[0], failing
        while high - low > 1:
            middle = (low + high) // 2
            solution = solve(middle)
            if solution.fits:
                fitting, low = (middle, solution), middle
            else:
                high = middle
    repeats, solution = fitting
    if solution is None:
        solution = solve(1)
    return dataclasses.replace(
        solution, note=f"planned before the step was known, to fit the cap in a step of {repeats} call(s) of this graph",
    )


def _within_fraction_or_bytes(search: "_Search", budget: MemoryBudget | None, target: int, optimal: _Cut,
                              incumbent=None):
    """The fastest cut saving at most ``target`` bytes, the target, and a
    note; a ckpt fraction stops at the cut of lowest predicted peak instead
    (``incumbent()``, making the cut a region had, is one more candidate for
    it; made only when needed)."""
    if target >= optimal.saved_bytes:  # no budget, or one the fastest plan fits
        return optimal, target, None
    floor = search.lowest_peak(optimal) if budget.fraction is not None and not budget.pytorch_meaning else None
    if floor is not None and incumbent is not None:
        had = incumbent()
        floor = had if _by_peak(had) < _by_peak(floor) else floor
    if floor is not None and target <= floor.saved_bytes:
        note = _floor_note(budget, floor, search.lowest_peak_saving_less(floor.saved_bytes))
        return floor, floor.saved_bytes, note
    return search.fastest_within(target), target, None


def _rung(label: str, cut: _Cut) -> Rung:
    return Rung(label, cut.peak, tuple(sorted(n.name for n in cut.saved)))


def optimal_rung(facts: GraphFacts, optimal: _Cut, context: StepContext | None,
                 settings: Mapping | None) -> Rung:
    """The runtime-optimal rung, its peak predicted under the Inductor
    ``settings`` it compiles with (ckpt/backend.py ``plan_settings``: not
    the budget's, under which this plan is made)."""
    if settings:
        with compat.inductor_settings_patched(settings):
            optimal = _cut_of(facts, list(optimal.saved), context)
    return _rung(RUNTIME_OPTIMAL, optimal)


def _margin(context: StepContext | None) -> float:
    """The share of a peak budget left unplanned: the model's error, smaller
    once the step was measured."""
    return MEASURED_MARGIN if context is not None and context.measured else PEAK_MODEL_MARGIN


def _planned_peak(budget: MemoryBudget, context: StepContext | None) -> int:
    """The predicted step peak a peak budget plans for."""
    return int(budget.peak_bytes * (1 - _margin(context)))


def _solve_for_peak(search: "_Search", budget: MemoryBudget, optimal: _Cut, context: StepContext | None) -> _Cut:
    """The fastest cut whose predicted step peak fits the budget; if none
    does, the cut of lowest predicted peak, with a warning."""
    planned = _planned_peak(budget, context)
    if optimal.estimated_peak_bytes <= planned:
        return optimal
    cut = search.fastest_under_peak(planned, optimal)
    if cut is None:
        cut = search.lowest_peak(optimal)
        warnings.warn(
            f"ckpt: no plan of this graph fits the peak budget {budget} ({budget.peak_bytes} bytes, "
            f"planned with a {_margin(context):.0%} margin); the lowest predicted step peak "
            f"is {cut.estimated_peak_bytes} bytes, using that plan",
            stacklevel=3,
        )
    return cut


# Peak budgets plan for a predicted peak this much below the target: the
# peak model under-predicts Inductor's backward by up to this much on the
# bench's attention models at tight plans (python -m bench.peak_model:
# vit, gpt-dropout 4-7%, llama 11-13%), and an OOM costs more than a
# slightly slower plan.
PEAK_MODEL_MARGIN = 0.10
# Once the first steps measured the step and corrected the model by their
# ratio (ckpt/step_view.py), what is left is step-to-step noise: the
# allocator's order and the eager code between graphs (under 2% on the
# decoders of tests/test_step_view.py); 3% is the promise's tolerance.
MEASURED_MARGIN = 0.03

# peak:auto leaves this share of the device's free memory unplanned: the
# caching allocator's rounding and fragmentation, and library workspaces
# (cuBLAS, NCCL) that the peak model does not see.
PEAK_AUTO_MARGIN = 0.10
# ... and rounds the target down to this, so that ranks whose free memory
# differs by a few MiB still decide alike.
PEAK_AUTO_ROUNDING = 256 * 2**20


def resolved_budget(budget: MemoryBudget | None, device: torch.device | None) -> MemoryBudget | None:
    """``budget`` with nothing left to resolve: ``peak:auto`` becomes the
    free memory of the CUDA ``device`` now, less PEAK_AUTO_MARGIN, rounded
    down; every other budget is returned as it is."""
    if budget is None or not budget.peak_auto or budget.peak_bytes is not None:
        return budget
    if device is None or device.type != "cuda":
        raise ConfigError(
            "memory_budget='peak:auto' needs a CUDA device (it plans for the device's free "
            f"memory); this graph runs on {device or 'no device'}. Give the peak in bytes "
            "instead, e.g. CKPT_MEMORY_BUDGET=peak:6GiB"
        )
    free, _ = torch.cuda.mem_get_info(device)
    target = int(free * (1 - PEAK_AUTO_MARGIN))
    return dataclasses.replace(budget, peak_bytes=max(target // PEAK_AUTO_ROUNDING * PEAK_AUTO_ROUNDING, 0))


def _floor_note(budget: MemoryBudget, floor: _Cut, smaller: _Cut | None) -> str:
    """Why a fraction stopped at ``floor``: each plan the search saw that saves
    less has a higher predicted step peak (``smaller``: the lowest of them)."""
    text = (
        f"fraction {budget.fraction} stops at the plan of lowest predicted step peak "
        f"({floor.estimated_peak_bytes} bytes, saving {floor.saved_bytes})"
    )
    if smaller is None:
        return text + "; no plan saves less"
    return text + (
        f"; the lowest-peak plan saving less (saving {smaller.saved_bytes} bytes) predicts "
        f"{smaller.estimated_peak_bytes} bytes, so saving less would not lower the peak"
    )


def _target_bytes(budget: MemoryBudget | None, optimal_bytes: int, context: StepContext | None = None) -> int:
    if budget is None:
        return optimal_bytes
    if budget.nbytes is not None:
        return int(budget.nbytes * (context.byte_share if context is not None else 1.0))
    return int(budget.fraction * optimal_bytes)


def predicted_peak(peak: PeakEstimate, context: StepContext | None) -> int:
    """A plan's predicted peak: its graph's own, or the step's with it."""
    if context is None:
        return peak.step_bytes
    return context.step_peak(GraphCost.of(peak))


def spine_values(facts: GraphFacts) -> list[fx.Node]:
    """Forward activations that are, when computed, the only activation still
    waiting for a forward user (in graph order)."""
    activations = _activations(facts)
    waiting: dict[fx.Node, int] = {}
    spine = []
    for node in facts.nodes:
        if node not in activations:
            continue
        for arg in set(node.all_input_nodes) & activations:
            waiting[arg] -= 1
            if waiting[arg] == 0:
                del waiting[arg]
        users = sum(1 for user in node.users if user in activations)
        if users:
            waiting[node] = users
        if (
            list(waiting) == [node]
            and facts.nodes[node].savable
            and facts.nodes[node].storage_root is node
            and isinstance(node.meta.get("val"), torch.Tensor)
        ):
            spine.append(node)
    return spine


def _activations(facts: GraphFacts) -> set[fx.Node]:
    """Tensor-valued forward nodes that depend on a non-parameter input."""
    batch_inputs = facts.inputs - facts.static_inputs
    activations: set[fx.Node] = set()
    for node in facts.nodes:
        if node not in facts.forward or isinstance(node.meta.get("val"), torch.SymInt):
            continue
        # Inputs and their views are held by the caller anyway (labels waiting
        # for the loss are not a reason against a boundary).
        if facts.nodes[node].storage_root in facts.inputs:
            continue
        if any(a in activations or a in batch_inputs for a in node.all_input_nodes):
            activations.add(node)
    return activations


def repeating_run(facts: GraphFacts, spine: list[fx.Node]) -> tuple[int, int, int] | None:
    """``(first, end, period)``: the longest stretch ``spine[first:end]`` in
    which the ops between consecutive spine values repeat every ``period``
    values, at least twice over (a stack of identical blocks); None if none."""
    return _longest_run(_gaps(facts, spine)[0], 0, len(spine))


def repeating_runs(facts: GraphFacts, spine: list[fx.Node]) -> list[tuple[int, int, int]]:
    """Every stack of identical blocks along the spine, the longest run
    first (``repeating_run``); then, before and after it, the longest
    runs whose blocks hold two compute-heavy ops or more, and so on (a
    vision tower's layers and a language model's). Beside the first, a
    run of lighter blocks is two equal steps (a convolutional front end, a
    two-layer projector), not a stack of layers; and a run's first value
    may differ from the next block's, as the first layer of a stack also
    computes what all of its layers share (rotary tables)."""
    signatures, heavy = _gaps(facts, spine)
    first = _longest_run(signatures, 0, len(spine))
    if first is None:
        return []
    runs, pending = [first], [(0, first[0]), (first[1], len(spine))]
    while pending:
        low, high = pending.pop()
        run = _longest_run(signatures, low, high, lambda start, period: sum(heavy[start:start + period]) >= 2,
                           lead=1)
        if run is not None:
            runs.append(run)
            pending += [(low, run[0]), (run[1], high)]
    return runs


def _longest_run(signatures: list[int], low: int, high: int, accept=None, lead: int = 0) -> tuple[int, int, int] | None:
    """``repeating_run`` within ``signatures[low:high]`` (positions absolute),
    of the runs whose ``(first, period)`` ``accept`` takes (None: any); the
    first ``lead`` values of a run may differ from the next block's."""
    best = None  # (values covered, -period, first)
    for period in range(1, (high - low) // 2 + 1):
        run = 0
        for i in range(low, high - period):
            run = run + 1 if signatures[i] == signatures[i + period] else 0
            first = max(i + 1 - run - lead, low)
            covered = i + period + 1 - first
            if (run and covered >= 2 * period and (best is None or (covered, -period) > best[:2])
                    and (accept is None or accept(first, period))):
                best = (covered, -period, first)
    if best is None:
        return None
    covered, period, first = best
    return first, first + covered, -period


def _gaps(facts: GraphFacts, spine: list[fx.Node]) -> tuple[list[int], list[int]]:
    """Per spine value, a hash of the forward ops computed since the previous
    one, and how many of them are compute-heavy."""
    on_spine = set(spine)
    signatures, heavy, gap = [], [], []
    for node in facts.nodes:
        if node not in facts.forward or node.op == "placeholder":
            continue
        gap.append(node)
        if node in on_spine:
            signatures.append(hash(tuple(str(n.target) for n in gap)))
            heavy.append(sum(facts.nodes[n].category is OpCategory.COMPUTE for n in gap))
            gap = []
    return signatures, heavy


def periodic_boundaries(spine: list[fx.Node], run: tuple[int, int, int], phase: int, blocks: int) -> list[fx.Node]:
    """The spine values at ``phase`` within every ``blocks``-th repeat of
    ``run``; the repeats left over are split between the first and the last
    segment, so that no segment is much longer than the others."""
    first, end, period = run
    repeats = (end - first) // period
    offset = ((repeats - 1) % blocks) // 2
    return spine[first + phase + offset * period:end:period * blocks]


def pick_boundaries(facts: GraphFacts, spine: list[fx.Node], count: int) -> list[fx.Node]:
    """``count`` spine values splitting the forward into segments of about
    equal activation bytes; near each split point, the smallest value."""
    if count <= 0 or not spine:
        return []
    cumulative, total = {}, 0
    for node, node_facts in facts.nodes.items():
        if node in facts.forward:
            total += node_facts.nbytes
            cumulative[node] = total
    positions = [cumulative[node] for node in spine]
    segment = total / (count + 1)
    chosen = []
    for i in range(1, count + 1):
        centre = segment * i
        low = bisect.bisect_left(positions, centre - segment / 2)
        high = bisect.bisect_left(positions, centre + segment / 2)
        window = range(low, high) if high > low else [min(low, len(spine) - 1)]
        best = min(window, key=lambda j: (facts.nodes[spine[j]].nbytes, abs(positions[j] - centre)))
        if spine[best] not in chosen:
            chosen.append(spine[best])
    return chosen


def priced_runtimes(facts: GraphFacts, profile: DeviceProfile) -> dict[fx.Node, float]:
    """Cost-model seconds of each forward op the budget search prices when
    recomputed (compute-heavy ops, shrinking reductions; a tuple op's
    getitems too, as they share its category)."""
    return {
        node: estimate_runtime_s(node, profile)
        for node, node_facts in facts.nodes.items()
        if node in facts.forward and node_facts.category in PRICED_CATEGORIES
    }


@dataclasses.dataclass(frozen=True)
class Scope:
    """The part of a graph a search decides (a region of per-region budgets),
    and what is held fixed outside it: other regions' prices and boundaries."""

    nodes: frozenset[fx.Node]
    price: Mapping[fx.Node, int] = dataclasses.field(default_factory=dict)
    boundaries: frozenset[fx.Node] = frozenset()


class _Search:
    """Min cuts over boundary families and recompute rates, counted; within
    a ``scope`` (None: the whole graph), saved bytes, boundaries and heavy
    ops are the scope's, the rest of the cut as the scope holds it."""

    def __init__(self, flow: FlowGraph, profile: DeviceProfile, context: StepContext | None = None,
                 scope: Scope | None = None):
        self.flow = flow
        self.profile = profile
        self.context = context
        self.scope = scope
        self.facts = flow.facts
        self.cuts = 0
        self._families: list[_Cut] = []
        self._family_plans = self._all_families()
        self._peak_path: list[_Cut] = []
        """The lowest-peak family along the rates (lowest_peak's walk)."""

    # Read on the first search only: a graph whose budget the runtime-optimal
    # plan fits never pays for them.
    @functools.cached_property
    def spine(self) -> list[fx.Node]:
        return [node for node in spine_values(self.facts) if self._within(node)]

    @functools.cached_property
    def runtime(self) -> dict[fx.Node, float]:
        return {node: s for node, s in priced_runtimes(self.facts, self.profile).items() if self._within(node)}

    def _within(self, node: fx.Node) -> bool:
        return self.scope is None or node in self.scope.nodes

    def optimal(self) -> _Cut:
        """The runtime-optimal cut (within the scope, the rest held)."""
        if self.scope is None:
            return _cut_of(self.facts, _min_cut(self.flow), self.context)
        return _cut_of(
            self.facts, _min_cut(self.flow, self.scope.price, self.scope.boundaries), self.context,
            scope=self.scope.nodes,
        )

    @functools.cached_property
    def rates(self) -> list[float]:
        # The rates at which a heavy op's price equals its bytes, nudged up
        # so that ties go to saving: between two of them the cut does not
        # change for lone ops, so these are the rates worth trying.
        return sorted(
            {
                self.facts.nodes[node].nbytes / seconds * TIE_TO_SAVING
                for node, seconds in self.runtime.items()
                if seconds > 0
            }
        )

    def families(self) -> list[_Cut]:
        """Plans recomputing every heavy op they may, one per boundary set,
        from most boundaries to fewest, until STALE_TO_STOP in a row have not
        lowered the estimated peak."""
        if not self._families:
            _extend_until_stale(self._families, self._family_plans)
        return self._families

    def _next_family(self) -> bool:
        family = next(self._family_plans, None)
        if family is not None:
            self._families.append(family)
        return family is not None

    def lowest_peak(self, optimal: _Cut) -> _Cut:
        """The plan of lowest estimated peak: the runtime-optimal one, or the
        lowest-peak family at the rate where its peak is lowest (saving an op
        whose recompute needs a large working set can lower the peak).

        Every rate is tried, not only until the peak stops falling: along
        the rates it can rise before it falls (a dynamic-length Qwen2 at
        seq 512: 37.7 MiB at the first three rates, 24.4 at the sixth), and
        there are only as many rates as distinct heavy ops."""
        if not self._peak_path:
            family = min(self.families(), key=_by_peak)
            self._peak_path.append(family)
            plans = (self._cut(family.boundaries, rate) for rate in self.rates)
            self._peak_path.extend(itertools.takewhile(lambda p: p.saved_bytes < optimal.saved_bytes, plans))
        return min([optimal, *self._peak_path], key=_by_peak)

    def lowest_peak_saving_less(self, nbytes: int) -> _Cut | None:
        """Of the plans lowest_peak saw (the families and the lowest-peak
        walk), the one of lowest predicted peak that saves less than ``nbytes``."""
        smaller = [p for p in (*self.families(), *self._peak_path) if p.saved_bytes < nbytes]
        return min(smaller, key=_by_peak, default=None)

    def fastest_within(self, target: int) -> _Cut:
        """Of the families that fit, the one of lowest estimated peak (trying
        ones with fewer boundaries if none does), at the fastest rate."""
        fitting = [f for f in self.families() if f.saved_bytes <= target]
        while not fitting and self._next_family():
            if self._families[-1].saved_bytes <= target:
                fitting.append(self._families[-1])
        if not fitting:
            return min(self._families, key=lambda s: s.saved_bytes)  # fits nothing: the smallest
        family = min(fitting, key=_by_peak)
        return self._fastest_rate(family.boundaries, lambda s: s.saved_bytes <= target, family)

    def fastest_under_peak(self, target: int, optimal: _Cut) -> _Cut | None:
        """The least recompute time whose predicted step peak is at most
        ``target``, None if no plan the search sees fits. The peak is not
        monotone in the rate (recomputing a matmul can raise it), so the
        start is the fastest fitting plan among the families and the
        lowest-peak walk; from there the rate rises while the plan fits, for
        the FAMILIES_TRIED fitting boundary sets of least recompute."""
        self.lowest_peak(optimal)
        fitting = [p for p in (*self.families(), *self._peak_path) if p.estimated_peak_bytes <= target]
        if not fitting:
            return None

        def fits(solution: _Cut) -> bool:
            return solution.estimated_peak_bytes <= target

        starts: dict[frozenset, _Cut] = {}
        for plan in sorted(fitting, key=lambda s: (s.recompute_time_s, s.estimated_peak_bytes)):
            starts.setdefault(plan.boundaries, plan)
        plans = [
            self._fastest_rate(start.boundaries, fits, start, above=start.rate)
            for start in list(starts.values())[:FAMILIES_TRIED]
        ]
        return min(plans, key=lambda s: (s.recompute_time_s, s.estimated_peak_bytes))

    def _all_families(self):
        """Every family plan, most boundaries first, ending with none (lazily:
        each is a min cut)."""
        runs = repeating_runs(self.facts, self.spine)
        if not runs:
            count = len(self.spine)
            while count > 0:
                yield self._cut(pick_boundaries(self.facts, self.spine, count), rate=0.0)
                count //= HALVING
        else:
            yield self._cut(self.spine, rate=0.0)

            def every(blocks: int, phases: tuple[int | None, ...]) -> list[fx.Node]:
                return [value for run, phase in zip(runs, phases) if phase is not None
                        for value in periodic_boundaries(self.spine, run, phase, blocks)]

            # A boundary every block: each stack's phase chosen in turn, the
            # longest first, the others without boundaries (None) until
            # their turn; for them None is a choice too, as their boundaries
            # may raise the peak (with one stack: its phases, as ever).
            per_block: dict[tuple[int | None, ...], _Cut] = {}
            phases = (0,) + (None,) * (len(runs) - 1)
            for i, (_, _, period) in enumerate(runs):
                choices = list(range(period)) if i == 0 else [None, *range(period)]
                tried = [phases[:i] + (phase,) + phases[i + 1:] for phase in choices]
                for choice in tried:
                    if choice not in per_block:
                        per_block[choice] = self._cut(every(1, choice), rate=0.0)
                phases = min(tried, key=lambda choice: _by_peak(per_block[choice]))
            # Alternatives of one boundary count, all cut already: the best
            # first, so that staleness stops after it.
            yield from sorted(per_block.values(), key=_by_peak)
            for blocks in range(2, max((end - first) // period for first, end, period in runs) + 1):
                yield self._cut(every(blocks, phases), rate=0.0)
        yield self._cut([], rate=0.0)

    def _fastest_rate(self, boundaries, fits, cheapest: _Cut, above: float = 0.0) -> _Cut:
        """Binary search on the rates above ``above`` (where ``cheapest``
        fits): the highest (least recompute) whose plan ``fits``, then on how
        many of the ops the next rate would save can be saved."""
        best, best_rate, over = cheapest, above, None
        low, high = bisect.bisect_right(self.rates, above), len(self.rates) - 1
        while low <= high:
            middle = (low + high) // 2
            solution = self._cut(boundaries, rate=self.rates[middle])
            if fits(solution):
                best, best_rate, low = solution, self.rates[middle], middle + 1
            else:
                over, high = solution, middle - 1
        if over is None:
            return best
        # Ops of equal bytes per second (the same layer repeated) flip
        # together at one rate: save as many of them as fit. Which ones moves
        # the peak (saved values are alive at the start of backward, weight
        # gradients pile up towards its end), so both ends are tried.
        order = {node: i for i, node in enumerate(self.facts.nodes)}
        flips = sorted(best.priced_recomputed - over.priced_recomputed, key=order.__getitem__)
        candidates = [
            self._most_saved_that_fit(boundaries, best_rate, fits, keep_order)
            for keep_order in (flips, flips[::-1])
        ]
        return min(candidates, key=lambda s: (s.estimated_peak_bytes, s.recompute_time_s))

    def _most_saved_that_fit(self, boundaries, rate, fits, keep_order) -> _Cut:
        """The longest prefix of ``keep_order`` that can stay saved while the plan ``fits``."""
        best = None
        low, high = 1, len(keep_order)
        while low <= high:
            middle = (low + high) // 2
            solution = self._cut(boundaries, rate, keep=keep_order[:middle])
            if fits(solution):
                best, low = solution, middle + 1
            else:
                high = middle - 1
        return best or self._cut(boundaries, rate, keep=())

    def _cut(self, boundaries, rate: float, keep=()) -> _Cut:
        """The min cut at ``rate``; ``keep`` are heavy ops not to recompute."""
        scale = byte_scale(self.facts)
        keep = set(keep)
        price = {
            node: round(rate * seconds * scale)
            for node, seconds in self.runtime.items()
            if node not in keep
        }
        return self.cut_priced(boundaries, price, rate)

    def cut_priced(self, boundaries, price: Mapping[fx.Node, int], rate: float = 0.0) -> _Cut:
        """The min cut with the scope's heavy ops at ``price`` (absent: never
        recomputed) and ``boundaries``: a region's earlier cut, made again."""
        self.cuts += 1
        held = self.scope or Scope(frozenset())
        saved = _min_cut(self.flow, {**held.price, **price}, held.boundaries | frozenset(boundaries))
        recomputed = frozenset(recomputed_nodes(self.facts, set(saved)) & self.runtime.keys())
        return _cut_of(
            self.facts, saved, self.context, scope=None if self.scope is None else self.scope.nodes,
            boundaries=frozenset(boundaries), rate=rate, priced_recomputed=recomputed, price=price,
            # fsum: exact, so sets of ops of equal runtimes tie exactly whatever
            # the set's order (a plain sum's rounding broke ties differently
            # from run to run: which of the identical layers to recompute).
            recompute_time_s=math.fsum(self.runtime[node] for node in recomputed),
        )


def _cut_of(facts: GraphFacts, saved: list[fx.Node], context: StepContext | None, scope=None, **how) -> _Cut:
    """The cut saving ``saved``, its bytes (of the nodes in ``scope`` alone,
    when given) and predicted peak; ``how`` it was made."""
    peak = estimate_step_peak(facts, saved)
    counted = saved if scope is None else [node for node in saved if node in scope]
    return _Cut(
        saved=tuple(saved), saved_bytes=activation_bytes(facts, counted),
        estimated_peak_bytes=predicted_peak(peak, context), peak=peak, **how,
    )


def _min_cut(flow: FlowGraph, price=None, boundaries=()) -> list[fx.Node]:
    """The saved set of the minimum cut, less values backward never reads."""
    return read_by_backward(flow.facts, solve(flow, price, boundaries))


def _by_peak(solution: _Cut) -> tuple[int, float, int]:
    # Between plans of equal predicted peak, the one that recomputes less:
    # recomputed heavy ops are where the peak model is least sure (a GPT
    # plan recomputing attention, predicted as low as one saving it,
    # measured 44% higher), and they cost time.
    return solution.estimated_peak_bytes, solution.recompute_time_s, solution.saved_bytes


def _extend_until_stale(plans: list[_Cut], more) -> None:
    """Append plans from the iterator ``more`` until STALE_TO_STOP in a row
    have not lowered the estimated peak (``more`` stays resumable)."""
    stale = 0
    for plan in more:
        lowers = all(plan.estimated_peak_bytes < p.estimated_peak_bytes for p in plans)
        plans.append(plan)
        stale = 0 if lowers else stale + 1
        if stale >= STALE_TO_STOP:
            return
