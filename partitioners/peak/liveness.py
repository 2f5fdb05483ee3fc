"""The liveness walk: the predicted forward and backward peaks of one step
for a saved set (``estimate_step_peak``), each the peak of ``walk`` over the
phase's kernels in the order they run.
"""
from __future__ import annotations

import dataclasses

import torch.fx as fx

from ..classify import GraphFacts
from .buffers import buffer_reads, materialized
from .layouts import copy_steps, relaid_contiguous
from .lowering import LoweredGraph, lower, owner, workspace_at
from .memory_plan import _in_place_donor, _tuple_outputs, inductor_estimate, reuse_pool
from .schedule import _loop_numel, _run_ends, backward_schedule, fused_across_externs, kernel_order, mm_at_its_add
from .workspace import runs_channels_last


@dataclasses.dataclass(frozen=True)
class PeakEstimate:
    """Predicted bytes above what is live before the step."""

    forward_bytes: int
    """Peak while forward runs."""
    backward_bytes: int
    """Peak while backward runs (saved values and gradients included)."""
    held_bytes: int = 0
    """What forward leaves alive for backward: the saved values."""
    output_bytes: int = 0
    """What forward returns, beyond saved values."""
    gradient_bytes: int = 0
    """What backward returns: gradients of parameters and inputs."""
    input_gradient_bytes: int = 0
    """The part of ``gradient_bytes`` that is gradients of activations an
    earlier graph made (``GraphFacts.input_gradients``): that graph's
    backward frees them, so they do not stay for the rest of backward."""
    tangent_bytes: int = 0
    """What backward is handed: gradients of forward's outputs, returned by
    the graphs that ran after this one (counted in ``backward_bytes``)."""
    held_input_bytes: int = 0
    """Batch inputs (not parameters) saved for backward: free within this
    graph, whose caller holds them, but kept for the step when an earlier
    graph produced them (a block's input under per-block compile)."""
    held_inputs: tuple[tuple[int, int], ...] = ()
    """``held_input_bytes`` by input: (position among the graph's inputs,
    bytes). A step that hands every call of a block the same tensor (an
    attention mask) holds it once (``partitioners.step``)."""
    input_count: int = 0
    """How many inputs the graph takes (what positions are checked against)."""
    input_gradients: tuple[tuple[int, int], ...] = ()
    """``input_gradient_bytes`` by input: (position, bytes)."""

    @property
    def step_bytes(self) -> int:
        return max(self.forward_bytes, self.backward_bytes)


def estimate_step_peak(facts: GraphFacts, saved, backward_trace: list | None = None) -> PeakEstimate:
    """The predicted forward and backward peaks of one step that saves
    ``saved``; ``backward_trace`` collects the backward walk's steps (``walk``)."""
    lowered = lower(facts)
    saved = frozenset(saved)
    known = lowered.peaks.get(saved) if backward_trace is None else None
    if known is not None:
        return known
    held = facts.saved_storages(saved)
    outputs = _outputs(facts, lowered)
    forward = [n for n in facts.nodes if n in facts.forward]
    forward_peak = walk(facts, forward, kept=held | outputs, lowered=lowered)
    order = backward_schedule(facts, saved)
    tangents = {n for n in order if n.op == "placeholder" and n not in facts.inputs}
    gradients = {owner(n, facts, lowered) for n in facts.backward_outputs}
    held_inputs = _saved_batch_inputs(facts, saved)
    positions = facts.input_positions
    input_gradients = facts.input_gradients
    passed = {owner(n, facts, lowered) for n in input_gradients} - {
        owner(n, facts, lowered) for n in set(facts.backward_outputs) - input_gradients
    }
    backward_peak = walk(facts, order, kept=gradients, start=held | tangents, trace=backward_trace, lowered=lowered)
    estimate = lowered.peaks[saved] = PeakEstimate(
        forward_peak, backward_peak,
        held_bytes=sum(facts.nodes[n].nbytes for n in held),
        output_bytes=sum(facts.nodes[n].nbytes for n in outputs - held),
        gradient_bytes=sum(facts.nodes[n].nbytes for n in gradients - facts.free_inputs),
        input_gradient_bytes=sum(facts.nodes[n].nbytes for n in passed - facts.free_inputs),
        tangent_bytes=sum(facts.nodes[n].nbytes for n in tangents),
        held_input_bytes=sum(facts.nodes[n].nbytes for n in held_inputs),
        held_inputs=tuple(sorted((positions.get(n, -1), facts.nodes[n].nbytes) for n in held_inputs)),  # -1: an RNG seed
        input_count=len(positions),
        input_gradients=_gradients_by_position(facts),
    )
    return estimate


