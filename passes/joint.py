"""Rewrites of the joint graph before ckpt decides what to save.

Each works in place and returns the same module: Inductor's joint graph object
stays the one that is partitioned (by ckpt, or by PyTorch on a fallback).
"""
from __future__ import annotations

import torch
import torch.fx as fx

import ckpt_compat as compat


def eliminate_dead_code(gm: fx.GraphModule) -> fx.GraphModule:
    """Removes nodes whose values nothing reads, unless they have side effects
    (FX's ``Graph.eliminate_dead_code`` by ``Node.is_impure``: mutations and
    random draws stay)."""
    if gm.graph.eliminate_dead_code():
        gm.recompile()
    return gm


def eliminate_common_subexpressions(gm: fx.GraphModule) -> fx.GraphModule:
    """Merges nodes that apply the same op to the same inputs into one, so a
    value is saved or recomputed once (torch's ``fx_graph_cse``, which leaves
    random ops, ``empty`` and values aliasing an output alone)."""
    compat.cse(gm)
    return gm


def define_ops() -> None:
    """Define ckpt's own op (``ckpt::accumulate``) once per process: when the
    first backend is made, not at import, and before a graph loaded from a
    compile cache looks it up."""
    if _ACCUMULATE_OP:
        return

    @torch.library.custom_op(_ACCUMULATE, mutates_args=())
    def accumulate(total: torch.Tensor, term: torch.Tensor) -> torch.Tensor:
        """``total + term`` as a kernel of its own, which Inductor runs where it
        stands and fuses with nothing (an op it has no lowering for)."""
        return torch.add(total, term)

    @accumulate.register_fake
    def _accumulate_shape(total: torch.Tensor, term: torch.Tensor) -> torch.Tensor:
        return torch.add(total, term)

    # A backward graph differentiated again (compiled autograd, create_graph).
    accumulate.register_autograd(lambda ctx, grad: (grad, grad))
    _ACCUMULATE_OP.append(accumulate)


_ACCUMULATE_OP: list = []


def accumulate_gradient_sums(gm: fx.GraphModule) -> fx.GraphModule:
    """Adds each backward sum into a running total as soon as it is made
    (``accumulate``), where backward adds sums up in a chain: the gradient
    of a tensor every layer reads through a broadcast, as T5's position
    bias (each layer's score gradient summed over the batch). Inductor
    computes a chain of adds inside its last reader's kernel, so every
    layer's sum stayed alive to the end of backward; eager autograd adds
    each as it comes. The sums are added in the same order, and only in
    float32 and float64, where Inductor's chain rounds each add as the op
    does (it computes half types in float32 and rounds once): the total is
    bitwise the same (``python -m bench.calibrate t5 --budget 0.0``:
    backward peak 27.83 -> 27.12 MiB)."""
    define_ops()
    backward = compat.backward_nodes(gm.graph)
    changed = False
    for add in gm.graph.nodes:
        if add in backward and _adds_two_sums(add):
            add.target = torch.ops.ckpt.accumulate.default
            changed = True
    if changed:
        gm.recompile()
    return gm


_ACCUMULATE = "ckpt::accumulate"  # matched by name: the op object changes if the module is reloaded
_EXACT_DTYPES = (torch.float32, torch.float64)


def _is_sum(node: fx.Node) -> bool:
    target = node.target
    return target is torch.ops.aten.sum.dim_IntList or (
        isinstance(target, compat.OpOverload) and target.name() == _ACCUMULATE)


def _adds_two_sums(add: fx.Node) -> bool:
    """``add(a, b)`` of two sums (or running totals) of its own shape and dtype."""
    if add.target is not torch.ops.aten.add.Tensor or len(add.args) != 2 or add.kwargs:
        return False
    value = add.meta.get("val")
    if not isinstance(value, torch.Tensor) or value.dtype not in _EXACT_DTYPES:
        return False
    return all(
        isinstance(arg, fx.Node) and _is_sum(arg) and _same_tensor_type(arg.meta.get("val"), value)
        for arg in add.args
    )


def _same_tensor_type(a, b: torch.Tensor) -> bool:
    return isinstance(a, torch.Tensor) and a.dtype == b.dtype and a.device == b.device and compat.same_sizes(a.shape, b.shape)


BEFORE_DECIDING = (eliminate_dead_code, eliminate_common_subexpressions, accumulate_gradient_sums)
"""What partitioners/partition.py runs on the joint graph, in this order."""


# Ops that run as kernels of their own (extern kernels in Inductor): a
# matmul folded past one of them holds its operands while it runs.
_HEAVY = frozenset({
    "mm", "bmm", "addmm", "baddbmm", "convolution", "convolution_backward",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
})


def unfold_late_matmul_adds(gm: fx.GraphModule) -> fx.GraphModule:
    """Writes ``add(mm(a, b), c)`` as ``sub(c, neg(mm(a, b)))`` (the same
    sum) where another heavy op runs between the mm and the add. Inductor
    folds the add into ``addmm(c, a, b)`` run at the add (torch/_inductor/
    fx_passes/post_grad.py ``addmm``), so ``a`` and ``b`` stay alive until
    ``c`` is ready: a tied weight's gradient held the 2 MiB logits gradient
    through Gemma's whole backward (``python -m bench.calibrate gemma
    --budget 0.0``). Unfolded, the mm runs where it stands and frees them.
    The add node itself becomes the sub (``refold_matmul_adds`` undoes it):
    the sum is rounded as eager rounds it, not as addmm does."""
    position = {node: i for i, node in enumerate(gm.graph.nodes)}
    heavy = [position[n] for n in gm.graph.nodes if _is_one_of(n, _HEAVY)]
    changed = False
    for add in list(gm.graph.nodes):
        if add.target is not torch.ops.aten.add.Tensor or add.kwargs.get("alpha", 1) != 1 or len(add.args) != 2:
            continue
        for matmul, other in ((add.args[1], add.args[0]), (add.args[0], add.args[1])):
            if not _late_fold(matmul, other, add, position, heavy):
                continue
            with gm.graph.inserting_before(add):
                negated = gm.graph.call_function(torch.ops.aten.neg.default, (matmul,))
            negated.meta = {**matmul.meta}
            add.meta[_UNFOLDED] = add.args
            add.target, add.args = torch.ops.aten.sub.Tensor, (other, negated)
            changed = True
            break
    if changed:
        gm.recompile()
    return gm


