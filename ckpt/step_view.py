"""The step view: which compiled graphs make up one training step, and
plans chosen for the step's peak, not each graph's alone.

With a memory budget, the backend hands Dynamo a ``PlannedGraph`` for each
graph it compiles. Its calls are recorded: a step is the calls between two
ends of backward (the autograd engine tells when backward ends). After the
first step, each graph of that step is planned again for its place in it
(partitioners/step.py): how often it runs, what the step's other graphs hold
meanwhile. The first steps are also measured (peak bytes allocated from the
step's first graph call to the end of its backward: CUDA's peak counter, on
CPU the profiler's memory events), and where the prediction was off the
model is corrected by the measured ratio and the graphs planned again, at
most ``MAX_CORRECTIONS`` times. Ranks take the largest of their
measurements, so they plan alike.

Re-planning is a recompile inside ckpt's compiled callable, before the
call that needs it runs, in the tracing context of the graph's Dynamo
compile, as Dynamo itself recompiles a graph for a specialization at run
time. The same callable keeps one plan per size bucket of a dynamic graph
(the next power of two of each dynamic size, or a declared
``mark_dynamic(max=...)`` bound) and picks one by the sizes it is called
with, so a longer batch gets a plan made for it before it runs. Every
recompile is counted (``StepView.recompiles``). Only a step whose calls ran
at the sizes their plans were made for corrects the model (a shorter batch
in a bucket is measured against the bucket's prediction, which is not its own).

A plan is then a pure function of the graphs of the step, the config and
the measurements (reduced across ranks), no longer of one graph alone.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib
import sys
import time
import typing
import weakref

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.optim.optimizer import register_optimizer_step_pre_hook

import ckpt_compat as compat
from partitioners.budget import rung_budget
from partitioners.config import MemoryBudget, warn_once
from partitioners.plan import Plan
from partitioners.rank_sync import largest_on_all_ranks
from partitioners.step import (
    Gathered, GraphCost, StepContext, gathered_per_call, predicted_step_peak, repeated_inputs, step_context,
)

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
# The rung label of the budget's own plans.
OWN = "own"
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


class _InputIdentities:
    """Names the tensors handed to a step's calls, to tell one handed to
    several calls from a fresh one each time: the same live storage, offset
    and shape get the same name; memory freed and allocated again (a block's
    input it did not save) gets a new one. Parameters are not named (never
    a batch input)."""

    def __init__(self):
        self._storages: dict[int, tuple[object, int]] = {}  # address -> (weak reference, generation)

    def of(self, value) -> tuple | None:
        if not isinstance(value, torch.Tensor) or isinstance(value, torch.nn.Parameter):
            return None
        try:
            storage = value.untyped_storage()
            address = storage.data_ptr()
        except (RuntimeError, NotImplementedError):  # a tensor without storage
            return None
        known = self._storages.get(address)
        if known is None or known[0].expired():
            known = (StorageWeakRef(storage), 0 if known is None else known[1] + 1)
            self._storages[address] = known
        return (address, known[1], value.storage_offset(), tuple(value.shape))


@dataclasses.dataclass
class _Calls:
    """The training calls of the running step, in order."""

    keys: list[str] = dataclasses.field(default_factory=list)
    inputs: list[tuple] = dataclasses.field(default_factory=list)
    """Per call, its inputs' storage identities."""
    ran: set[tuple[str, tuple]] = dataclasses.field(default_factory=set)
    """The graphs called, each with what its plan was made for."""
    below_plan: bool = False
    """A call ran below the sizes its plan was made for."""
    identities: _InputIdentities = dataclasses.field(default_factory=_InputIdentities)
    parameters: list[tuple] = dataclasses.field(default_factory=list)
    """Per call, its parameters: (weak reference, bytes)."""

    def record(self, key: str, args, planned_for: tuple, at_planned_sizes: bool) -> None:
        self.keys.append(key)
        self.inputs.append(tuple(map(self.identities.of, args)))
        self.parameters.append(tuple(
            (weakref.ref(arg), arg.numel() * arg.element_size()) for arg in args if _has_storage(arg, parameter=True)
        ))
        self.ran.add((key, planned_for))
        self.below_plan |= not at_planned_sizes


    def freed_parameters(self) -> tuple[int, ...]:
        """Per call, the bytes of its parameters whose memory is freed now,
        the step ended: parameters a sharding (FSDP) gathered for the step."""
        return tuple(
            sum(nbytes for ref, nbytes in parameters if (p := ref()) is not None and p.untyped_storage().nbytes() == 0)
            for parameters in self.parameters
        )


