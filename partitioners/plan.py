"""The Plan: what is saved, what is recomputed, and why."""
from __future__ import annotations

import dataclasses

import torch.fx as fx

from .canonical import op_label
from .budget import BudgetSolution, Rung
from .classify import GraphFacts, NodeFacts, activation_bytes, recomputed_nodes, user_wants_recompute
from .ops import Recompute
from .peak import PeakEstimate

SAVED = "saved"
RECOMPUTED = "recomputed"


@dataclasses.dataclass(frozen=True)
class Decision:
    name: str
    op: str
    decision: str
    """``SAVED`` or ``RECOMPUTED``."""
    nbytes: int
    reason: str
    is_input: bool = False
    """Its storage is a graph input's: saving it holds nothing the caller does not."""


@dataclasses.dataclass(frozen=True)
class Plan:
    """One joint graph's partition, in graph order.

    ``fallback`` is set (and ``decisions`` empty) when ckpt could not
    partition the graph and PyTorch's partitioner was used instead.
    """

    decisions: tuple[Decision, ...] = ()
    saved_activation_bytes: int = 0
    """Bytes kept alive for backward beyond the graph inputs, each storage once."""
    fallback: str | None = None
    fingerprint: str | None = None
    """Digest of the decisions by canonical name, set when ranks of a process
    group compared their plans (it is then the same on every rank)."""
    budget: str | None = None
    """The memory budget asked for, as written (None: runtime-optimal)."""
    budget_bytes: int | None = None
    """The budget in bytes for this graph (a fraction resolved)."""
    optimal_bytes: int = 0
    """Saved bytes of the runtime-optimal plan for this graph."""
    fits_budget: bool = True
    budget_note: str | None = None
    """Why the plan saves what it does when the budget alone does not say
    (a fraction that stopped at the plan of lowest predicted peak)."""
    step: str | None = None
    """The training step the plan was judged in (ckpt/step_view.py), when
    known: how often the graph runs in it, and the measured correction."""
    peak_estimate: PeakEstimate | None = None
    """The forward and backward peaks behind ``estimated_peak_bytes``, and what
    forward holds for backward (to compose the graphs of one step)."""
    estimated_peak_bytes: int = 0
    """Predicted peak bytes of one training step above what is live before it
    (partitioners/peak/): the larger of the forward and backward peaks."""
    recompute_time_s: float = 0.0
    """Estimated time of heavy ops recomputed to fit the budget."""
    solve_time_s: float = 0.0
    """Wall time of the decision (min cuts and budget search)."""
    rungs: tuple[Rung, ...] = ()
    """The plans of looser budgets the step view may fall back to when this
    one measures above what they are predicted to peak (budget.ladder)."""
    regions: tuple = ()
    """Per-region budgets: each region's budget, saved bytes and recomputed
    heavy ops (regions.RegionOutcome), in graph order."""

    @property
    def saved(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.decisions if d.decision == SAVED)

    @property
    def recomputed(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.decisions if d.decision == RECOMPUTED)

    def reason(self, name: str) -> str:
        for d in self.decisions:
            if d.name == name:
                return d.reason
        raise KeyError(f"{name} is neither saved nor recomputed in this plan")


def build_plan(facts: GraphFacts, saved: list[fx.Node], solution: BudgetSolution | None = None,
               budget: str | None = None, step: str | None = None) -> Plan:
    """Decisions for every saved value and every forward node backward re-runs,
    with what the budget search found (``solution``) for ``budget`` (as
    written; None: runtime-optimal) in ``step`` (the step view's account)."""
    saved_set = set(saved)
    recomputed = recomputed_nodes(facts, saved_set)
    boundaries = solution.boundaries if solution else frozenset()
    priced = solution.priced_recomputed if solution else frozenset()
    decisions = []
    for node, node_facts in facts.nodes.items():  # graph order
        if node in saved_set:
            decision, reason = SAVED, _save_reason(node, node_facts, facts)
            if node in boundaries:
                reason = "saved: segment boundary, so backward recomputes one segment at a time"
        elif node in recomputed:
            decision, reason = RECOMPUTED, _recompute_reason(node_facts)
            if node in priced:
                reason = f"recomputed: {node_facts.category.label}, to fit the memory budget"
        else:
            continue
        decisions.append(
            Decision(
                node.name,
                op_label(node, overload=True),
                decision,
                node_facts.nbytes,
                reason,
                is_input=node_facts.storage_root in facts.free_inputs,
            )
        )
    outcome = {} if solution is None else dict(
        budget_bytes=solution.target_bytes,
        optimal_bytes=solution.optimal_bytes,
        fits_budget=solution.fits,
        budget_note=solution.note,
        estimated_peak_bytes=solution.estimated_peak_bytes,
        peak_estimate=solution.peak,
        recompute_time_s=solution.recompute_time_s,
        solve_time_s=solution.solve_time_s,
        rungs=solution.rungs,
        regions=solution.regions,
    )
    return Plan(
        decisions=tuple(decisions), saved_activation_bytes=activation_bytes(facts, saved),
        budget=budget, step=step, **outcome,
    )


def _save_reason(node: fx.Node, node_facts: NodeFacts, facts: GraphFacts) -> str:
    category = node_facts.category
    if node in facts.relaid_inputs:
        return "saved: graph input; Inductor keeps a channels-last copy of it for its convolution"
    if node in facts.static_inputs:
        return "saved: graph input, parameter or buffer (alive anyway, free)"
    if node in facts.inputs:
        return "saved: graph input"
    if node in facts.forced_saves:
        return "saved: source of an input mutation that backward repeats"
    if category.policy is Recompute.MUST_SAVE:
        return f"saved: {category.label}, must not be replayed"
    if node_facts.region_boundary:
        return "saved: checkpoint region output read by a later region"
    if node_facts.user_tag is not None and not user_wants_recompute(node_facts):
        return f"saved: checkpoint policy {node_facts.user_tag.name}"
    if category.policy is Recompute.NEVER and not user_wants_recompute(node_facts):
        return f"saved: {category.label}, never recomputed"
    return f"saved: {category.label}, on the minimum cut (fewest bytes)"


def _recompute_reason(node_facts: NodeFacts) -> str:
    if user_wants_recompute(node_facts):
        return f"recomputed: checkpoint policy {node_facts.user_tag.name}"
    return f"recomputed: {node_facts.category.label}, cheaper than saving"
