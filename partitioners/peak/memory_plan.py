"""Inductor's memory planner, as far as it moves the peak: its own estimate
of live bytes (``inductor_estimate``), the pool of freed buffers its wrapper
hands to later allocations of the same size (``reuse_pool``), and the
buffers a pointwise kernel overwrites in place (``_in_place_donor``).
"""
from __future__ import annotations

import operator

import torch.fx as fx

import ckpt_compat as compat

from ..classify import GraphFacts
from .kinds import ALIAS, FUSED, INLINE, _every_overload, aten
from .lowering import LoweredGraph, lower
from .schedule import _run_ends


def inductor_estimate(facts: GraphFacts, order: list[fx.Node], curve: list[int], donations: list[int],
                      freed: list[list[fx.Node]], kernel_local: dict, start: set[fx.Node],
                      run_end: list[int] | None = None, *, lowered: LoweredGraph | None = None) -> list[int]:
    """Live bytes per step as Inductor's own estimate sees them
    (torch/_inductor/memory.py ``estimate_peak_memory``), by which its reuse
    pool decides. It runs on fused kernels before in-place and kernel-local
    decisions, so, unlike ``curve``: a run of fused steps allocates all its
    outputs before it frees any input; an in-place output counts on top of
    the buffer it overwrites (``donations``); a kernel-local value counts
    through its run. It does not see the graph's inputs (tangents, primals:
    utils.is_nonfreeable_buffers). GPT-2 at 0.0: the GELU backward kernel
    writes three 0.5 MiB buffers at once, one of them a kernel-local tanh;
    Inductor's estimate peaks there and lets the fc's buffer wait in the
    pool through the attention backward. ``run_end``: ``_run_ends`` of
    ``order``, when the caller has it."""
    run_end = run_end or _run_ends(order, lowered or lower(facts))
    unseen = sum(facts.nodes[b].nbytes for b in start - facts.free_inputs if b.op == "placeholder")
    estimate, deferred = [], 0
    for step, live in enumerate(curve):
        deferred += donations[step]  # the donor counts to the end of its run too
        estimate.append(live + deferred - unseen)
        for buffer in freed[step]:
            if buffer.op == "placeholder" and buffer in start:
                unseen -= facts.nodes[buffer].nbytes  # gone from both
            else:
                deferred += facts.nodes[buffer].nbytes
        if run_end[step] == step:
            deferred = 0
    for node, (first, last) in kernel_local.items():
        for step in range(first, run_end[last] + 1):
            estimate[step] += facts.nodes[node].nbytes
    return estimate


# Extern kernels Inductor calls with an ``out=`` buffer it allocates itself
# (and so may take from its pool of freed buffers); other extern kernels
# allocate their outputs inside.
MATMULS = _every_overload(aten.mm, aten.addmm, aten.bmm, aten.baddbmm)


