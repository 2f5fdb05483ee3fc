"""Bytes and runtime estimates of joint-graph values, from FakeTensor metadata.

Deterministic: sizes come from the traced example (size hints for symbolic
shapes) and runtimes from a roofline over FLOPs and bytes moved with fixed
per-device numbers, never from timing, so every rank and every run prices alike.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

import ckpt_compat as compat

# A saved SymInt travels to backward as one int64.
SYMINT_BYTES = 8


def tensor_bytes(value: torch.Tensor) -> int:
    return compat.hint_int(value.numel()) * value.element_size()


def value_bytes(value) -> int:
    """Bytes of a traced value: tensors, tuples of them, SymInts; 0 otherwise."""
    if isinstance(value, torch.Tensor):
        return tensor_bytes(value)
    if isinstance(value, (list, tuple)):
        return sum(value_bytes(v) for v in value)
    if isinstance(value, torch.SymInt):
        return SYMINT_BYTES
    return 0


def node_bytes(node: fx.Node) -> int:
    """Bytes of the value a node produces (0 when the graph does not know)."""
    return value_bytes(node.meta.get("val"))


def is_savable_value(node: fx.Node) -> bool:
    """Whether backward can receive this node's value as a saved input.

    Tensors, SymInts and handles (process groups and other opaque objects,
    BackwardState) can be saved; tuples cannot (their elements are saved
    through getitem nodes), nor can SymFloats and other Python objects.
    """
    value = node.meta.get("val")
    return (
        isinstance(value, (torch.Tensor, torch.SymInt, compat.BackwardState))
        or compat.is_opaque_node(node)
    )


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    """Sustained throughputs a roofline estimate divides by."""

    flops_per_s: float
    """Dense matmul FLOP/s at 16-bit precision."""
    fp32_flops_per_s: float
    """Dense matmul FLOP/s at 32-bit precision (TF32 off)."""
    bytes_per_s: float
    """Memory bandwidth."""


# Datasheet peaks: H100 SXM 989 TFLOP/s bf16 dense, 67 TFLOP/s fp32, 3.35 TB/s;
# H200 has the same compute and 4.8 TB/s. The CPU row is this project's
# 2-core CI machine, measured once with torch.mm and a large copy (about
# 100 GFLOP/s fp32, 10 GB/s); only ratios between ops matter to the solver.
DEVICE_PROFILES = {
    "cpu": DeviceProfile(flops_per_s=100e9, fp32_flops_per_s=100e9, bytes_per_s=10e9),
    "h100": DeviceProfile(flops_per_s=989e12, fp32_flops_per_s=67e12, bytes_per_s=3.35e12),
    "h200": DeviceProfile(flops_per_s=989e12, fp32_flops_per_s=67e12, bytes_per_s=4.8e12),
}


def profile_for(graph: fx.Graph, name: str | None = None) -> DeviceProfile:
    """The named profile, or the one of the device the graph's tensors live on."""
    if name is not None:
        return DEVICE_PROFILES[name]
    for node in graph.nodes:
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor):
            # CUDA graphs are priced as an H100 unless a profile is named.
            return DEVICE_PROFILES["cpu" if value.device.type == "cpu" else "h100"]
    return DEVICE_PROFILES["cpu"]


def estimate_runtime_s(node: fx.Node, profile: DeviceProfile) -> float:
    """Roofline time of one op: the larger of its FLOPs over compute speed and
    the bytes it reads and writes over bandwidth."""
    moved = node_bytes(node) + sum(node_bytes(arg) for arg in node.all_input_nodes)
    flops = _flops(node)
    value = node.meta.get("val")
    low_precision = isinstance(value, torch.Tensor) and value.element_size() <= 2
    speed = profile.flops_per_s if low_precision else profile.fp32_flops_per_s
    return max(flops / speed, moved / profile.bytes_per_s)


def _flops(node: fx.Node) -> float:
    if node.op != "call_function":
        return 0.0
    formula = compat.flop_formula(node.target)
    if formula is None:
        return _attention_flops(node)
    args, kwargs = _metadata_args(node)
    try:
        flops = formula(*args, **kwargs, out_val=node.meta.get("val"))
    except Exception:  # a formula that cannot read these arguments: price by bytes
        return 0.0
    # The traced example's value: float() of a symbolic size would add a
    # guard and recompile the graph for every new shape.
    return float(compat.hint_int(flops) if isinstance(flops, torch.SymInt) else flops)


def _attention_flops(node: fx.Node) -> float:
    """Attention kernels the FLOP registry misses (the CPU flash kernel): two
    matmuls, QK^T and PV, of 2*B*H*Sq*Sk*D each."""
    if "attention" not in str(node.target):
        return 0.0
    args, _ = _metadata_args(node)
    if len(args) < 3 or not all(isinstance(a, torch.Tensor) for a in args[:3]):
        return 0.0
    query, key, _ = args[:3]
    *batch, seq_q, dim = query.shape
    seq_k = key.shape[-2]
    batch_size = 1
    for size in batch:
        batch_size *= compat.hint_int(size)
    return 4.0 * batch_size * compat.hint_int(seq_q) * compat.hint_int(seq_k) * compat.hint_int(dim)


def _metadata_args(node: fx.Node):
    """The node's arguments with every fx.Node replaced by its traced value."""
    return fx.node.map_arg((node.args, node.kwargs), lambda arg: arg.meta.get("val"))
