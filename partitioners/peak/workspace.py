"""Per-op workspace tables: working memory an extern kernel allocates while
it runs, beyond its outputs (attention backward, oneDNN convolutions on CPU),
counted on top of the live buffers at the step the kernel runs."""
from __future__ import annotations

import math

import torch
import torch.fx as fx

import ckpt_compat as compat
from ..classify import GraphFacts
from .kinds import _contiguous_strides, _every_overload, _hinted, aten

# Attention backward kernels accumulate the query's gradient in float32 in a
# buffer of their own (FlashAttention-2's dq accumulator on CUDA). The CPU
# kernel is modelled on its own (``_cpu_attention_workspace``).
ATTENTION_BACKWARD = _every_overload(
    aten._scaled_dot_product_flash_attention_backward,
    aten._scaled_dot_product_efficient_attention_backward,
    aten._scaled_dot_product_cudnn_attention_backward,
    aten._flash_attention_backward, aten._efficient_attention_backward
)
FLOAT32_BYTES = 4


# oneDNN (mkldnn) convolutions on CPU reorder the weight into a blocked
# layout of their own on every call: a weight-sized buffer while the kernel
# runs. The backward needs it for the input's gradient, and writes the
# weight's gradient in that layout before copying it out: one more.
# Measured on transformers' ResNet-18 (``python -m bench.calibrate resnet``):
# forward 54.6 MiB, predicted 46.3 without the buffer and 55.3 with it;
# backward 73.3 MiB, three 9 MiB buffers alive at layer 4 where the model
# had one.
FORWARD_CONVOLUTIONS = _every_overload(aten.convolution)
BACKWARD_CONVOLUTIONS = _every_overload(aten.convolution_backward)
CONVOLUTIONS = FORWARD_CONVOLUTIONS | BACKWARD_CONVOLUTIONS


def workspace_bytes(node: fx.Node, facts: GraphFacts) -> int:
    """Working memory an extern kernel allocates while it runs, beyond its outputs."""
    if node.target in CPU_ATTENTION_BACKWARD:
        return _cpu_attention_workspace(node)
    if node.target in ATTENTION_BACKWARD:
        query = node.args[1].meta.get("val")
        if isinstance(query, torch.Tensor):
            return compat.hint_int(query.numel()) * FLOAT32_BYTES
    if node.target in CONVOLUTIONS:
        forward = node.target in FORWARD_CONVOLUTIONS
        weight = node.args[1] if forward else node.args[2]
        value = weight.meta.get("val") if isinstance(weight, fx.Node) else None
        if isinstance(value, torch.Tensor) and value.device.type == "cpu":
            # convolution_backward's output_mask: (input, weight, bias) gradients wanted
            copies = 1 if forward else sum(bool(wanted) for wanted in node.args[10][:2])
            return copies * compat.hint_int(value.numel()) * value.element_size()
    return 0


CPU_ATTENTION_BACKWARD = _every_overload(aten._scaled_dot_product_flash_attention_for_cpu_backward)


def runs_channels_last(order: list[fx.Node]) -> bool:
    """Whether Inductor runs the convolutions of a graph that computes
    ``order`` channels-last: on CPU, a graph with a forward convolution
    (a backward graph has one where the plan recomputes a convolution).
    Then oneDNN's backward kernels take other paths than for the NCHW
    values a backward without one hands them, with other scratch: ConvNeXt's
    7x7 depthwise backward, 12.25 MiB at 256 channels (0.19 NCHW), made its
    tight plans peak 33% above the model (``python -m bench.calibrate
    convnext --budget 0.0``)."""
    return compat.inductor_runs_cpu_convolutions_channels_last(
        any(node.target in FORWARD_CONVOLUTIONS for node in order)
    )


def channels_last_workspace(node: fx.Node) -> int | None:
    """``workspace_bytes`` of a convolution's backward run channels-last on
    CPU, measured (``compat.channels_last_convolution_backward_scratch``);
    None for other kernels, or where it cannot be measured."""
    if node.target not in BACKWARD_CONVOLUTIONS:
        return None
    return compat.channels_last_convolution_backward_scratch(node)


def _cpu_attention_workspace(node: fx.Node) -> int:
    """Working memory of the CPU flash-attention backward, measured against
    aten/src/ATen/native/cpu/FlashAttentionKernel.cpp: per thread, two
    float32 blocks (attention, its gradient) of query-split x kv-split
    elements, and their reduced-precision copies for half types, which also
    accumulate the query's gradient in float32; plus a copy of the output's
    gradient unless it is laid out (batch, seq, heads, dim), as the views of
    a matmul's output are. GPT-2 (4 x 4 x 64 x 32): 32 KiB, where the
    query's size in float32 (128 KiB) was assumed before."""
    grad_out, query, key = (arg.meta.get("val") for arg in node.args[:3])
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (grad_out, query, key)):
        return 0
    q_len, kv_len = compat.hint_int(query.shape[2]), compat.hint_int(key.shape[2])
    q_split = min(q_len, 256 if q_len >= 768 else 64 if q_len >= 192 else 32)
    kv_split = min(kv_len, 512)
    reduced = query.dtype in (torch.float16, torch.bfloat16)
    per_thread = 2 * q_split * kv_split * (FLOAT32_BYTES + (query.element_size() if reduced else 0))
    # the thread count is the machine's (the same on every rank of a job)
    workspace = torch.get_num_threads() * per_thread
    if reduced:
        workspace += compat.hint_int(query.numel()) * FLOAT32_BYTES
    # is grad_out in (batch, seq, heads, dim) memory order?
    shape, strides = _hinted(grad_out.shape), _hinted(grad_out.stride())
    order = (0, 2, 1, 3)
    blhd = _contiguous_strides([shape[i] for i in order])
    if any(shape[i] > 1 and strides[i] != want for i, want in zip(order, blhd)):
        workspace += math.prod(shape) * grad_out.element_size()
    return workspace