class _EndedStep(typing.NamedTuple):
    """A step whose backward ended, to be measured at the next call."""

    calls: _Calls
    meter: object
    wanted: bool
    end_ns: int


class StepView:
    """The graph calls of the running step, what each graph's plan costs, and
    what each was planned for. One per process: the step is the process's."""

    def __init__(self):
        self.calls = _Calls()
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
        self._meter = None
        self._judge_meter = False
        self._ending = False
        self._ended = None

    # -- what a graph is planned for ------------------------------------------

    def context_for(self, key: str, budget: MemoryBudget | None) -> tuple[StepContext | None, tuple]:
        """The step ``key`` last ran in, as its plan should see it (None: not
        seen in a finished step yet, or alone in it: plan it alone), and what
        that context depends on (``planning_for``)."""
        self.budgets[key] = budget
        planned_for = self.planning_for(key)
        if planned_for == (None, None, OWN):
            return None, planned_for
        sequence = self.last_sequence[key]
        state = self.sequences[sequence]
        fallback = None
        if state.rung != OWN:
            fallback = (
                f"runs the plans of {_rung_name(state.rung)}, not its own ({budget}): "
                f"measured step peaks {_tried_text(state.tried)}"
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
        peak cap is judged by it, and the rung of the budget's ladder."""
        sequence = self.last_sequence.get(key)
        if sequence is None:
            return (None, None, OWN)
        state = self.sequences[sequence]
        budget = self.budgets.get(key)
        correction = state.correction if budget is not None and budget.is_peak and state.measured else None
        return (sequence if len(sequence) > 1 else None, correction, state.rung)

    def record_plan(self, key: str, plan: Plan | None, measure: bool, rung: str = OWN) -> None:
        if plan is not None:
            self.plans[key] = plan
            self.costs[key] = GraphCost.of(plan.peak_estimate, plan.optimal_bytes)
            known = self.rungs.setdefault(key, {})
            for looser in plan.rungs:
                known[looser.label] = (GraphCost.of(looser.peak, plan.optimal_bytes), looser.saved)
            known[rung] = (self.costs[key], tuple(sorted(plan.saved)))
        self.measuring[key] = measure
        self.fresh.add(key)

    # -- the running step -----------------------------------------------------

    def before_call(self, key: str) -> None:
        if self.calls.keys or self._ending or compat.profiler_active():
            return
        self._judge_meter = self._wants_measurement(key)
        if self._judge_meter or self.meter_every_step:
            self._meter = _start_meter()

    def after_call(self, key: str, outputs, planned_for: tuple, at_planned_sizes: bool = True, args=()) -> None:
        """Record a training call (one whose outputs need gradients) of a plan
        made for ``planned_for``, and ask to hear when its backward ends.
        A call below the sizes its plan was made for (a shorter batch in a
        size bucket) keeps its step from correcting the model: the
        prediction is the bucket's, the measurement is not."""
        tensor = _first_requiring_grad(outputs)
        if tensor is None:
            return
        if len(self.calls.keys) >= MAX_CALLS:
            self._drop_step()
        self.calls.record(key, args, planned_for, at_planned_sizes)
        tensor.register_hook(self._on_gradient)

    def _on_gradient(self, grad):
        if not self._ending and self.calls.keys:
            self._ending = True
            compat.after_backward(self.end_step)
        return None

    def end_step(self) -> None:
        """Backward ended: the step's calls are one sequence. Its measurement
        is read at the next call (``finish_step``): the autograd engine
        restores the profiler's thread state after its callbacks, so the
        profiler cannot be stopped here; events after now are not counted."""
        self._ending = False
        calls, self.calls = self.calls, _Calls()
        if calls.keys:
            self._ended = _EndedStep(calls, self._meter, self._judge_meter, time.time_ns())
            self._meter = None

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
        state.gathered = gathered_per_call(calls.freed_parameters(), 1 / _shard_group_size())
        for key in set(sequence):
            self.last_sequence[key] = sequence
        # Whether the plans that ran were made for this step, before the
        # measurement below changes what they should be made for.
        planned_for_it = all(planned_for == self.planning_for(key) for key, planned_for in calls.ran)
        measured = _stop_meter(meter, end_ns)
        judge = wanted and not below_plan and not self.fresh & set(sequence)
        self.fresh -= set(sequence)
        if wanted and below_plan:
            state.below_plan_steps += 1
            state.settled |= state.below_plan_steps >= MAX_STEPS_BELOW_PLAN
        if measured is not None:
            measured = largest_on_all_ranks(f"step/{_sequence_id(sequence)}/{self.steps}", measured)
            if judge:
                self._judge(sequence, state, measured, planned_for_it)
            else:
                predicted = predicted_step_peak(sequence, self.costs, state.repeated, state.gathered)
                self.measurements.append(
                    Measurement(self.steps, _sequence_id(sequence), predicted, measured, False, state.rung)
                )
        self._write_report()

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
        self.measurements.append(Measurement(self.steps, _sequence_id(sequence), predicted, measured, rung=state.rung))
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
        _stop_meter(self._meter, time.time_ns())
        self._meter, self._judge_meter = None, False

    def close(self) -> None:
        """Stop measuring: a profiler left running would stay on for the
        rest of the process."""
        if self._ended is not None:
            _stop_meter(self._ended.meter, time.time_ns())
            self._ended = None
        self._drop_step()

    def _drop_step(self) -> None:
        self.calls = _Calls()
        _stop_meter(self._meter, time.time_ns())
        self._meter = None

    # -- what a reader sees ---------------------------------------------------

    @property
    def settled(self) -> bool:
        """Every kind of step seen has settled on its plans (the view will not
        re-plan them, nor try another rung): what runs now is what runs on."""
        return bool(self.sequences) and all(state.settled for state in self.sequences.values())

    def describe(self) -> str:
        """The step view as markdown: graphs, calls, predicted and measured peaks."""
        self.finish_step()
        lines = [
            "# ckpt step view",
            "",
            f"steps seen: {self.steps}; recompiles for step plans: {self.recompiles}",
            "",
            "| step | sequence | plans for | predicted MiB | measured MiB | measured / predicted | used to plan |",
            "|---|---|---|---|---|---|---|",
        ]
        for m in self.measurements:
            lines.append(
                f"| {m.step} | {m.sequence_id} | {_rung_name(m.rung)} | {m.predicted_bytes / 2**20:.2f} | "
                f"{m.measured_bytes / 2**20:.2f} | {m.ratio:.3f} | {'yes' if m.judged else 'no'} |"
            )
        for sequence, state in self.sequences.items():
            if any(g.forward for g in state.gathered):
                largest = max(g.backward for g in state.gathered)
                lines += [
                    "",
                    f"{_sequence_id(sequence)}: parameters a sharding gathers in the step (freed by its end), "
                    f"in the predictions: {sum(1 for g in state.gathered if g.forward)} of {len(sequence)} calls, "
                    f"up to {largest / 2**20:.2f} MiB around a call's backward",
                ]
            if len(state.tried) > 1 or state.rung != OWN:
                lines += [
                    "",
                    f"{_sequence_id(sequence)}: measured step peaks {_tried_text(state.tried)}; "
                    f"{'runs' if state.settled else 'trying'} the plans of {_rung_name(state.rung)}",
                ]
        lines += ["", "| graph | plan made for | saved bytes | predicted step peak MiB |", "|---|---|---|---|"]
        for key, plan in self.plans.items():
            lines.append(
                f"| {key} | {plan.step or 'the graph alone'} | {plan.saved_activation_bytes} | "
                f"{plan.estimated_peak_bytes / 2**20:.2f} |"
            )
        return "\n".join(lines) + "\n"

    def _write_report(self) -> None:
        if self.report_dir is None:
            return
        folder = pathlib.Path(self.report_dir)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "step.md").write_text(self.describe())


