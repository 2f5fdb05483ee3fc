"""The training step a graph is planned for: what the step's other compiled
graphs hold while it runs.

A step is the sequence of compiled-graph calls between two ends of backward
(forward order; a block graph compiled once may be called once per layer).
Call ``k`` of a graph keeps ``held`` bytes (its saved values) from its
forward to its backward, so while call ``k`` runs, every earlier call's held
bytes are alive, and during its backward every later call's parameter
gradients too (the activation gradient a later call hands it is its
tangent, in its own backward peak; the ones before were read and freed).
The step's predicted peak is the largest, over the calls, of

    held bytes of the earlier calls + max(own forward peak,
                                          own backward peak + later calls' parameter gradients)

(costs add over the calls; docs/budget.md). A graph planned in a step sees the other
graphs' calls as constants and its own calls through its plan: for a block
among many, a saved byte costs once per call.

Pure functions of the step's sequence and the graphs' costs: every rank that
saw the same step plans the same.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from .peak import PeakEstimate


@dataclasses.dataclass(frozen=True)
class GraphCost:
    """What one call of a graph costs the step, from its plan's peak estimate."""

    held_bytes: int
    """Kept from its forward to its backward: saved values, saved batch inputs."""
    forward_bytes: int
    backward_bytes: int
    gradient_bytes: int
    """What its backward leaves alive for the rest of backward: gradients
    of parameters, not of the activations it was handed (the graph that
    made them reads and frees them, as its tangents)."""
    optimal_bytes: int = 0
    """Saved bytes of its runtime-optimal plan (a byte budget's share)."""
    held_inputs: tuple[tuple[int, int], ...] = ()
    """The inputs among ``held_bytes``: (position, bytes)."""
    input_count: int = 0
    input_gradients: tuple[tuple[int, int], ...] = ()
    """Gradients of its inputs, not in ``gradient_bytes``: (position, bytes)."""

    def held_in(self, repeated: frozenset[int]) -> int:
        """Held bytes of a call whose inputs at ``repeated`` positions an
        earlier call of the graph was handed too (held once, then)."""
        return self.held_bytes - sum(nbytes for position, nbytes in self.held_inputs if position in repeated)

    @classmethod
    def of(cls, peak: PeakEstimate | None, optimal_bytes: int = 0) -> "GraphCost":
        if peak is None:  # a fallback plan: nothing known, the measurement corrects
            return cls(0, 0, 0, 0, optimal_bytes)
        return cls(
            peak.held_bytes + peak.held_input_bytes,
            peak.forward_bytes,
            peak.backward_bytes,
            peak.gradient_bytes - peak.input_gradient_bytes,
            optimal_bytes,
            peak.held_inputs,
            peak.input_count,
            peak.input_gradients,
        )

    def call_peak(self, later_gradients: int, gathered: "Gathered | None" = None) -> int:
        forward, backward = (gathered.forward, gathered.backward) if gathered is not None else (0, 0)
        return max(self.forward_bytes + forward, self.backward_bytes + later_gradients + backward)


@dataclasses.dataclass(frozen=True)
class Gathered:
    """Parameter bytes a call's sharding (FSDP) gathers into the step around
    it: its own while its forward runs; its own and the ones prefetched for
    the next call backward runs (the previous in forward order) while its
    backward runs. Its parameters' gradients are then scattered into
    shards: ``kept`` of their bytes stay alive for the rest of backward."""

    forward: int = 0
    backward: int = 0
    kept: float = 1.0


@dataclasses.dataclass(frozen=True)
class Moment:
    """One call of the step, as the graph being planned sees it."""

    held_before: int
    """Held bytes of the other graphs' earlier calls."""
    own_before: tuple[frozenset[int], ...]
    """This graph's earlier calls, each as the positions of its inputs an
    earlier call was handed too (each holds the plan's held bytes less those)."""
    own: bool
    """A call of this graph: its own peak adds; otherwise ``peak`` does."""
    peak: int = 0
    later_gradients: int = 0
    gathered: Gathered | None = None


