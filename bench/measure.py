"""Measurement helpers: saved bytes, peak memory, step time, gradient agreement."""
from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterable

import torch
from torch.profiler import ProfilerActivity, profile


def _storage_key(tensor: torch.Tensor) -> tuple:
    storage = tensor.untyped_storage()
    return (tensor.device, storage.data_ptr())


@contextlib.contextmanager
def count_saved_bytes(exclude: Iterable[torch.Tensor] = ()):
    """Count bytes autograd saves for backward inside the block, each storage once.

    Tensors sharing a storage with ``exclude`` (parameters, inputs) are not
    counted. Yields a dict whose ``"bytes"`` is filled in as tensors are saved.
    """
    excluded = {_storage_key(t) for t in exclude}
    seen: set[tuple] = set()
    result = {"bytes": 0, "tensors": 0}

    def pack(tensor: torch.Tensor):
        key = _storage_key(tensor)
        if key not in excluded and key not in seen:
            seen.add(key)
            result["bytes"] += tensor.untyped_storage().nbytes()
            result["tensors"] += 1
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield result


def peak_cpu_bytes(fn: Callable[[], object]) -> int:
    """Peak bytes allocated on CPU while ``fn`` runs, above what was live before.

    Replays the profiler's ``[memory]`` events (+bytes on allocation, -bytes
    on free) in time order; the running maximum is the peak.
    """
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [
        (event.start_ns(), event.nbytes())
        for event in prof.profiler.kineto_results.events()
        if event.name() == "[memory]" and event.device_type() == torch.autograd.DeviceType.CPU
    ]
    live = peak = 0
    for _, nbytes in sorted(events, key=lambda e: e[0]):
        live += nbytes
        peak = max(peak, live)
    return peak


def peak_cuda_bytes(fn: Callable[[], object], device: torch.device | str = "cuda") -> int:
    """Peak CUDA bytes allocated while ``fn`` runs, above what was live before."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def median_time_s(fn: Callable[[], object], repeats: int, sync: Callable[[], None] = lambda: None) -> float:
    """Median wall time of ``fn`` over ``repeats`` calls."""
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def max_grad_diff(model_a: torch.nn.Module, model_b: torch.nn.Module) -> float:
    """Largest absolute difference between the two models' parameter gradients."""
    diffs = [
        (a.grad - b.grad).abs().max().item()
        for a, b in zip(model_a.parameters(), model_b.parameters(), strict=True)
        if a.grad is not None or b.grad is not None
    ]
    return max(diffs, default=0.0)