def refold_matmul_adds(gm: fx.GraphModule) -> fx.GraphModule:
    """Undoes ``unfold_late_matmul_adds``: the graph is again the one it was given."""
    changed = False
    for node in list(gm.graph.nodes):
        if _UNFOLDED in node.meta:
            negated = node.args[1]
            node.target, node.args = torch.ops.aten.add.Tensor, node.meta.pop(_UNFOLDED)
            gm.graph.erase_node(negated)
            changed = True
    if changed:
        gm.recompile()
    return gm


def unfolded_adds(gm: fx.GraphModule) -> list[fx.Node]:
    """The adds ``unfold_late_matmul_adds`` rewrote."""
    return [node for node in gm.graph.nodes if _UNFOLDED in node.meta]


_UNFOLDED = "ckpt_unfolded_add"  # node.meta key: the add's own args


def _is_one_of(node: fx.Node, names: frozenset) -> bool:
    """Whether ``node`` calls an op whose overload packet is named in ``names``."""
    packet = getattr(node.target, "overloadpacket", None)
    return node.op == "call_function" and getattr(packet, "__name__", None) in names


def _late_fold(matmul, other, add: fx.Node, position: dict, heavy: list[int]) -> bool:
    """Whether Inductor would fold ``matmul`` into ``add`` past a heavy op,
    holding an operand that is not a graph input (inputs are alive anyway)."""
    if not (isinstance(matmul, fx.Node) and isinstance(other, fx.Node)
            and matmul.target is torch.ops.aten.mm.default and len(matmul.users) == 1):
        return False
    if all(operand.op == "placeholder" for operand in matmul.args if isinstance(operand, fx.Node)):
        return False
    start, end = position[matmul], position[add]
    return any(start < at < end for at in heavy)


def share_matmul_copies(gm: fx.GraphModule, copied: set[fx.Node]) -> fx.GraphModule:
    """Gives each view of ``copied`` (views a matmul reads that Inductor
    would copy: ``partitioners.peak.copied_views``) one copy its matmuls
    read instead. Inductor realizes such a view's base and then copies the
    view once per matmul (``realize_input``, ``copy_input``); the copy is
    one buffer, computed from the base inside its own kernel, so the base
    needs no buffer of its own. Mamba2's chunked scan: ``G * L`` and its
    copy in forward, the recomputed product and two copies of it in
    backward, each 8 MiB. The copy carries ``_SHARED_COPY``
    (``unshare_matmul_copies`` undoes it)."""
    changed = False
    # In graph order, not the set's: node names (and so plans) are the same
    # in every process and on every rank.
    for view in [node for node in gm.graph.nodes if node in copied]:
        readers = [user for user in view.users if _is_one_of(user, _MATMULS)]
        value = view.meta.get("val")
        if not readers or not isinstance(value, torch.Tensor):
            continue
        stride = _copy_strides(value)
        if stride is None:
            continue
        with gm.graph.inserting_after(view):
            empty = gm.graph.call_function(
                torch.ops.aten.empty_strided.default, (list(value.shape), list(stride)),
                {"dtype": value.dtype, "device": value.device},
            )
        with gm.graph.inserting_after(empty):
            clone = gm.graph.call_function(torch.ops.aten.copy.default, (empty, view))
        meta = {key: item for key, item in view.meta.items() if key not in ("val", "tensor_meta")}
        empty.meta = {**meta, "val": torch.empty_strided(value.shape, stride, dtype=value.dtype, device="meta")}
        clone.meta = {**meta, "val": value.new_empty_strided(value.shape, stride), _SHARED_COPY: True}
        for reader in readers:
            reader.replace_input_with(view, clone)
        changed = True
    if changed:
        gm.recompile()
    return gm


def unshare_matmul_copies(gm: fx.GraphModule) -> fx.GraphModule:
    """Undoes ``share_matmul_copies``."""
    clones = shared_copies(gm)
    for clone in clones:
        empty, view = clone.args
        clone.replace_all_uses_with(view)
        gm.graph.erase_node(clone)
        gm.graph.erase_node(empty)
    if clones:
        gm.recompile()
    return gm


def shared_copies(gm: fx.GraphModule) -> list[fx.Node]:
    """The clones ``share_matmul_copies`` made."""
    return [node for node in gm.graph.nodes if node.meta.get(_SHARED_COPY)]


_SHARED_COPY = "ckpt_shared_copy"
_MATMULS = frozenset({"mm", "bmm"})


def _copy_strides(value: torch.Tensor) -> tuple | None:
    """Strides for the shared copy of ``value``: column-major in the last
    two dimensions, other than a matmul input's usual ones, since
    Inductor's post-grad pass drops a copy whose strides equal its input's
    as a no-op. None below two dimensions or for symbolic sizes."""
    if value.dim() < 2 or any(isinstance(size, torch.SymInt) for size in value.shape):
        return None
    *batch, rows, cols = value.shape
    return torch.empty(*batch, cols, rows, device="meta").mT.stride()
