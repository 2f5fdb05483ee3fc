"""The step view: which compiled graphs make up one training step, and
plans chosen for the step's peak, not each graph's alone.

With a memory budget, the backend hands Dynamo a ``PlannedGraph``
(ckpt/planned_graph.py) for each graph it compiles, and owns one StepView
for them all. Calls are recorded (ckpt/step_calls.py): a step is the
training calls between two ends of backward (the autograd engine tells when
backward ends), so each micro-batch of gradient accumulation is a step. After
the first step, each graph of that step is planned again for its place in
it (partitioners/step.py): how often it runs, what the step's other graphs
hold meanwhile. The first steps are also measured (ckpt/step_meter.py: the
peak bytes allocated from the step's first graph call to the end of its
backward), and where the prediction was off the model is corrected by the
measured ratio and the graphs planned again, at most ``MAX_CORRECTIONS``
times. Under torch.distributed every rank takes part in one agreement per
step while any rank still learns (partitioners/rank_sync.py): the largest
measurement where every rank measured the same step, else none, so ranks
plan alike and none waits for a rank that did not measure.

Once every kind of step seen has settled, a call of a settled graph only
looks up its size bucket: no recording, no hooks, no measurement. A call of
a graph or bucket not in a settled step starts recording again. Every
recompile is counted (``StepView.recompiles``). Only a step whose calls ran
at the sizes their plans were made for corrects the model (a shorter batch
in a bucket is measured against the bucket's prediction, which is not its own).

A plan is then a pure function of the graphs of the step, the config and
the measurements (reduced across ranks), no longer of one graph alone.
"""
from __future__ import annotations

import dataclasses
import time
import typing

import torch

from partitioners.budget import rung_budget
from partitioners.config import MemoryBudget, warn_once
from partitioners.plan import Plan
from partitioners.rank_sync import MeasurementAgreement
from partitioners.step import (
    UNKNOWN_STEP, Gathered, GraphCost, StepContext, gathered_per_call, predicted_step_peak, repeated_inputs,
    step_context,
)

import ckpt_compat as compat
from .step_calls import Calls, first_requiring_grad, shard_group_size
from .step_meter import StepMeter
from .step_report import OWN, describe, rung_name, sequence_id, tried_text, write_step_report

# A step measured over its cap is corrected and planned again at most this
# many times (each costs a recompile of the step's graphs and a profiled step).
MAX_CORRECTIONS = 2
# Within this of the cap a measured step counts as holding it (the promise's
# tolerance, see partitioners/budget.py MEASURED_MARGIN).
CAP_TOLERANCE = 0.03
# Looser budgets a step may try after its own plan measured high (each
# costs a recompile of the step's graphs and two steps, one to compile, one
# to measure); then the step runs the plans that measured lowest.
MAX_FALLBACKS = 3
# The rung of a peak: cap's plan before the step is known (partitioners/
# step.py UNKNOWN_STEP); planned again for the step after it.
PROVISIONAL = "provisional"
# A step of a dynamic graph below the size its plan was made for is measured
# but cannot correct the model; after this many such steps measuring stops.
MAX_STEPS_BELOW_PLAN = 8
# A step longer than this many graph calls without a backward is not a
# training step (e.g. evaluation with autograd on): its record is dropped.
MAX_CALLS = 100_000


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One measured step: the peak the model predicted for the plans that
    ran, and the peak measured (the largest over ranks)."""

    step: int
    sequence_id: str
    predicted_bytes: int
    measured_bytes: int
    judged: bool = True
    """False for a step measured only because ``meter_every_step`` asked:
    seen, not used to plan."""
    rung: str = OWN
    """The budget the plans that ran were made for: the graphs' own, or a
    looser one the step fell back to (budget.ladder)."""

    @property
    def ratio(self) -> float:
        return self.measured_bytes / self.predicted_bytes if self.predicted_bytes else 1.0


@dataclasses.dataclass
class _Sequence:
    """What the view knows of one kind of step (one sequence of graph calls)."""

    correction: float = 1.0
    measured: bool = False
    corrections: int = 0
    settled: bool = False
    below_plan_steps: int = 0
    rung: str = OWN
    """The budget the step's graphs plan for (OWN, or a rung of budget.ladder)."""
    repeated: tuple[frozenset[int], ...] = ()
    """Per call, the inputs an earlier call of its graph was handed too
    (``partitioners.step.repeated_inputs``), from the latest step."""
    gathered: tuple[Gathered, ...] = ()
    """Per call, what a sharding gathered around it (``gathered_per_call``)."""
    tried: dict[str, int] = dataclasses.field(default_factory=dict)
    """Rung -> the measured step peak of its plans (the latest, for OWN)."""


