"""Inductor's vocabulary, as the peak model reads it: which op categories run
inside its fused kernels, which ops always write a buffer, how it treats a
node's value (``value_kind``: none, a view, an inlinable expression, a
buffer), and the size and stride readings the other modules share.
Functions of one node: the per-graph tables built from them are
``lowering.LoweredGraph``'s.
"""
from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

import ckpt_compat as compat
from ..classify import GraphFacts
from ..ops import OpCategory

aten = torch.ops.aten


def _every_overload(*packets) -> frozenset:
    """Every overload of these aten ops (node targets are overloads)."""
    return frozenset(getattr(packet, name) for packet in packets for name in packet.overloads())


# Categories Inductor can compute inside a reader's kernel. Seeded random
# values are computed by a fused kernel too, but always into a buffer of
# their own (torch/_inductor/lowering.py inductor_random: result.realize()):
# a float32 buffer of the draws, not the boolean mask a dropout keeps.
INLINABLE = frozenset({OpCategory.POINTWISE, OpCategory.DATA_MOVEMENT, OpCategory.CONSTANT})
FUSED_BUFFER = frozenset({OpCategory.SEEDED_RANDOM})
# Categories Inductor lowers to a reduction kernel with a buffer of its own.
REDUCTIONS = frozenset({OpCategory.REDUCTION, OpCategory.SHRINKING_REDUCTION})

# What runs inside Inductor's fused kernels (the rest are extern kernels).
FUSED = INLINABLE | FUSED_BUFFER | REDUCTIONS

# Data movement Inductor lowers to a kernel writing a buffer (a scatter into
# a fresh buffer, a concatenation), not to an inlinable expression. Not
# slice_scatter and select_scatter: Inductor lowers them to a pointwise
# ``where`` over their base (torch/_inductor/lowering.py), so partial
# rotary's backward, slices scattered into zeros, is computed inside the
# kernel that reads it (GPT-NeoX).
ALWAYS_WRITTEN = _every_overload(
    aten.cat, aten.index_put, aten.scatter, aten.scatter_add, aten.embedding_dense_backward
)

# torch/_inductor/ir.py should_realize_on_reuse: ops Inductor will not repeat
# per reader on CPU. (How many buffers a reused value may read before it is
# stored, realize_reads_threshold, is Inductor's active config:
# ``LoweredGraph.realize_reads``.)
COSTLY_ON_CPU = frozenset({"exp", "log", "log10", "log1p", "log2", "sigmoid", "tanh"})


# How Inductor treats a node's value.
NONE, ALIAS, INLINE, BUFFER = "none", "alias", "inline", "buffer"


def value_kind(node: fx.Node, facts: GraphFacts, unroll: int = 8) -> str:
    """NONE (no tensor of its own: inputs, tuples, sizes), ALIAS (a view of
    another value), INLINE (an expression Inductor may compute inside its
    readers' kernels) or BUFFER (always written to memory). ``unroll``:
    Inductor's ``unroll_reductions_threshold`` (``unrolled_reduction``)."""
    node_facts = facts.nodes[node]
    if node.op == "placeholder" or node_facts.nbytes == 0 or node_facts.category is OpCategory.SYMBOLIC:
        return NONE
    if isinstance(node.meta.get("val"), (tuple, list)):
        return NONE  # its elements (getitem nodes) are the buffers
    if node_facts.category is OpCategory.VIEW:
        return ALIAS
    category = node_facts.category
    if node.target is operator.getitem:
        parent = facts.nodes[node.args[0]].category
        if parent is OpCategory.VIEW:
            return ALIAS
        category = parent
    if category in INLINABLE and node.target not in ALWAYS_WRITTEN:
        return INLINE
    if unrolled_reduction(node, facts, unroll):
        return INLINE
    return BUFFER


def unrolled_reduction(node: fx.Node, facts: GraphFacts, unroll: int) -> bool:
    """A reduction over fewer than ``unroll`` elements per output element
    (Inductor's ``unroll_reductions_threshold``, 8) into more than one
    element: Inductor lowers it as a pointwise expression that loads each
    reduced element (torch/_inductor/ir.py ``Reduction.create``), so it has
    no buffer of its own and is computed inside its readers' kernels. T5's
    relative position bias: its gradient sums each layer's score gradient
    over the batch (4), and the sums and their additions across layers are
    one kernel after the last layer's, reading every layer's softmax
    output and its gradient."""
    if facts.nodes[node].category not in REDUCTIONS or isinstance(node.meta.get("val"), (tuple, list)):
        return False
    outputs = _numel(node)
    source = max((_numel(arg) or 0 for arg in node.all_input_nodes), default=0)
    return bool(outputs and outputs > 1 and source and source // outputs < unroll)


def _owner(node: fx.Node, facts: GraphFacts, kinds: dict) -> fx.Node:
    while kinds[node] == ALIAS:
        node = node.args[0]
        if node.target is operator.getitem and kinds[node] == ALIAS:
            node = node.args[0]  # an element of a split: a view of the split's input
    return node


def _runs_extern(node: fx.Node, facts: GraphFacts, kind: str) -> bool:
    category = facts.nodes[node].category
    if node.target is operator.getitem:
        category = facts.nodes[node.args[0]].category
    if kind == NONE and node.op != "placeholder" and isinstance(node.meta.get("val"), (tuple, list)):
        return category not in FUSED and category is not OpCategory.VIEW
    return kind == BUFFER and category not in FUSED


def _op_name(node: fx.Node) -> str:
    packet = getattr(node.target, "overloadpacket", None)
    return getattr(packet, "__name__", "")


def _numel(node: fx.Node) -> int | None:
    value = node.meta.get("val")
    return compat.hint_int(value.numel()) if isinstance(value, torch.Tensor) else None


def _shape(node: fx.Node) -> list[int]:
    value = node.meta.get("val")
    if isinstance(value, (tuple, list)):
        value = value[0]
    return _hinted(value.shape) if isinstance(value, torch.Tensor) else []


def _hinted(sizes) -> list[int]:
    """Sizes or strides as ints, read through size hints: comparing symbolic
    ones would add shape guards."""
    return [compat.hint_int(size) for size in sizes]


def _eager_strided(node: fx.Node, facts: GraphFacts) -> bool:
    """A value a fused kernel writes whose eager strides are neither
    contiguous nor channels-last."""
    value = node.meta.get("val")
    if node.op == "placeholder" or facts.nodes[node].category not in FUSED or not isinstance(value, torch.Tensor):
        return False
    shape, strides = _hinted(value.shape), _hinted(value.stride())
    if math.prod(shape) <= 1 or strides == _contiguous_strides(shape):
        return False
    return len(shape) not in (4, 5) or strides != _channels_last_strides(shape)


def _contiguous_strides(shape: list[int]) -> list[int]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return strides[::-1]


def _channels_last_strides(shape: list[int]) -> list[int]:
    """Strides of (N, C, *spatial) with channels innermost."""
    inner = _contiguous_strides([shape[0], *shape[2:], shape[1]])
    return [inner[0], inner[-1], *inner[1:-1]]