def _saved_batch_inputs(facts: GraphFacts, saved: set[fx.Node]) -> set[fx.Node]:
    roots = {facts.nodes[node].storage_root for node in saved}
    return roots & (facts.free_inputs - facts.static_inputs)


def _gradients_by_position(facts: GraphFacts) -> tuple[tuple[int, int], ...]:
    """(position, bytes) of each input gradient."""
    return tuple(sorted((position, facts.nodes[gradient].nbytes)
                        for position, gradient in facts.input_gradient_positions))


def _outputs(facts: GraphFacts, lowered: LoweredGraph) -> set[fx.Node]:
    """What forward returns (not inputs). Alive at the end of forward; not
    counted in backward, where a loss is a scalar and logits handed to a
    later graph are that graph's to hold."""
    return {owner(n, facts, lowered) for n in facts.forward_outputs} - facts.inputs


def walk(facts: GraphFacts, order: list[fx.Node], kept: set[fx.Node],
         start: set[fx.Node] = frozenset(), trace: list | None = None, *,
         lowered: LoweredGraph | None = None) -> int:
    """Peak bytes of running ``order`` with ``start`` buffers alive at the
    beginning and ``kept`` ones never freed. ``trace`` collects
    ``(node, live bytes, alive buffers, Inductor's estimate)`` per step,
    for calibration."""
    lowered = lowered or lower(facts)
    lowering = mm_at_its_add(order)  # the order Inductor lowers the graph in
    rank = {node: step for step, node in enumerate(lowering)}
    order = kernel_order(facts, lowering, lowered=lowered)
    buffers, reads, copies, kernel_local = _lowered_walk(facts, order, kept, lowered, rank)
    fused = fused_across_externs(facts, order, buffers, reads, lowered=lowered, rank=rank)
    if fused is not order:  # kernels fused across extern kernels: lower again
        order = fused
        buffers, reads, copies, kernel_local = _lowered_walk(facts, order, kept, lowered, rank)
    copied = {copy for written in copies.values() for copy in written}
    relaid = relaid_contiguous(facts, order, kept, lowered=lowered)
    last_read: dict[fx.Node, int] = {}
    read_at: dict[fx.Node, list[int]] = {}
    for step, node in enumerate(order):
        for buffer in reads.get(node, ()) if node not in copied else ():
            last_read[buffer] = step
            read_at.setdefault(buffer, []).append(step)
        for copy in copies.get(step, ()):  # a copy reads its base where it is written
            for buffer in reads[copy]:
                last_read[buffer] = max(last_read.get(buffer, step), step)
    run_end = _run_ends(order, lowered)
    frees: dict[int, list[fx.Node]] = {}
    for buffer, step in last_read.items():
        if buffer not in kept:
            frees.setdefault(run_end[step] if lowered.one_call_per_run else step, []).append(buffer)
    run_first = [0] * len(order)  # per step, the first step of its run
    for step in range(1, len(order)):
        run_first[step] = step if run_end[step - 1] == step - 1 else run_first[step - 1]
    alive = set(start) - facts.free_inputs
    live = start_bytes = sum(facts.nodes[b].nbytes for b in alive)
    curve, donations, workspace, written, freed, alive_at = [], [], [], [], [], []
    channels_last = runs_channels_last(order)
    for step, node in enumerate(order):
        new: list[fx.Node] = []
        donated = 0
        for copy in reads.get(node, set()) & facts.relaid_inputs - alive:
            alive.add(copy)  # Inductor's channels-last copy of an input
            live += facts.nodes[copy].nbytes
        if node in buffers and node not in alive and node not in copied:
            donor = _in_place_donor(node, reads.get(node, ()), step, last_read, alive, kept, relaid, facts, lowered,
                                    shared=lambda buffer: _read_by_a_sibling(buffer, step, order, read_at, run_first,
                                                                             facts, lowered))
            if donor is not None:  # the kernel writes into a buffer it reads for the last time
                alive.discard(donor)
                live -= facts.nodes[donor].nbytes
                donated += facts.nodes[donor].nbytes
            else:
                new.append(node)
            alive.add(node)
            live += facts.nodes[node].nbytes
        for output in _tuple_outputs(node, buffers) - alive:  # a kernel with several outputs
            alive.add(output)  # writes them all at once
            live += facts.nodes[output].nbytes
        for copy in copies.get(step, ()):  # a copied view, written by the step's kernel
            if copy not in alive:
                new.append(copy)
                alive.add(copy)
                live += facts.nodes[copy].nbytes
        curve.append(live)
        donations.append(donated)
        workspace.append(workspace_at(node, channels_last, lowered))
        written.append(new)
        if trace is not None:
            alive_at.append(frozenset(alive))
        gone = [b for b in frees.get(step, ()) if b in alive]
        for buffer in gone:
            alive.discard(buffer)
            live -= facts.nodes[buffer].nbytes
        freed.append(gone)
    estimate = inductor_estimate(facts, order, curve, donations, freed, kernel_local, start, run_end, lowered=lowered)
    held = reuse_pool(facts, estimate, written, freed, run_end, lowered=lowered)
    for buffer, first, last in held:
        for step in range(first, last):
            curve[step] += facts.nodes[buffer].nbytes
            if trace is not None:
                alive_at[step] |= {buffer}
    for copy, first, last in _repeated_copies(order, copies, lowered):
        for step in range(first, last + 1):
            curve[step] += facts.nodes[copy].nbytes
    running = [c + w for c, w in zip(curve, workspace)]
    if trace is not None:
        trace.extend(zip(order, running, alive_at, estimate))
    return max([start_bytes, *running])