def reuse_pool(facts: GraphFacts, estimate: list[int], written: list[list[fx.Node]],
               freed: list[list[fx.Node]], run_end: list[int] | None = None, *,
               lowered: LoweredGraph | None = None) -> list[tuple[fx.Node, int, int]]:
    """Freed buffers Inductor keeps for a later buffer of the same size and
    dtype, as ``(buffer, first step, end step)`` spans they stay alive over.

    Inductor's wrapper (codegen/wrapper.py, ``AllocateLine.plan``) does not
    free a buffer after its last reader: it pools it, and a later allocation
    of the same key takes the most recently pooled one, holding it alive in
    between, when its own peak estimate over that span plus the buffer stays
    under the graph's estimated peak. Buffers no allocation takes are freed
    where they were last read. ``estimate`` is Inductor's estimate per step
    (``inductor_estimate``; without workspaces, which Inductor does not
    see), and its maximum Inductor's estimated peak. Measured on GPT-2 at
    budget 0.0: Inductor's estimate peaks where the fused MLP backward writes
    in place, and the MLP's buffers freed before the attention backward are
    held for the next layer's.
    """
    if not compat.inductor_setting("allow_buffer_reuse"):
        return []
    lowered = lowered or lower(facts)
    ceiling = max(estimate, default=0)
    run_end = run_end or list(range(len(estimate)))
    run_start, start = [], 0
    for step in range(len(estimate)):
        if step and run_end[step - 1] == step - 1:
            start = step
        run_start.append(start)
    extra = [0] * len(estimate)
    pool: dict[tuple, list[tuple[fx.Node, int]]] = {}
    spans = []
    for step, new in enumerate(written):
        for buffer in new:
            if not _allocated_by_inductor(buffer, facts, lowered):
                continue
            waiting = pool.get(_reuse_key(buffer, facts))
            if not waiting:
                continue
            donor, freed_at = waiting.pop()
            size = facts.nodes[buffer].nbytes
            # Inductor's check spans the kernels strictly between the one that
            # last reads the donor and the one that writes the buffer.
            between = range(run_end[freed_at] + 1, run_start[step])
            if between and max(estimate[k] + extra[k] for k in between) + size > ceiling:
                waiting.append((donor, freed_at))
                continue
            for k in between:
                extra[k] += size
            spans.append((donor, freed_at + 1, step))
        for buffer in freed[step]:
            if buffer.op != "placeholder":  # tangents and inputs are not Inductor's to reuse
                pool.setdefault(_reuse_key(buffer, facts), []).append((buffer, step))
    return spans


def _allocated_by_inductor(node: fx.Node, facts: GraphFacts, lowered: LoweredGraph) -> bool:
    copy = lowered.kinds[node] == ALIAS  # a view's copy (copied_views)
    return copy or facts.nodes[node].category in FUSED or node.target in MATMULS


def _reuse_key(node: fx.Node, facts: GraphFacts) -> tuple:
    value = node.meta.get("val")
    return facts.nodes[node].nbytes, getattr(value, "dtype", None), getattr(value, "device", None)


def _tuple_outputs(node: fx.Node, buffers: set[fx.Node]) -> set[fx.Node]:
    if not isinstance(node.meta.get("val"), (tuple, list)):
        return set()
    return {user for user in node.users if user.target is operator.getitem and user in buffers}


def _in_place_donor(node, reads, step, last_read, alive, kept, relaid, facts, lowered,
                    shared=lambda buffer: False) -> fx.Node | None:
    """A buffer a pointwise kernel may overwrite with its output: read for the
    last time by this kernel, not kept, of the same size (Inductor's in-place
    buffer reuse; in backward, saved values are donated buffers), and laid
    out as the output: Inductor overwrites a buffer only where the kernel
    reads it at the index it writes (scheduler.py ``SchedulerNode.can_inplace``:
    ``read_dep.index == write_dep.index``), which fails when one of the two
    is written contiguous where eager's strides were not (``relaid``, from
    ``relaid_contiguous``), and only where no other kernel fused with this
    one reads it too (``shared``)."""
    if lowered.kinds[node] != INLINE:
        return None
    size = facts.nodes[node].nbytes
    candidates = [
        buffer for buffer in reads
        if buffer in alive and buffer not in kept and last_read.get(buffer) == step
        and facts.nodes[buffer].nbytes == size and buffer not in facts.inputs
        and (buffer in relaid) == (node in relaid) and not shared(buffer)
    ]
    if len(candidates) < 2:
        return candidates[0] if candidates else None
    return _first_loaded(node, set(candidates), lowered)


def _first_loaded(node: fx.Node, candidates: set[fx.Node], lowered: LoweredGraph) -> fx.Node:
    """Of ``candidates``, the buffer ``node``'s kernel loads first: Inductor
    tries its reads in the order its loop body loads them, operands left to
    right through inlined values (GPT-2's GELU backward overwrites the
    gradient it multiplies, not the recomputed input)."""
    owners = lowered.owners
    stack, seen = list(reversed(node.all_input_nodes)), set()
    while stack:
        arg = stack.pop()
        if arg in seen:
            continue
        seen.add(arg)
        if owners.get(arg, arg) in candidates:
            return owners.get(arg, arg)
        stack.extend(reversed(arg.all_input_nodes))
    return min(candidates, key=lambda b: b.name)