@dataclasses.dataclass(frozen=True)
class StepContext:
    """What a graph's plan is judged against: the step's moments, how often
    the graph runs in it, and the measured correction of the peak model."""

    moments: tuple[Moment, ...]
    calls: int
    correction: float = 1.0
    """Measured over predicted step peak, from the first steps (1.0: not measured)."""
    measured: bool = False
    byte_share: float = 1.0
    """This graph's share of a byte budget per call: its runtime-optimal
    saved bytes over the step's (a byte budget is the step's total)."""
    fallback: str | None = None
    """Why the graph plans for a looser budget than its own: the step
    measured lower with it (ckpt/step_view.py's ladder)."""

    def step_peak(self, cost: GraphCost) -> int:
        """The step's predicted (and corrected) peak if this graph plans ``cost``."""
        peak = max(
            (
                m.held_before + sum(cost.held_in(repeated) for repeated in m.own_before)
                + (cost.call_peak(m.later_gradients, m.gathered) if m.own else m.peak)
                for m in self.moments
            ),
            default=cost.call_peak(0),
        )
        return math.ceil(peak * self.correction)

    def describe(self) -> str:
        """One line for the report."""
        text = f"{self.calls} call(s) in a step of {len(self.moments)} graph call(s)"
        if self.measured:
            text += f", peak model corrected by x{self.correction:.3f} from a measured step"
        if self.fallback:
            text += f"; {self.fallback}"
        return text


UNKNOWN_STEP = StepContext(moments=(), calls=0)
"""What the step view hands a graph under a peak: cap before its step is
known (``budget.solve_before_the_step``)."""

MAX_UNKNOWN_STEP_CALLS = 64
"""Before its step is known, a graph under a peak: cap plans for the most
calls of itself per step, up to this many, at which a plan fits the cap: a
plan alone may fit the cap and not fit beside the step's other calls
(per-block compile: one graph called once per layer), and the first step
must hold it as the later ones do. 64: more layers than the models tried."""


def repeated_step(repeats: int) -> StepContext:
    """A step of ``repeats`` calls of one graph and nothing else. A plan that
    fits it fits a step of fewer calls: the step's peak grows with them."""
    return step_context("", ("",) * repeats, {})


def step_context(
    key: str,
    sequence: Sequence[str],
    costs: Mapping[str, GraphCost],
    correction: float = 1.0,
    measured: bool = False,
    fallback: str | None = None,
    repeated: Sequence[frozenset[int]] = (),
    gathered: Sequence[Gathered] = (),
) -> StepContext:
    """The context of graph ``key`` in a step that called ``sequence``; a
    graph of unknown cost counts as nothing (the measurement corrects it).
    ``repeated`` (``repeated_inputs``) says, per call, which inputs an
    earlier call of its graph was handed too; ``gathered``
    (``gathered_per_call``), what sharding gathers around each call."""
    unknown = GraphCost(0, 0, 0, 0)
    own = costs.get(key, unknown)
    repeated = _per_call(repeated, sequence)
    gathered = _per_call(gathered, sequence, Gathered())
    later = _later_gradients(sequence, costs, repeated, gathered)
    moments, held_before, own_before = [], 0, ()
    for index, name in enumerate(sequence):
        cost = costs.get(name, unknown)
        if name == key:
            moments.append(Moment(held_before, own_before, True, later_gradients=later[index], gathered=gathered[index]))
            own_before += (repeated[index],)
        else:
            moments.append(Moment(held_before, own_before, False, peak=cost.call_peak(later[index], gathered[index])))
            held_before += cost.held_in(repeated[index])
    step_optimal = sum(costs.get(name, unknown).optimal_bytes for name in sequence)
    share = own.optimal_bytes / step_optimal if step_optimal and own.optimal_bytes else 1.0
    return StepContext(tuple(moments), len(own_before), correction, measured, share, fallback)