_view = StepView()


def _before_optimizer_step(optimizer, args, kwargs):
    # The step's backward is done: read its measurement now, before the
    # optimizer allocates (its state, on the first step) or a profiler of
    # the user's starts.
    _view.finish_step()


register_optimizer_step_pre_hook(_before_optimizer_step)


def current() -> StepView:
    """The process's step view."""
    return _view


def reset() -> StepView:
    """Forget every step seen (as ``torch._dynamo.reset()`` forgets graphs)."""
    global _view
    _view.close()
    _view = StepView()
    return _view


class PlannedGraph:
    """What the backend hands Dynamo for one graph under a budget: Inductor's
    compiled callable for the plan the step view asks for, one per size
    bucket, recompiled when the view learns more of the step."""

    def __init__(self, gm: fx.GraphModule, compile_plan, budget: MemoryBudget | None, measure: bool):
        """``compile_plan(gm, example_inputs, step, sizes, budget=, replaces=plan)``
        compiles the graph for ``budget`` and returns (callable, Plan or None)."""
        # Compiled again as it is, as Dynamo compiles a graph again for a
        # specialization (a copy made with fx.GraphModule does not pickle
        # into Inductor's cache keys).
        self._graph = gm
        self._compile_plan = compile_plan
        self._tracing_context = compat.current_tracing_context()
        self._budget = budget
        self._measure = measure
        self._symbols = compat.size_symbols(gm)
        self.key = graph_key(gm, budget)
        self._compiled: dict[tuple, object] = {}
        self._plans: dict[tuple, Plan | None] = {}
        self._planned_for: dict[tuple, tuple] = {}
        """Per size bucket, what its plan was made for (StepView.planning_for)."""

    def compile_first(self, example_inputs):
        """Compile for the sizes of Dynamo's example (inside its compile)."""
        self._first_bucket = self._bucket_of_hints()
        self._compile(self._first_bucket, example_inputs)
        return self

    def __call__(self, *args):
        # Dynamo calls a compiled graph with the arguments unpacked.
        if compat.has_fake_tensors(args):
            # A compile-time call on fake tensors (DDP's graph optimizer runs
            # each compiled bucket to get the next one's inputs): not a step.
            return self._compiled[self._first_bucket](*args)
        sizes = self._sizes_of(args)
        bucket = tuple((name, _planned_size(symbol, size)) for (name, size), symbol in zip(sizes, self._symbols))
        key = self._plan_key(bucket)
        view = current()
        view.finish_step()
        if bucket not in self._compiled or self._planned_for[bucket] != view.planning_for(key):
            view.recompiles += 1
            view.stop_measuring()
            compat.recompile_in(
                self._tracing_context,
                lambda: self._compile(bucket, compat.example_inputs_of(self._graph)),
            )
        view.before_call(key)
        outputs = self._compiled[bucket](*args)
        view.after_call(key, outputs, self._planned_for[bucket], at_planned_sizes=sizes == bucket, args=args)
        return outputs

    def _compile(self, bucket: tuple, example_inputs) -> None:
        key = self._plan_key(bucket)
        view = current()
        context, planned_for = view.context_for(key, self._budget)
        sizes = dict(bucket) if bucket else None
        compiled, plan = self._compile_plan(
            self._graph, example_inputs, context, sizes,
            budget=view.budget_for(key, self._budget), replaces=self._plans.get(bucket),
        )
        self._plans[bucket] = plan
        view.record_plan(key, plan, self._measure, rung=planned_for[2])
        self._compiled[bucket], self._planned_for[bucket] = compiled, planned_for

    def _plan_key(self, bucket: tuple) -> str:
        if not bucket:
            return self.key
        return self.key + "@" + ",".join(f"{name}={size}" for name, size in bucket)

    def _bucket_of_hints(self) -> tuple:
        return tuple((s.name, _planned_size(s, s.hint)) for s in self._symbols)

    def _sizes_of(self, args) -> tuple:
        """The dynamic sizes of this call, by symbol name."""
        sizes = []
        for symbol in self._symbols:
            value = args[symbol.placeholder]
            sizes.append((symbol.name, int(value) if symbol.dim is None else int(value.shape[symbol.dim])))
        return tuple(sizes)


