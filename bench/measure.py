"""Measurement helpers: saved bytes, peak memory, step time, gradient agreement."""
from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from collections.abc import Callable, Iterable

import torch
from torch.profiler import ProfilerActivity, profile

import ckpt_compat as compat


def _storage_key(tensor: torch.Tensor) -> tuple:
    if hasattr(tensor, "to_local"):  # a DTensor: its shard owns the storage
        tensor = tensor.to_local()
    storage = tensor.untyped_storage()
    return (tensor.device, storage.data_ptr())


@contextlib.contextmanager
def count_saved_bytes(exclude: Iterable[torch.Tensor] = ()):
    """Count bytes autograd saves for backward inside the block, each storage once.

    Tensors sharing a storage with ``exclude`` (parameters, inputs) are not
    counted. Yields a dict whose ``"bytes"`` and ``"tensors"`` are filled in
    as tensors are saved, and whose ``"storages"`` holds each counted
    storage's (device, address).
    """
    excluded = {_storage_key(t) for t in exclude}
    seen: set[tuple] = set()
    result = {"bytes": 0, "tensors": 0, "storages": seen}

    def pack(tensor: torch.Tensor):
        key = _storage_key(tensor)
        if key not in excluded and key not in seen:
            seen.add(key)
            result["bytes"] += tensor.untyped_storage().nbytes()
            result["tensors"] += 1
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield result


@dataclasses.dataclass(frozen=True)
class MemoryEvent:
    """One allocation (``nbytes`` > 0) or free (``nbytes`` < 0) at ``ptr``."""

    time_ns: int
    ptr: int
    nbytes: int


def memory_events(prof: profile, device_type: str = "cpu") -> list[MemoryEvent]:
    """The ``[memory]`` events of a finished profile on one device type, in
    time order (ties keep the profiler's order)."""
    return [MemoryEvent(*event) for event in compat.memory_events(prof, device_type)]


def peak_of(events: list[MemoryEvent]) -> tuple[int, int]:
    """The running maximum of the live bytes over ``events`` (0 before the
    first), and the number of events replayed when it was reached."""
    live = peak = reached = 0
    for index, event in enumerate(events, start=1):
        live += event.nbytes
        if live > peak:
            peak, reached = live, index
    return peak, reached


def peak_cpu_bytes(fn: Callable[[], object]) -> int:
    """Peak bytes allocated on CPU while ``fn`` runs, above what was live before.

    Replays the profiler's ``[memory]`` events (+bytes on allocation, -bytes
    on free) in time order; the running maximum is the peak.
    """
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return peak_of(memory_events(prof))[0]


def peak_cuda_bytes(fn: Callable[[], object], device: torch.device | str = "cuda") -> int:
    """Peak CUDA bytes allocated while ``fn`` runs, above what was live before."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def _no_sync() -> None:
    pass


def time_once_s(fn: Callable[[], object], sync: Callable[[], None] = _no_sync) -> float:
    """Wall time of one call of ``fn``; ``sync`` waits for a device (e.g. CUDA)."""
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def median_time_s(fn: Callable[[], object], repeats: int, sync: Callable[[], None] = _no_sync) -> float:
    """Median wall time of ``fn`` over ``repeats`` calls."""
    return statistics.median(time_once_s(fn, sync) for _ in range(repeats))


def max_grad_diff(model: torch.nn.Module, reference: list[torch.Tensor | None]) -> float:
    """Largest absolute difference between a model's parameter gradients and
    reference gradients (inf where only one side has a gradient)."""
    return max_abs_diff([p.grad for p in model.parameters()], reference)


def max_abs_diff(grads: list[torch.Tensor | None], reference: list[torch.Tensor | None]) -> float:
    """Largest absolute difference between two gradient lists (inf where only
    one side has a gradient)."""
    diffs = [
        float("inf") if (g is None) != (r is None) else (g.float() - r.float()).abs().max().item()
        for g, r in zip(grads, reference, strict=True)
        if g is not None or r is not None
    ]
    return max(diffs, default=0.0)