def predicted_step_peak(sequence: Sequence[str], costs: Mapping[str, GraphCost],
                        repeated: Sequence[frozenset[int]] = (), gathered: Sequence[Gathered] = ()) -> int:
    """The step's predicted peak with every graph at its current cost."""
    repeated = _per_call(repeated, sequence)
    gathered = _per_call(gathered, sequence, Gathered())
    later = _later_gradients(sequence, costs, repeated, gathered)
    peak = held = 0
    for index, name in enumerate(sequence):
        cost = costs.get(name)
        if cost is None:
            continue
        peak = max(peak, held + cost.call_peak(later[index], gathered[index]))
        held += cost.held_in(repeated[index])
    return peak


def repeated_inputs(sequence: Sequence[str], storages: Sequence[tuple]) -> tuple[frozenset[int], ...]:
    """Per call of ``sequence``, the positions of its inputs whose storage
    (``storages``: per call, one identity per input, None for a non-tensor)
    an earlier call of the same graph was handed at the same position: a
    mask or rotary table that every block's call saves is held once. An
    identity names one live tensor (the step view's ``_InputIdentities``
    never reuses one for memory freed and allocated again), so the result
    follows the program, the same on every rank."""
    seen: dict[tuple[str, int], set] = {}
    result = []
    for name, identities in zip(sequence, storages):
        repeated = set()
        for position, identity in enumerate(identities):
            if identity is None:
                continue
            earlier = seen.setdefault((name, position), set())
            if identity in earlier:
                repeated.add(position)
            earlier.add(identity)
        result.append(frozenset(repeated))
    return tuple(result)


def gathered_per_call(freed: Sequence[int], kept: float) -> tuple[Gathered, ...]:
    """What sharding gathers around each call of a step, from ``freed``: per
    call, the bytes of its parameters whose memory was freed by the step's
    end (FSDP's unsharded parameters; 0 for a call without). While a call's
    backward runs, FSDP2 holds its parameters, the next ones backward needs
    (prefetched: the previous call's in forward order), and the
    reduce-scatter buffers of the call whose backward ran before (input and
    output, freed at the next reduce-scatter); ``kept`` is the share of a
    gradient left after its reduce-scatter (one over the shard group's size)."""
    result = []
    for index, own in enumerate(freed):
        if not own:
            result.append(Gathered())
            continue
        prefetched = next((nbytes for nbytes in reversed(freed[:index]) if nbytes), 0)
        scattered = next((nbytes for nbytes in freed[index + 1:] if nbytes), 0)
        result.append(Gathered(own, own + prefetched + round(scattered * (1 + kept)), kept))
    return tuple(result)


def _per_call(values: Sequence, sequence: Sequence[str], default=frozenset()) -> tuple:
    return tuple(values) if len(values) == len(sequence) else (default,) * len(sequence)


def _later_gradients(sequence: Sequence[str], costs: Mapping[str, GraphCost],
                     repeated: Sequence[frozenset[int]], gathered: Sequence[Gathered]) -> list[int]:
    """Per call, the gradients the step's later calls leave alive (backward
    runs them first): their parameters', and one copy of the gradient of a
    tensor handed to several calls of a graph (an encoder's output to every
    decoder block), which autograd sums from the last of them on."""
    shared: dict[tuple[str, int], tuple[int, int]] = {}  # (graph, input) -> (last call, bytes)
    for index, name in enumerate(sequence):
        cost = costs.get(name)
        for position, nbytes in cost.input_gradients if cost is not None else ():
            if position in repeated[index] or (name, position) in shared:
                shared[(name, position)] = (index, nbytes)
    later, total = [0] * len(sequence), 0
    for index in range(len(sequence) - 1, -1, -1):
        later[index] = total + sum(nbytes for last, nbytes in shared.values() if last > index)
        cost = costs.get(sequence[index])
        if cost is not None:
            # A sharded call's parameter gradients are scattered: a shard stays.
            scattered = round(gathered[index].forward * (1 - gathered[index].kept))
            total += max(cost.gradient_bytes - scattered, 0)
    return later