def _repeated_copies(order: list[fx.Node], copies: dict[int, list[fx.Node]],
                     lowered: LoweredGraph) -> list[tuple[fx.Node, int, int]]:
    """``(copied view, first step, last step)`` of each copy after the first
    of a view that several extern kernels read: Inductor copies such a view
    for each (``ExternKernel.realize_input`` calls ``copy_input`` per kernel
    input, with no cache), and the scheduler fuses every copy where it
    fuses the first, so each lives from there to its own reader. Seen in
    Mamba2's chunked scan at budget 0.0: the two matmuls of ``Y_diag``'s
    backward read one view of the recomputed ``M``, and the kernel before
    the first writes two 8 MiB copies of it."""
    written_at = {copy: step for step, written in copies.items() for copy in written}
    spans, seen = [], set()
    for step, node in enumerate(order):
        if node in lowered.externs:
            for arg in node.all_input_nodes:
                if arg in written_at and written_at[arg] <= step:
                    if arg in seen:
                        spans.append((arg, written_at[arg], step))
                    seen.add(arg)
    return spans


def _read_by_a_sibling(buffer: fx.Node, step: int, order: list[fx.Node], read_at: dict, run_first: list[int],
                       facts: GraphFacts, lowered: LoweredGraph) -> bool:
    """Whether a kernel fused with ``order[step]``'s (earlier in its run,
    looping over as many elements) reads ``buffer`` and is not one the step
    depends on. Inductor counts that reader as a remaining use and does not
    overwrite ``buffer`` in place (scheduler.py ``decide_inplace_update``:
    one remaining use, ancestors excepted). Gemma's GeGLU backward: the
    gradients through the gate and through the up projection are two
    outputs of one kernel that both read the down projection's input
    gradient, and neither overwrites it."""
    node, kinds = order[step], lowered.kinds
    first = run_first[step]
    siblings = [order[s] for s in read_at.get(buffer, ()) if first <= s < step
                and _loop_numel(order[s], facts, kinds) == _loop_numel(node, facts, kinds)]
    if not siblings:
        return False
    inside = set(order[first:step])
    ancestors, stack = set(), [arg for arg in node.all_input_nodes if arg in inside]
    while stack:
        arg = stack.pop()
        if arg not in ancestors:
            ancestors.add(arg)
            stack.extend(a for a in arg.all_input_nodes if a in inside)
    return any(sibling not in ancestors for sibling in siblings)


def _lowered_walk(facts: GraphFacts, order: list[fx.Node], kept: set[fx.Node], lowered: LoweredGraph,
                  rank: dict) -> tuple:
    """What ``walk`` needs of ``order``: its buffers, what each kernel reads,
    where copied views are written, and the kernel-local values. ``rank``:
    the order Inductor lowers the nodes in."""
    kernel_local: dict[fx.Node, tuple[int, int]] = {}
    late: dict[fx.Node, int] = {}
    buffers = materialized(facts, order, kept, kernel_local, lowered=lowered, late=late, rank=rank)
    reads = buffer_reads(facts, order, buffers, lowered=lowered, late=late, rank=rank)
    return buffers, reads, copy_steps(facts, order, buffers, lowered=lowered), kernel_local
