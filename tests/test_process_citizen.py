"""ckpt in someone else's process (issue: a good citizen): importing it
changes nothing; a process that compiles under a budget ends with exit 0
and the profiler off, whatever the order of compile, step, reset, new
backend, exceptions and the user's own profiler; a settled step records
nothing. Each case runs in a fresh interpreter: a crash at exit is a crash."""
import os
import pathlib
import subprocess
import sys
import textwrap

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent

PRELUDE = textwrap.dedent("""
    import torch
    from ckpt import make_backend

    def blocks(n=4, width=64):
        return torch.nn.Sequential(*[
            torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU()) for _ in range(n)])

    def profiler_on():
        return bool(torch.autograd.profiler._is_profiler_enabled) or torch._C._autograd._profiler_enabled()
""")


def _run(body: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(body)], capture_output=True, text=True,
        timeout=600, env=env, cwd=ROOT,
    )


def _assert_clean(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, (result.returncode, result.stderr[-3000:])
    assert "record_function" not in result.stderr and "callback is not found" not in result.stderr, result.stderr
    assert "PROFILER_OFF" in result.stdout, result.stdout


def test_import_changes_no_global_state():
    """``import ckpt`` and the pytest plugin import no torch; making a backend
    adds ckpt's op, and no optimizer hook at all."""
    fresh = subprocess.run(
        [sys.executable, "-c", "import sys, ckpt, ckpt.pytest_plugin; print('torch' in sys.modules)"],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT,
    )
    assert fresh.stdout.strip() == "False", fresh.stderr
    hooks = _run("""
        from torch.optim import optimizer
        before = dict(optimizer._global_optimizer_pre_hooks)
        had_op = hasattr(torch.ops.ckpt, "accumulate")
        import ckpt.backend, ckpt.step_view, ckpt.planned_graph
        assert dict(optimizer._global_optimizer_pre_hooks) == before
        assert type(torch.autograd.Variable._execution_engine) is torch._C._ImperativeEngine
        print("OP_BEFORE", had_op)
    """)
    assert hooks.returncode == 0, hooks.stderr
    assert "OP_BEFORE False" in hooks.stdout


def test_step_then_reset_then_again_exits_cleanly():
    """The issue's case: one step, ``torch._dynamo.reset()``, the same again,
    the script ends (was a segfault at exit)."""
    _assert_clean(_run("""
        def run():
            model = torch.compile(blocks(), backend=make_backend(memory_budget=0.0))
            for _ in range(3):
                model(torch.randn(8, 64)).sum().backward()
                assert not profiler_on()  # the meter stops when backward returns
        run(); torch._dynamo.reset(); run()
        print("PROFILER_OFF" if not profiler_on() else "PROFILER_ON")
    """))


def test_exceptions_interrupts_and_the_users_profiler_leave_no_trace():
    """An exception in forward and in backward (a hook), a KeyboardInterrupt
    between steps, validation under no_grad, a user's profiler around steps
    and started mid-step: the process ends cleanly with the profiler off,
    and the user's profiler records as it would."""
    _assert_clean(_run("""
        backend = make_backend(memory_budget=0.0)
        net = blocks()
        model = torch.compile(net, backend=backend)
        x = torch.randn(8, 64)
        for step in range(8):
            if step == 2:
                try:
                    model(x.reshape(4, 128))  # a wrong shape: raises inside the compiled call
                except Exception:
                    pass
            if step == 3:
                out = model(x).sum()
                out.register_hook(lambda g: (_ for _ in ()).throw(ValueError("in backward")))
                try:
                    out.backward()
                except ValueError:
                    pass
                assert not profiler_on()
                continue
            if step == 4:
                try:
                    raise KeyboardInterrupt
                except KeyboardInterrupt:
                    pass
            if step == 5:
                with torch.no_grad():
                    model(x)
            if step == 6:
                with torch.profiler.profile(profile_memory=True) as prof:
                    model(x).sum().backward()
                assert any(e.name == "[memory]" for e in prof.events()), "the user's profiler recorded nothing"
                continue
            y = model(x)
            if step == 7:
                with torch.profiler.profile() as prof:  # started mid-step, stopped before backward
                    z = y.sum()
                z.backward()
                continue
            y.sum().backward()
            assert not profiler_on()
        backend.close(); backend.close()
        print("PROFILER_OFF" if not profiler_on() else "PROFILER_ON")
    """))


def test_two_threads_each_training_a_compiled_model():
    _assert_clean(_run("""
        import threading
        errors = []
        # Compiled (one step) in this thread: Dynamo does not compile in two at once.
        models = [torch.compile(blocks(2, 32), backend=make_backend(memory_budget=0.0)) for _ in range(2)]
        for model in models:
            model(torch.randn(4, 32)).sum().backward()
        def train(model):
            try:
                for _ in range(6):
                    model(torch.randn(4, 32)).sum().backward()
            except Exception as error:
                errors.append(error)
        threads = [threading.Thread(target=train, args=(model,)) for model in models]
        [t.start() for t in threads]; [t.join() for t in threads]
        assert not errors, errors
        print("PROFILER_OFF" if not profiler_on() else "PROFILER_ON")
    """))


def test_a_settled_step_records_nothing():
    """Once the step view has settled, a call only looks up its bucket: no
    calls recorded, no hooks on its outputs; a call under no_grad neither."""
    from ckpt import make_backend
    from ckpt.backend import fresh_step_view

    torch._dynamo.reset()
    shared = fresh_step_view()  # not a view an earlier test's backends still share
    backend = make_backend(memory_budget=0.0)
    model = torch.compile(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 1)),
                          backend=backend)
    x = torch.randn(4, 16)
    for _ in range(8):
        model(x).sum().backward()
        if backend.step_view.settled_keys:
            break
    view = backend.step_view
    assert view is shared and view.settled_keys, "the view never settled"
    steps = view.steps
    out = model(x)
    assert view.calls.keys == [] and not out._backward_hooks
    out.sum().backward()
    assert view.steps == steps  # no step recorded
    backend.close()
    torch._dynamo.reset()
