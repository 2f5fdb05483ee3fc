"""The memory ledger of one training step: where its peak goes.

Parameters (and buffers) and the optimizer's state are alive before the
step. Gradients, saved activations and temporaries are allocated during it.
The step runs under the profiler's memory events (each with its address)
and autograd's saved-tensor hooks. At the moment of the peak, each live
allocation the step made is a gradient (its storage ends as a parameter's
``.grad``), a saved activation (a storage autograd holds for backward at
the end of forward), or a temporary: the peak minus the other two.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from ckpt.step_meter import quiet_native_stderr
from bench.measure import MemoryEvent, count_saved_bytes, memory_events, peak_of

PHASES = ("forward", "backward", "optimizer")
"""The step's phases, in order; each runs inside a profiler range named
``RANGE_PREFIX + phase``."""
RANGE_PREFIX = "ledger:"


@dataclasses.dataclass(frozen=True)
class Ledger:
    parameters_bytes: int
    """Parameters and buffers, each storage once: alive before the step."""
    optimizer_state_bytes: int | None
    """The optimizer's state tensors (AdamW: two moments and a step count per
    parameter): alive before the step. None: the step runs no optimizer."""
    gradients_bytes: int
    """Every parameter's ``.grad`` at the end of the step, each storage once."""
    saved_activations_bytes: int
    """What autograd keeps for backward (saved_tensors_hooks), each storage
    once, parameters and inputs excluded."""
    peak_bytes: int
    """The step's peak allocation above what was live before it."""
    peak_phase: str
    """The phase (one of PHASES) in which the peak was reached."""
    gradients_at_peak: int
    saved_at_peak: int
    temporaries_at_peak: int
    """``peak_bytes`` less the gradients and saved activations alive at the
    peak: recomputed activations, gradients of activations, workspaces."""

    @property
    def total_at_peak(self) -> int:
        """Everything alive at the peak, less the step's inputs."""
        return self.parameters_bytes + (self.optimizer_state_bytes or 0) + self.peak_bytes


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the storages behind ``tensors``, each storage once."""
    storages = {(t.device, t.untyped_storage().data_ptr()): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of an optimizer's state tensors (zero before its first step)."""
    return storage_bytes(
        value for state in optimizer.state.values() for value in state.values() if isinstance(value, torch.Tensor)
    )


def measure_ledger(model: torch.nn.Module, forward: Callable[[], torch.Tensor],
                   optimizer: torch.optim.Optimizer | None = None, inputs: Iterable[torch.Tensor] = ()) -> Ledger:
    """Run one training step, ``forward()`` (the loss), backward and
    ``optimizer.step()`` if given, on CPU, and return its ledger.

    The caller sets the gradients to None first, so that the step allocates
    them; ``inputs`` are excluded from the saved activations.
    """
    parameters = [*model.parameters(), *model.buffers()]
    optimizer_bytes = None if optimizer is None else optimizer_state_bytes(optimizer)
    with quiet_native_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function(RANGE_PREFIX + "forward"), count_saved_bytes([*parameters, *inputs]) as saved:
            loss = forward()
        with record_function(RANGE_PREFIX + "backward"):
            loss.backward()
        del loss
        if optimizer is not None:
            with record_function(RANGE_PREFIX + "optimizer"):
                optimizer.step()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    peak = _attribute_peak(
        memory_events(prof), _phase_ends(prof),
        saved_pointers={ptr for device, ptr in saved["storages"] if device.type == "cpu"},
        grad_pointers={g.untyped_storage().data_ptr() for g in grads},
    )
    return Ledger(
        parameters_bytes=storage_bytes(parameters),
        optimizer_state_bytes=optimizer_bytes,
        gradients_bytes=storage_bytes(grads),
        saved_activations_bytes=saved["bytes"],
        **peak,
    )


def _attribute_peak(events: list[MemoryEvent], ends: dict[str, int], saved_pointers: set[int],
                    grad_pointers: set[int]) -> dict:
    """The Ledger's peak fields: the peak, its phase, and what is alive then.
    A saved activation is an allocation alive at a saved storage's address
    when forward ends; a gradient, one alive at a gradient's at the end."""
    peak, reached = peak_of(events)
    at_peak = _live(events[:reached]).values()
    saved_ids = _ids_at(events, ends["forward"], saved_pointers)
    grad_ids = _ids_at(events, None, grad_pointers)
    saved_at_peak = sum(size for ident, size in at_peak if ident in saved_ids)
    grads_at_peak = sum(size for ident, size in at_peak if ident in grad_ids)
    peak_time = events[reached - 1].time_ns if reached else 0
    return {
        "peak_bytes": peak,
        "peak_phase": next((p for p in PHASES if p in ends and peak_time <= ends[p]), PHASES[0]),
        "gradients_at_peak": grads_at_peak,
        "saved_at_peak": saved_at_peak,
        "temporaries_at_peak": peak - grads_at_peak - saved_at_peak,
    }


def _phase_ends(prof: profile) -> dict[str, int]:
    """The end time of each phase's profiler range."""
    ends, stack = {}, list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.name.startswith(RANGE_PREFIX):
            ends[node.name.removeprefix(RANGE_PREFIX)] = node.end_time_ns
    return ends


def _live(events: list[MemoryEvent]) -> dict[int, tuple[int, int]]:
    """Address -> (allocation index, bytes) of what is live after ``events``
    (allocations made before them are not known, and not listed)."""
    live: dict[int, tuple[int, int]] = {}
    for index, event in enumerate(events):
        if event.nbytes > 0:
            live[event.ptr] = (index, event.nbytes)
        else:
            live.pop(event.ptr, None)
    return live


def _ids_at(events: list[MemoryEvent], time_ns: int | None, pointers: set[int]) -> set[int]:
    """The allocations live at ``time_ns`` (None: the end) at ``pointers``."""
    before = events if time_ns is None else [e for e in events if e.time_ns <= time_ns]
    return {ident for ptr, (ident, _) in _live(before).items() if ptr in pointers}
