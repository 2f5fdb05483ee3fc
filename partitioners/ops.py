"""The op policy table: which forward ops may be recomputed in backward.

Every node of the joint graph gets an ``OpCategory``; each category has one
``Recompute`` policy:

- ``CHEAP``: recompute when that saves bytes (pointwise, views, data movement,
  reductions whose output is not much smaller than their input).
- ``NEVER``: too expensive to recompute; save it (matmul, convolution,
  attention, shrinking reductions, ops of unknown cost). A user's explicit
  checkpoint region may still recompute these.
- ``MUST_SAVE``: recomputing would be wrong: draws from a generator's state,
  collectives, side effects and mutations. Nothing overrides this.

Random values that Inductor draws from an explicit seed (``inductor_random``
with ``inductor_lookup_seed``) are a pure function of that seed and the
element index, so they are ``CHEAP``: backward replays them bit for bit from
the saved seeds tensor (a few bytes) instead of keeping the mask. The seed
draw itself (``inductor_seeds``) advances the generator and is saved.
"""
from __future__ import annotations

import enum
import operator

import torch
import torch.fx as fx

import ckpt_compat as compat

aten = torch.ops.aten
prims = torch.ops.prims


class Recompute(enum.Enum):
    CHEAP = "cheap to recompute"
    NEVER = "never recomputed"
    MUST_SAVE = "must be saved"


class OpCategory(enum.Enum):
    # value: (label used in reasons, policy)
    INPUT = ("graph input", Recompute.MUST_SAVE)
    CONSTANT = ("constant", Recompute.CHEAP)
    SYMBOLIC = ("symbolic size arithmetic", Recompute.CHEAP)
    GETITEM = ("tuple element", Recompute.CHEAP)
    VIEW = ("view", Recompute.CHEAP)
    POINTWISE = ("pointwise", Recompute.CHEAP)
    DATA_MOVEMENT = ("data movement", Recompute.CHEAP)
    REDUCTION = ("reduction", Recompute.CHEAP)
    SHRINKING_REDUCTION = ("reduction with a much smaller output", Recompute.NEVER)
    COMPUTE = ("compute-heavy op", Recompute.NEVER)
    UNKNOWN = ("op with no policy entry", Recompute.NEVER)
    SEEDED_RANDOM = ("random op replayed from its saved seed", Recompute.CHEAP)
    RANDOM = ("random op", Recompute.MUST_SAVE)
    COLLECTIVE = ("collective", Recompute.MUST_SAVE)
    SIDE_EFFECT = ("op with side effects", Recompute.MUST_SAVE)

    @property
    def label(self) -> str:
        return self.value[0]

    @property
    def policy(self) -> Recompute:
        return self.value[1]


def _overloads(*packets) -> frozenset:
    return frozenset(
        getattr(packet, name) for packet in packets for name in packet.overloads()
    )


# Matmuls, convolutions and attention kernels: their FLOPs dominate a step,
# so recomputing them costs real time (the same list PyTorch bans).
COMPUTE_OPS = _overloads(
    aten.mm, aten.bmm, aten.addmm, aten.baddbmm, aten.addbmm, aten.matmul,
    aten.convolution, aten._convolution, aten.convolution_backward,
    aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_flash_attention_for_cpu,
    aten._scaled_dot_product_efficient_attention,
    aten._scaled_dot_product_cudnn_attention,
    aten._flash_attention_forward, aten._efficient_attention_forward,
    aten._scaled_mm, aten._int_mm, aten._weight_int4pack_mm,
    aten.upsample_bilinear2d, aten._fft_r2c, aten._fft_c2c, aten._fft_c2r,
    aten.sort, aten.topk, aten.cumsum, aten.cumprod,
)

# Reshapes that return a fresh tensor by schema but share the input's storage
# in practice: priced and recomputed as views.
VIEW_LIKE_OPS = _overloads(aten._unsafe_view)

# Ops that only move, gather, create or convert data: memory-bound, fused by
# Inductor into their users, so recomputing them costs little.
DATA_MOVEMENT_OPS = _overloads(
    aten.cat, aten.stack, aten.constant_pad_nd, aten.index, aten.index_select,
    aten.gather, aten.embedding, aten.full, aten.full_like, aten.zeros,
    aten.zeros_like, aten.ones, aten.ones_like, aten.empty, aten.empty_like,
    aten.empty_strided, aten.new_zeros, aten.new_ones, aten.new_full,
    aten.new_empty, aten.arange, aten.scalar_tensor, aten._to_copy, aten.copy,
    aten.lift_fresh_copy, aten.repeat, aten.tril, aten.triu, aten.flip,
    aten.roll, aten.masked_fill, aten.select_scatter, aten.slice_scatter,
    aten.index_put, aten.scatter, prims.iota, prims.inductor_lookup_seed,
)

