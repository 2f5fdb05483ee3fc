"""Bytes of joint-graph values, from their FakeTensor metadata.

Deterministic: sizes come from the traced example (size hints for symbolic
shapes), never from timing, so every rank and every run prices alike.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from . import _torch_compat as compat

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