def _rung_name(rung: str) -> str:
    if rung == OWN:
        return "its own budget"
    return "the runtime-optimal plan" if rung_budget(rung) is None else f"budget {rung}"


def _tried_text(tried: dict[str, int]) -> str:
    return ", ".join(f"{_rung_name(rung)} {nbytes / 2**20:.2f} MiB" for rung, nbytes in tried.items())


def _lowest_measured(tried: dict[str, int]) -> str:
    """The rung whose plans measured lowest; on a tie, the tightest (the
    budget's own first)."""
    order = lambda rung: -1.0 if rung == OWN else float(rung)  # noqa: E731
    return min(tried, key=lambda rung: (tried[rung], order(rung)))


def _planned_size(symbol: compat.SizeSymbol, size: int) -> int:
    """The size a plan for ``size`` is made at: the declared bound, or the
    next power of two (one plan per bucket)."""
    if symbol.upper is not None:
        return symbol.upper
    return 1 << max(size - 1, 0).bit_length()


def graph_key(gm: fx.GraphModule, budget: MemoryBudget | None) -> str:
    """A name for a Dynamo graph that is the same for the same code at the
    same input shapes, in every process and on every rank."""
    text = [gm.code, repr(budget)]
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            value = node.meta.get("example_value", node.meta.get("val"))
            if isinstance(value, torch.Tensor):
                text.append(f"{tuple(value.shape)}:{value.dtype}:{value.requires_grad}")
            else:
                text.append(type(value).__name__)
    return "g" + hashlib.sha256("\n".join(text).encode()).hexdigest()[:10]