class _EndedStep(typing.NamedTuple):
    """A step whose backward ended, measured when its backward returns
    (or at the next call, where no meter ran)."""

    calls: Calls
    meter: StepMeter | None
    wanted: bool
    end_ns: int


class StepView:
    """The graph calls of the running step, what each graph's plan costs, and
    what each was planned for. One per backend (``CkptBackend.step_view``)."""

    def __init__(self):
        self.calls = Calls()
        """The running step's calls."""
        self.costs: dict[str, GraphCost] = {}
        self.plans: dict[str, Plan] = {}
        self.rungs: dict[str, dict[str, tuple[GraphCost, tuple[str, ...]]]] = {}
        """Per graph, rung -> the cost and saved names of its plan for that rung."""
        self.budgets: dict[str, MemoryBudget] = {}
        self.measuring: dict[str, bool] = {}
        self.sequences: dict[tuple[str, ...], _Sequence] = {}
        self.last_sequence: dict[str, tuple[str, ...]] = {}
        self.measurements: list[Measurement] = []
        self.fresh: set[str] = set()
        """Graphs compiled since the last step: a step running one is not
        measured (the backward graph compiles during the first backward,
        and what compiling allocates is not the plan's)."""
        self.steps = 0
        self.recompiles = 0
        self.report_dir: str | None = None
        self.meter_every_step = False
        """Measure every step (a benchmark's per-step peaks), not only the
        ones planning needs; the extra measurements only inform."""
        self.closed = False
        self.settled_keys: frozenset[str] = frozenset()
        """Graphs whose calls need no recording (``_settled_graphs``)."""
        self._agreement = MeasurementAgreement()
        self._meter: StepMeter | None = None
        self._wanted = False
        self._ending = False
        self._ended: _EndedStep | None = None

    def __reduce__(self):
        # Reached through the backend when Inductor hashes a partitioner for
        # its cache key: what the view learnt is not part of a graph's key.
        return (StepView, ())

    # -- what a graph is planned for ------------------------------------------

    def context_for(self, key: str, budget: MemoryBudget | None) -> tuple[StepContext | None, tuple]:
        """The step ``key`` last ran in, as its plan should see it (None: not
        seen in a finished step yet, or alone in it: plan it alone), and what
        that context depends on (``planning_for``)."""
        self.budgets[key] = budget
        planned_for = self.planning_for(key)
        if planned_for[2] == PROVISIONAL:
            return UNKNOWN_STEP, planned_for
        if planned_for == (None, None, OWN):
            return None, planned_for
        sequence = self.last_sequence[key]
        state = self.sequences[sequence]
        fallback = None
        if state.rung != OWN:
            fallback = (
                f"runs the plans of {rung_name(state.rung)}, not its own ({budget}): "
                f"measured step peaks {tried_text(state.tried)}"
            )
        context = step_context(
            key, sequence, self.costs, state.correction, state.measured, fallback, state.repeated, state.gathered
        )
        return context, planned_for

    def budget_for(self, key: str, budget: MemoryBudget | None) -> MemoryBudget | None:
        """The budget ``key`` plans for: its own, or the looser one its step
        fell back to."""
        sequence = self.last_sequence.get(key)
        rung = OWN if sequence is None else self.sequences[sequence].rung
        return budget if rung == OWN else rung_budget(rung)

    def planning_for(self, key: str) -> tuple:
        """What a plan of ``key`` depends on beyond its graph: the step's
        sequence when other calls share it, the measured correction when a
        peak cap is judged by it, and the rung of the budget's ladder
        (PROVISIONAL: a peak cap's plan before the step is known)."""
        sequence = self.last_sequence.get(key)
        budget = self.budgets.get(key)
        if sequence is None:
            return (None, None, PROVISIONAL if budget is not None and budget.is_peak else OWN)
        state = self.sequences[sequence]
        correction = state.correction if budget is not None and budget.is_peak and state.measured else None
        return (sequence if len(sequence) > 1 else None, correction, state.rung)

    def record_plan(self, key: str, plan: Plan | None, measure: bool, rung: str = OWN) -> None:
        if plan is not None:
            self.plans[key] = plan
            self.costs[key] = GraphCost.of(plan.peak_estimate, plan.optimal_bytes)
        if plan is not None and rung != PROVISIONAL:  # the ladder is of plans made for the step
            known = self.rungs.setdefault(key, {})
            for looser in plan.rungs:
                known[looser.label] = (GraphCost.of(looser.peak, plan.optimal_bytes), looser.saved)
            known[rung] = (self.costs[key], tuple(sorted(plan.saved)))
        self.measuring[key] = measure
        self.fresh.add(key)
        self.settled_keys = frozenset()

    # -- the running step -----------------------------------------------------

    def before_call(self, key: str, device: torch.device) -> None:
        """A training call of ``key`` on ``device`` begins: the first of a
        step starts the step's meter if the step is to be measured."""
        if self.calls.keys or self._ending or not torch.is_grad_enabled():
            return
        self._wanted = self._wants_measurement(key)
        if self._meter is None and (self._wanted or self.meter_every_step):
            # None where a profiler (the user's) is on: the step goes unmeasured.
            self._meter = StepMeter.start(device, self._backward_returned)

    def after_call(self, key: str, outputs, planned_for: tuple, at_planned_sizes: bool = True, args=()) -> None:
        """Record a training call (one whose outputs need gradients) of a plan
        made for ``planned_for``, and ask to hear when its backward ends.
        A call below the sizes its plan was made for (a shorter batch in a
        size bucket) keeps its step from correcting the model: the
        prediction is the bucket's, the measurement is not."""
        tensor = first_requiring_grad(outputs)
        if tensor is None:
            return
        if len(self.calls.keys) >= MAX_CALLS:
            self.drop_step()
        self.calls.record(key, args, planned_for, at_planned_sizes)
        tensor.register_hook(self._on_gradient)

    def _on_gradient(self, grad):
        if not self._ending and self.calls.keys:
            self._ending = True
            compat.after_backward(self.end_step)
        return None

    def end_step(self) -> None:
        """Backward ended: the step's calls are one sequence. Its meter stops
        when the backward returns to its caller (``_backward_returned``):
        the autograd engine restores the profiler's thread state after its
        callbacks, so it cannot be stopped here; events after now are not
        counted."""
        self._ending = False
        calls, self.calls = self.calls, Calls()
        if calls.keys:
            self._ended = _EndedStep(calls, self._meter, self._wanted, time.time_ns())
            self._meter = None

    def _backward_returned(self, finished: bool) -> None:
        """The step meter's thread returned from a backward: finish the step
        that ended in it; a backward that raised ends the running step."""
        if self._ended is not None:
            self.finish_step()
        elif not finished:
            self.drop_step()

    def finish_step(self) -> None:
        """Measure the step that ended, if any, and mark what must be planned again."""
        if self._ended is None:
            return
        (calls, meter, wanted, end_ns), self._ended = self._ended, None
        sequence, below_plan = tuple(calls.keys), calls.below_plan
        self.steps += 1
        if sequence not in self.sequences:
            self._warn_unmatched_regions(sequence)
        state = self.sequences.setdefault(sequence, _Sequence())
        state.repeated = self._repeated_inputs(sequence, calls.inputs)
        state.gathered = gathered_per_call(calls.freed_parameters(), 1 / shard_group_size())
        for key in set(sequence):
            self.last_sequence[key] = sequence
        # Whether the plans that ran were made for this step, before the
        # measurement below changes what they should be made for.
        planned_for_it = all(planned_for == self.planning_for(key) for key, planned_for in calls.ran)
        measured = None if meter is None else meter.peak(until_ns=end_ns)
        judge = wanted and not below_plan and not self.fresh & set(sequence)
        self.fresh -= set(sequence)
        if wanted and below_plan:
            state.below_plan_steps += 1
            state.settled |= state.below_plan_steps >= MAX_STEPS_BELOW_PLAN
        # Every rank takes part, with or without a measurement of its own;
        # a step not measured alike on every rank corrects nothing.
        agreed = self._agreement.agree(sequence_id(sequence), measured if judge else None, more=not self.settled)
        if agreed is not None:
            self._judge(sequence, state, agreed, planned_for_it)
        elif measured is not None:
            predicted = predicted_step_peak(sequence, self.costs, state.repeated, state.gathered)
            self.measurements.append(
                Measurement(self.steps, sequence_id(sequence), predicted, measured, False, state.rung)
            )
        if self._agreement.closed:
            state.settled = True  # ranks measure no more: plans stay the model's, alike on every rank
        if not self._agreement.active and not self.meter_every_step:
            self.settled_keys = self._settled_graphs()
        self._write_report()

    def _settled_graphs(self) -> frozenset[str]:
        """Graphs every step they run in has settled: their calls need no
        recording (a step of other graphs still learning does not hold
        them back, nor do they hide a graph first seen later)."""
        learning = {key for sequence, state in self.sequences.items() if not state.settled for key in sequence}
        return frozenset(
            key for sequence, state in self.sequences.items() if state.settled for key in sequence
        ) - learning

    def _repeated_inputs(self, sequence: tuple[str, ...], inputs: list[tuple]) -> tuple[frozenset[int], ...]:
        """``repeated_inputs`` of the step, none for a call whose inputs do
        not line up with its graph's (AOTAutograd merged duplicates)."""
        repeated = repeated_inputs(sequence, inputs)
        return tuple(
            found if key in self.costs and len(identities) == self.costs[key].input_count else frozenset()
            for key, identities, found in zip(sequence, inputs, repeated)
        )

    def _warn_unmatched_regions(self, sequence: tuple[str, ...]) -> None:
        """Warn once for a per-module budget that no graph of the step has a
        module of: a path that names nothing would otherwise change nothing."""
        asked = {key for k in set(sequence) if self.budgets.get(k) is not None for key, _ in self.budgets[k].regions}
        found = {row.key for k in set(sequence) if k in self.plans for row in self.plans[k].regions}
        for key in sorted(asked - found - {""}):
            warn_once(
                f"ckpt: the per-module budget for {key!r} matched no module in this step's compiled graphs, "
                "so it changed nothing. Paths are those of model.named_modules() from the compiled module "
                "(e.g. 'model.layers.0'); a block compiled on its own names paths from itself unless "
                "make_backend(model=model) or module_prefix says where it sits"
            )

    def _judge(self, sequence: tuple[str, ...], state: _Sequence, measured: int, planned_for_it: bool) -> None:
        """Correct the model by the measured ratio where the step needs plans
        anyway (its first measurement) or broke its cap; fall back to a
        looser budget's plans where they may peak lower (``_next_rung``);
        settle on the plans that measured lowest otherwise."""
        predicted = predicted_step_peak(sequence, self.costs, state.repeated, state.gathered)  # the model's own, uncorrected
        self.measurements.append(Measurement(self.steps, sequence_id(sequence), predicted, measured, rung=state.rung))
        if planned_for_it:
            state.tried[state.rung] = measured
        cap = self._cap(sequence)
        over = cap is not None and measured > cap * (1 + CAP_TOLERANCE)
        ratio = measured / predicted if predicted else 1.0
        if not state.measured and not (planned_for_it and not over):
            state.correction, state.measured = ratio, True
        elif over and state.rung == OWN and state.corrections < MAX_CORRECTIONS:
            state.correction, state.corrections = ratio, state.corrections + 1
        else:
            # Corrected as often as allowed, or nothing to correct: the ladder.
            rung = self._next_rung(sequence, state)
            if rung is None:
                state.rung, state.settled = _lowest_measured(state.tried) if state.tried else state.rung, True
            else:
                state.rung = rung

    def _next_rung(self, sequence: tuple[str, ...], state: _Sequence) -> str | None:
        """A looser budget whose plans the model predicts below the lowest
        step peak measured so far: the model may be wrong about the plans
        that ran, and is checked by measuring those. Of several, the one
        predicted lowest; None when none is (or MAX_FALLBACKS were tried).

        The model's own prediction, uncorrected: its error is a plan's, not
        the step's (a ConvNeXt's tight plans measure 33% above the model,
        its runtime-optimal one close to it), so a ratio measured on one
        plan does not carry over to another."""
        if not state.tried or len(state.tried) > MAX_FALLBACKS:
            return None
        lowest = min(state.tried.values())
        seen = {self._plans_of(sequence, rung) for rung in state.tried}
        candidates = []
        for rung in self._ladder(sequence):
            plans = self._plans_of(sequence, rung)
            if rung in state.tried or plans in seen:
                continue
            seen.add(plans)
            costs = {
                key: self.rungs.get(key, {}).get(rung, (cost, ()))[0]
                for key, cost in self.costs.items() if key in sequence
            }
            predicted = predicted_step_peak(sequence, costs, state.repeated, state.gathered)
            if predicted < lowest:
                candidates.append((predicted, rung))
        return min(candidates)[1] if candidates else None

    def _ladder(self, sequence: tuple[str, ...]) -> list[str]:
        """The rungs the step's graphs know, tight to loose."""
        rungs = {rung for key in set(sequence) for rung in self.rungs.get(key, {})} - {OWN}
        return sorted(rungs, key=float)

    def _plans_of(self, sequence: tuple[str, ...], rung: str) -> tuple:
        """What the step's graphs save at ``rung`` (equal tuples: the same plans)."""
        return tuple(self.rungs.get(key, {}).get(rung, (None, None))[1] for key in sorted(set(sequence)))

    def _cap(self, sequence) -> int | None:
        caps = [b.peak_bytes for k in set(sequence) if (b := self.budgets.get(k)) is not None and b.peak_bytes]
        return min(caps, default=None)

    def _wants_measurement(self, key: str) -> bool:
        if not self.measuring.get(key, False) or key in self.fresh:
            return False
        sequence = self.last_sequence.get(key)
        return sequence is None or not self.sequences[sequence].settled

    def stop_measuring(self) -> None:
        """A graph compiles during the running step: stop its measurement
        (what compiling allocates is not the plan's, and the profiler is
        not left running through Dynamo and Inductor)."""
        if self._meter is not None:
            self._meter.stop()
        self._meter, self._wanted = None, False

    def close(self) -> None:
        """Stop measuring and forget the running step (idempotent); a closed
        view is not given to new backends."""
        self.closed = True
        if self._ended is not None:
            if self._ended.meter is not None:
                self._ended.meter.stop()
            self._ended = None
        self.drop_step()

    def drop_step(self) -> None:
        """Forget the running step (it raised, or never ended): its meter stops."""
        self.calls, self._ending = Calls(), False
        self.stop_measuring()

    # -- what a reader sees ---------------------------------------------------

    @property
    def settled(self) -> bool:
        """Every kind of step seen has settled on its plans (the view will not
        re-plan them, nor try another rung): what runs now is what runs on."""
        return bool(self.sequences) and all(state.settled for state in self.sequences.values())

    def describe(self) -> str:
        """The step view as markdown: graphs, calls, predicted and measured peaks."""
        self.finish_step()
        return describe(self)

    def _write_report(self) -> None:
        if self.report_dir is not None:
            write_step_report(self, self.report_dir)


def _lowest_measured(tried: dict[str, int]) -> str:
    """The rung whose plans measured lowest; on a tie, the tightest (the
    budget's own first)."""
    order = lambda rung: -1.0 if rung == OWN else float(rung)  # noqa: E731
    return min(tried, key=lambda rung: (tried[rung], order(rung)))
