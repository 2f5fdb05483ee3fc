"""The step meter: the peak bytes one training step allocates on its device,
from the profiler's memory events, on only while the step runs.

It starts at the step's first graph call and stops as soon as the step's
backward returns to the caller. Not earlier: the autograd engine runs the
end-of-backward callbacks under the thread state it captured when backward
began, and restores that state afterwards, so a profiler stopped inside
the engine comes back, stopped, into the thread (a user's profiler then
cannot start, and the process dies at exit). So while a meter runs,
autograd's engine object is wrapped (``_EngineWatch``): its ``run_backward``
calls the real one, and when the outermost backward of the metering thread
returns, the meter's owner is told (``on_backward_returned``), and the
wrapper is removed once no meter runs. A step that never reaches its
backward (an exception in forward) is stopped by the next graph call, by
the backend's ``close()``, or at interpreter exit.

The same events serve CUDA: the caching allocator reports each block to the
profiler, so nothing of the user's counters (``max_memory_allocated``,
``memory_stats``) is reset, and nothing synchronizes. One meter runs at a
time in the process (the profiler is the process's); another thread's step
goes unmeasured.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading

import torch
from torch.autograd import Variable

import ckpt_compat as compat

_lock = threading.Lock()
_running: "StepMeter | None" = None


class StepMeter:
    """One step's measurement on ``device``; ``on_backward_returned(finished)``
    is called on the metering thread when a backward returns to its caller
    (``finished``: False when it raised)."""

    def __init__(self, device: torch.device, on_backward_returned):
        self.device = device
        self.thread = threading.get_ident()
        self._on_backward_returned = on_backward_returned
        self._recorded = None
        self._stopped = False
        self._interrupted = False

    @classmethod
    def start(cls, device: torch.device, on_backward_returned) -> "StepMeter | None":
        """A running meter, or None where one cannot start without getting in
        someone's way: a profiler (the user's, or a meter of another thread)
        is on."""
        global _running
        with _lock:
            if _running is not None or compat.profiler_active():
                return None
            meter = cls(device, on_backward_returned)
            _stop_at_exit()
            _quietly(compat.start_recording_memory)
            _running = meter
            _EngineWatch.install()
            return meter

    def stop(self) -> None:
        """Stop before the step's end (idempotent): nothing is measured."""
        self._interrupted = self._interrupted or not self._stopped
        self._finish()

    def _finish(self) -> None:
        global _running
        with _lock:
            if self._stopped:
                return
            self._stopped = True
            if _running is self:
                _running = None
                _EngineWatch.remove()
            if threading.get_ident() == self.thread:
                self._recorded = _quietly(compat.stop_recording_memory)

    def peak(self, until_ns: int | None = None) -> int | None:
        """The peak bytes above what was alive at the start, up to
        ``until_ns`` (the profiler's clock is Unix time); None if nothing
        was recorded (the meter was stopped before the step ended, or a
        profiler of the user's replaced the recorder)."""
        self._finish()
        if self._recorded is None or self._interrupted:
            return None
        return compat.memory_peak(self._recorded, until_ns=until_ns, device=self.device)


class _EngineWatch:
    """Autograd's engine, wrapped while a meter runs: tells the meter when
    the outermost backward of its thread has returned."""

    _real = None
    _depth = threading.local()

    def __getattr__(self, name):
        return getattr(_EngineWatch._real, name)

    def run_backward(self, *args, **kwargs):
        depth = getattr(self._depth, "value", 0)
        self._depth.value, finished = depth + 1, False
        try:
            result = _EngineWatch._real.run_backward(*args, **kwargs)
            finished = True
            return result
        finally:
            self._depth.value = depth
            meter = _running
            if depth == 0 and meter is not None and meter.thread == threading.get_ident():
                meter._on_backward_returned(finished)

    @classmethod
    def install(cls) -> None:
        if cls._real is None:
            cls._real = Variable._execution_engine
            Variable._execution_engine = cls()

    @classmethod
    def remove(cls) -> None:
        if cls._real is not None:
            Variable._execution_engine = cls._real
            cls._real = None


def stop_running_meter() -> None:
    """Stop a meter left running (its step never reached backward); at exit,
    a profiler left on would crash the interpreter's shutdown."""
    meter = _running
    if meter is not None:
        meter.stop()


_exit_registered = False


def _stop_at_exit() -> None:
    """Registered with the first meter, not at import: importing ckpt
    changes nothing in the process."""
    global _exit_registered
    if not _exit_registered:
        _exit_registered = True
        atexit.register(stop_running_meter)


@contextlib.contextmanager
def quiet_native_stderr():
    """Send the process's stderr (file descriptor 2) to /dev/null inside the
    block: the profiler's native code prints a line at every start and stop
    (which would also break a progress bar)."""
    sys.stderr.flush()  # what was written before goes out before the switch
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def _quietly(action):
    with quiet_native_stderr():
        return action()