def _has_storage(value, parameter: bool = False) -> bool:
    """``value`` is a tensor with a storage of its own (not a tensor
    subclass such as DTensor, nor a fake or meta tensor); with
    ``parameter``, an ``nn.Parameter``."""
    if not isinstance(value, torch.nn.Parameter if parameter else torch.Tensor):
        return False
    try:
        return value.device.type != "meta" and value.untyped_storage() is not None
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def _shard_group_size() -> int:
    """The ranks a gathered parameter is sharded over: the world (FSDP2 over
    one mesh dimension; a hybrid sharding's smaller group keeps more)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _sequence_id(sequence: tuple[str, ...]) -> str:
    return "s" + hashlib.sha256(" ".join(sequence).encode()).hexdigest()[:8] + f"x{len(sequence)}"


def _first_requiring_grad(outputs):
    stack = [outputs]
    while stack:
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            if value.requires_grad:
                return value
        elif isinstance(value, (list, tuple)):
            stack.extend(reversed(value))
    return None


def _start_meter():
    """Start measuring the step's peak: CUDA's counter, or on CPU the
    profiler's memory events (and no operator events: the meter is stopped
    in a later graph call than the one it starts in, see
    ``compat.start_recording_memory``)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats()
        return ("cuda", torch.cuda.memory_allocated())
    _quietly(compat.start_recording_memory)
    return ("cpu", None)


def _stop_meter(meter, end_ns: int) -> int | None:
    """The peak bytes above what was alive when ``meter`` started, up to
    ``end_ns`` (the profiler's clock is Unix time)."""
    if meter is None:
        return None
    kind, state = meter
    if kind == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - state
    recorded = _quietly(compat.stop_recording_memory)
    return None if recorded is None else compat.memory_peak(recorded, until_ns=end_ns)


def _quietly(action):
    """Run ``action`` with the process's stderr closed: the profiler's native
    code prints a line at each start and stop."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            return action()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