# Normalizations and softmax: a reduction and pointwise work whose output is
# as large as the input, so recomputing them is one fused pass.
# _safe_softmax (a softmax whose fully masked rows are 0, not NaN) is what
# the math attention of a masked SDPA call traces to: T5's attention.
NORMALIZATION_OPS = _overloads(
    aten.native_layer_norm, aten.native_group_norm, aten._softmax, aten._safe_softmax,
    aten._log_softmax, aten._native_batch_norm_legit_functional,
    aten._native_batch_norm_legit_no_training,
)

# Inductor's random prims that read an explicit seed tensor: deterministic
# given their inputs (the seed draws, inductor_seed(s), are tagged
# nondeterministic_seeded and stay RANDOM).
SEEDED_RANDOM_OPS = frozenset({
    prims.inductor_random.default, prims.inductor_randint.default,
})

COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "c10d_functional", "_dtensor"})

# A reduction whose output is this many times smaller than its inputs is
# cheap to save and costs a full pass over the inputs to recompute (e.g. the
# mean and rstd of a LayerNorm); 4x is the point PyTorch's partitioner uses.
SHRINK_FACTOR_TO_SAVE = 4


def categorize(node: fx.Node, nbytes_of) -> OpCategory:
    """The policy category of one joint-graph node.

    ``nbytes_of(node)`` gives a node's output bytes (used to tell a shrinking
    reduction from a normalization).
    """
    if node.op == "placeholder":
        return OpCategory.INPUT
    if node.op == "get_attr":
        return OpCategory.CONSTANT
    if node.op != "call_function":
        return OpCategory.UNKNOWN
    target = node.target
    if target is operator.getitem:
        # An element of a tuple is its op's output: recomputing it means
        # re-running that op, under that op's policy.
        parent = categorize(node.args[0], nbytes_of)
        return OpCategory.GETITEM if parent.policy is Recompute.CHEAP else parent
    if compat.is_with_effects(node):
        return OpCategory.SIDE_EFFECT
    if not isinstance(target, compat.OpOverload):
        if compat.is_sym_node(node):
            return OpCategory.SYMBOLIC
        return OpCategory.UNKNOWN  # higher-order ops and Python callables
    if target.namespace in COLLECTIVE_NAMESPACES:
        return OpCategory.COLLECTIVE
    if target._schema.is_mutable:
        return OpCategory.SIDE_EFFECT
    if target in SEEDED_RANDOM_OPS:
        return OpCategory.SEEDED_RANDOM
    if _draws_random(node):
        return OpCategory.RANDOM
    if target.namespace not in ("aten", "prims"):
        return OpCategory.UNKNOWN
    if compat.is_sym_node(node):
        return OpCategory.SYMBOLIC
    if target in COMPUTE_OPS:
        return OpCategory.COMPUTE
    if is_view_op(target) or target in VIEW_LIKE_OPS:
        return OpCategory.VIEW
    if torch.Tag.pointwise in target.tags:
        return OpCategory.POINTWISE
    if target in DATA_MOVEMENT_OPS:
        return OpCategory.DATA_MOVEMENT
    if target in NORMALIZATION_OPS or torch.Tag.reduction in target.tags:
        return _reduction_category(node, nbytes_of)
    return OpCategory.UNKNOWN


def is_view_op(target) -> bool:
    """An op whose output aliases an input without mutating it (view, permute, ...)."""
    schema = getattr(target, "_schema", None)
    return (
        schema is not None
        and not schema.is_mutable
        and any(r.alias_info is not None for r in schema.returns)
    )


def _draws_random(node: fx.Node) -> bool:
    """Whether the op draws from a generator's state (so cannot be replayed)."""
    target = node.target
    if torch.Tag.nondeterministic_seeded not in target.tags:
        return False
    # Attention kernels carry the tag for their optional dropout; with
    # dropout_p == 0 they are deterministic.
    for position, argument in enumerate(target._schema.arguments):
        if argument.name == "dropout_p":
            if argument.name in node.kwargs:
                value = node.kwargs[argument.name]
            elif position < len(node.args):
                value = node.args[position]
            else:
                value = argument.default_value
            return value != 0
    return True


def _reduction_category(node: fx.Node, nbytes_of) -> OpCategory:
    input_bytes = sum(nbytes_of(arg) for arg in node.all_input_nodes)
    if nbytes_of(node) * SHRINK_FACTOR_TO_SAVE < input_bytes:
        return OpCategory.SHRINKING_REDUCTION
    return OpCategory.REDUCTION
