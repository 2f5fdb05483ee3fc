"""Layout modelling: where Inductor lays a value out otherwise than eager
did, and what that costs. A value a fused kernel writes gets a flexible
layout, frozen contiguous when an extern kernel reads a view of it
(``relaid_contiguous``); a view that is then no longer strides over its base
is copied into a buffer of its own for the extern kernel
(``copied_views``), written by the last fused kernel before it
(``copy_steps``). Eager's strides (``kinds._eager_strided``: neither
contiguous nor channels-last) are ``LoweredGraph.strided``.
"""
from __future__ import annotations

import torch
import torch.fx as fx

import ckpt_compat as compat
from ..classify import GraphFacts
from ..ops import OpCategory
from .kinds import ALIAS, FUSED, _contiguous_strides, _hinted
from .lowering import LoweredGraph, lower


def copied_views(facts: GraphFacts, order: list[fx.Node], kept: set[fx.Node], *,
                 lowered: LoweredGraph | None = None) -> set[fx.Node]:
    """Views an extern kernel of ``order`` reads that Inductor copies into a
    buffer of their own (the view node stands for the copy, alive until the
    extern kernels reading it have run).

    An extern kernel's inputs go through ``ExternKernel.realize_input``
    (torch/_inductor/ir.py; ``mm_args`` calls it for matmuls, ``process_kernel``
    for fallback kernels): a view's base is realized and the view becomes a
    ``ReinterpretView`` if ``convert_to_reinterpret_view`` can write it as
    strides over the base's layout, else ``copy_input`` writes it to a new
    buffer. A base Inductor computes in this graph and does not return gets
    a flexible layout, frozen contiguous (``freeze_layout``), not the strides
    eager gave it, so a view that merges dimensions a permute had separated
    is no longer a reinterpretation. Seen on the bench's MoE: ``silu(gate) *
    up`` has the einsum's (b, t, e, h) memory order in eager, Inductor writes
    it (b, e, t, h), and the down projection's bmm reads a second, copied
    buffer of it. Returned values keep eager's strides (GraphLowering.run_node
    requires them of outputs), and so do inputs and extern kernels' outputs.
    """
    lowered = lowered or lower(facts)
    kinds = lowered.kinds
    relaid = relaid_contiguous(facts, order, kept, lowered=lowered)
    copies = set()
    if not relaid:
        return copies
    for reader in order:
        if reader not in lowered.externs:
            continue
        for arg in reader.all_input_nodes:
            if kinds[arg] == ALIAS and arg not in copies and _view_chain(arg, facts, lowered)[-1] in relaid \
                    and not _reinterpretable(arg, facts, lowered):
                copies.add(arg)
    return copies


def copy_steps(facts: GraphFacts, order: list[fx.Node], buffers: set[fx.Node], *,
               lowered: LoweredGraph | None = None) -> dict[int, list[fx.Node]]:
    """The steps of ``order`` that write the copied views among ``buffers``.

    A copy is a pointwise node the scheduler fuses into the last fused
    kernel before the extern kernel that reads it (when there is one after
    the previous extern kernel): that kernel's inputs are still alive while
    it writes the copy. Seen in Inductor's code for the bench's MoE: in
    forward, the kernel writing ``silu(gate) * up`` writes its copy too,
    while both projections are alive; in backward, the transposed copy the
    down weight's gradient reads is written by the router's softmax
    backward kernel just before that bmm, not with its base."""
    lowered = lowered or lower(facts)
    kinds = lowered.kinds
    copies = {n for n in buffers if kinds[n] == ALIAS}
    result: dict[int, list[fx.Node]] = {}
    if not copies:
        return result
    fused_write = None
    for step, node in enumerate(order):
        kind = kinds[node]
        if node in lowered.externs:
            for arg in node.all_input_nodes:
                if arg in copies:
                    copies.discard(arg)
                    result.setdefault(step if fused_write is None else fused_write, []).append(arg)
            fused_write = None
        elif node in buffers and kind != ALIAS and facts.nodes[node].category in FUSED:
            fused_write = step
    return result


def relaid_contiguous(facts: GraphFacts, order: list[fx.Node], kept: set[fx.Node], *,
                      lowered: LoweredGraph | None = None) -> set[fx.Node]:
    """The values of ``order`` Inductor writes contiguous where eager's
    strides were not. A value a fused kernel writes gets a ``FlexibleLayout``,
    which the scheduler orders as the kernel reads its inputs
    (``ComputedBuffer.decide_layout``, ``get_fill_order``: eager's strides,
    near enough), unless it is frozen first: an extern kernel reading a view
    of it freezes it contiguous (``realize_input``, then
    ``convert_to_reinterpret_view``: ``freeze_layout``), or channels-last
    where eager's layout was. Values the graph returns are fixed to eager's
    strides before that (GraphLowering.run_node requires them of outputs:
    ``kept``); inputs, saved values and extern kernels' outputs keep eager's
    strides."""
    lowered = lowered or lower(facts)
    kinds, strided = lowered.kinds, lowered.strided
    in_order = set(order)
    relaid = set()
    for reader in order:
        if reader in lowered.externs:
            for arg in reader.all_input_nodes:
                if kinds[arg] == ALIAS:
                    base = _view_chain(arg, facts, lowered)[-1]
                    if base in strided and base in in_order and base not in kept:
                        relaid.add(base)
    return relaid


def _view_chain(node: fx.Node, facts: GraphFacts, lowered: LoweredGraph) -> list[fx.Node]:
    """``node``, the views it is a view of, and last the value they view
    (a ``split`` and its elements are views too)."""
    kinds = lowered.kinds
    chain = [node]
    while kinds[node] == ALIAS or (node.op == "call_function" and facts.nodes[node].category is OpCategory.VIEW):
        node = node.args[0]
        chain.append(node)
    return chain

def _reinterpretable(view: fx.Node, facts: GraphFacts, lowered: LoweredGraph) -> bool:
    """Whether ``view`` can be written as strides over its base laid out
    contiguous: its chain of view ops replayed on such a meta tensor, where
    ``view`` raises as ``_compute_stride`` (which Inductor's ``View.create``
    uses) finds no strides."""
    cache = lowered.reinterpretable
    if view not in cache:
        cache[view] = _replay(_view_chain(view, facts, lowered))
    return cache[view]


def _replay(chain: list[fx.Node]) -> bool:
    base = chain[-1].meta["val"]
    shape = _hinted(base.shape)
    current = torch.empty_strided(shape, _contiguous_strides(shape), dtype=base.dtype, device="meta")
    for node in reversed(chain[:-1]):
        args = [current if i == 0 else _concrete(a) for i, a in enumerate(node.args)]
        try:
            current = node.target(*args, **{k: _concrete(v) for k, v in node.kwargs.items()})
        except (RuntimeError, ValueError):  # view(): "Cannot view a tensor with shape ... and strides ..."
            return False
    return True


def _concrete(value):
    if isinstance(value, (list, tuple)):
        return type(value)(_concrete(v) for v in value)
    if isinstance(value, torch.SymInt):
        return compat.hint_int(value)
    return value
