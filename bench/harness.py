"""Run one workload under several modes, side by side, and measure each.

Every mode gets its own deep copy of the same initial model, the same inputs,
and a ``torch._dynamo.reset()`` before it compiles. Per mode, in order:

1. memory: the first step (its wall time is the compile time), one step
   under saved_tensors_hooks (saved bytes), one under the peak meter, and
   on CPU one under the memory ledger (bench/ledger.py);
2. speed: steps with the modes interleaved, so machine drift hits all alike
   (the median is reported);
3. the largest batch whose peak fits under a cap (capsearch.py), searched
   on one more compile with the batch dimension dynamic, and the throughput
   there from a short timing.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import statistics
import time
from collections.abc import Callable

import torch

from bench.capsearch import largest_batch_under_cap
from bench.cases import Case
from bench.ledger import Ledger, measure_ledger
from bench.measure import (
    count_saved_bytes,
    max_abs_diff,
    peak_cpu_bytes,
    peak_cuda_bytes,
    time_once_s,
)
from bench.modes import Mode, Runner, build_runner, parse_mode
from ckpt.backend import fresh_step_view, live_step_view
from ckpt.step_meter import quiet_native_stderr

# compilation_time_metrics keys of dynamo_timed around the partitioner call:
# PyTorch's own, and a custom partitioner's class name (ckpt's).
PARTITIONER_TIMERS = ("min_cut_rematerialization_partition", "CkptPartitioner")


@dataclasses.dataclass
class Settings:
    device: str = "cpu"
    repeats: int = 5
    """Interleaved timed steps per mode."""
    probes: int = 3
    """Cap-search probes per mode (steps at a new batch size; the search compiles
    once per mode); 0: no search."""
    cap_repeats: int = 5
    """Timed steps at the batch found under the cap (median)."""
    cap: int | None = None
    """Bytes; None: the ``compile`` mode's peak at the default batch."""


@dataclasses.dataclass
class ModeResult:
    mode: str
    batch: int
    compile_s: float | None = None
    """Wall time of the first step, compile included."""
    partitioner_s: float | None = None
    """Time in the partitioner call (PyTorch's dynamo_timed record)."""
    solve_s: float | None = None
    """Sum of the Plans' solve_time_s, where ckpt's Plans have one."""
    saved_bytes: int | None = None
    plan_saved_bytes: int | None = None
    peak_bytes: int | None = None
    predicted_peak_bytes: int | None = None
    """ckpt's prediction of ``peak_bytes`` (its Plans' peaks, composed)."""
    step_s: float | None = None
    step_times_s: list[float] = dataclasses.field(default_factory=list)
    throughput: float | None = None
    """Units (tokens or samples) per second at the median step time."""
    max_grad_diff: float | None = None
    ledger: Ledger | None = None
    """Where the peak goes (CPU only; the bench's step runs no optimizer)."""
    fallback: str | None = None
    settle_steps: int = 0
    """Steps run after the first, before the measured ones, until ckpt's step
    view stopped re-planning (budget modes only)."""
    cap_batch: int | None = None
    cap_throughput: float | None = None
    cap_probes: list[tuple[int, int | None]] = dataclasses.field(default_factory=list)
    error: str | None = None


@dataclasses.dataclass
class CaseResult:
    name: str
    description: str
    unit: str
    batch: int
    reference: str
    cap_bytes: int | None = None
    cap_source: str = ""
    modes: list[ModeResult] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Prepared:
    """One mode, ready to step: a fresh model copy, its runner and inputs."""

    model: torch.nn.Module
    runner: Runner
    args: tuple

    def step_with(self, args: tuple) -> None:
        """One training step (forward and backward) on ``args``."""
        self.model.zero_grad(set_to_none=True)
        self.loss(args).backward()

    def loss(self, args: tuple | None = None) -> torch.Tensor:
        """The forward pass on ``args`` (default: the prepared inputs)."""
        return self.runner(*(self.args if args is None else args))

    def step(self) -> None:
        self.step_with(self.args)


def fresh_inductor_cache():
    """A new, empty Inductor cache for a run: the first compile of every mode
    is a real one (so ckpt records its plan), and no run reuses another's."""
    from torch._inductor import utils

    fresh = getattr(utils, "fresh_cache", None) or getattr(utils, "fresh_inductor_cache", None)
    return fresh() if fresh else contextlib.nullcontext()


def warm_up_compiler(device: str) -> None:
    """Compile and run a tiny function once, so that the first mode's compile
    time does not include Inductor's one-time start-up (imports, compile
    workers, header checks). Forward only: one graph is enough for that."""
    torch._dynamo.reset()
    torch.compile(lambda x: torch.nn.functional.gelu(x) * 2)(torch.randn(2, 4, device=device))
    torch._dynamo.reset()


def _sync_fn(device: str) -> Callable[[], None]:
    if device.startswith("cuda"):
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def peak_bytes(fn: Callable[[], object], device: str) -> int:
    """Peak bytes of ``fn`` on ``device``, above what was live before."""
    if device.startswith("cuda"):
        return peak_cuda_bytes(fn, device)
    with quiet_native_stderr():
        return peak_cpu_bytes(fn)


def prepare(case: Case, base: torch.nn.Module, mode: Mode, batch: int, device: str,
            dynamic_batch: bool = False) -> Prepared:
    """A fresh copy of ``base`` under ``mode``, after ``torch._dynamo.reset()``.
    ``dynamic_batch``: compile the batch dimension as symbolic, so that other
    batch sizes run without a recompile."""
    torch._dynamo.reset()
    fresh_step_view()
    model = copy.deepcopy(base).to(device)
    if mode.checkpoint_blocks:
        case.enable_checkpointing(model)
    runner = build_runner(model, mode, dynamic=None if dynamic_batch else False)
    return Prepared(model, runner, _inputs(case, batch, device, dynamic_batch))


def _inputs(case: Case, batch: int, device: str, dynamic_batch: bool = False) -> tuple:
    args = tuple(t.to(device) for t in case.inputs(batch))
    if dynamic_batch:
        for t in args:  # every input's first dimension is the batch
            torch._dynamo.maybe_mark_dynamic(t, 0)
    return args


def _partitioner_seconds() -> float | None:
    from torch._dynamo.utils import compilation_time_metrics  # cleared by torch._dynamo.reset()

    times = [t for key in PARTITIONER_TIMERS for t in compilation_time_metrics.get(key, [])]
    return sum(times) if times else None


def _plans_sum(plans: list, attribute: str):
    values = [getattr(plan, attribute, None) for plan in plans]
    return sum(values) if values and None not in values else None


def measure_memory(prep: Prepared, result: ModeResult, device: str) -> list[torch.Tensor | None]:
    """Fill compile time, partitioner time, saved and peak bytes; return the
    first step's gradients (seed 0)."""
    sync = _sync_fn(device)
    torch.manual_seed(0)  # every mode draws the same dropout masks as the reference
    sync()
    start = time.perf_counter()
    prep.step()  # compiles
    sync()
    result.compile_s = time.perf_counter() - start
    result.partitioner_s = _partitioner_seconds()
    grads = [None if p.grad is None else p.grad.detach().clone() for p in prep.model.parameters()]
    result.settle_steps = settle(prep)

    result.saved_bytes = saved_bytes_of_step(prep)
    # Free the gradients first: the peak counts from parameters and inputs alone.
    prep.model.zero_grad(set_to_none=True)
    result.peak_bytes = peak_bytes(prep.step, device)
    # Read after the steps: with a budget, the step view plans the graphs
    # again after the first step, and the plans in force are the measured ones.
    plans = prep.runner.plans
    result.plan_saved_bytes, result.predicted_peak_bytes = plan_estimates(prep.runner)
    result.solve_s = _plans_sum(plans, "solve_time_s")
    result.fallback = next((p.fallback for p in plans if p.fallback), None)
    if device == "cpu":
        prep.model.zero_grad(set_to_none=True)
        result.ledger = measure_ledger(prep.model, prep.loss, inputs=prep.args)
    return grads


# At most this many steps for the step view to settle: corrections and the
# looser budgets it may try take two steps each (ckpt/step_view.py).
MAX_SETTLE_STEPS = 12


def settle(prep: Prepared) -> int:
    """Step until ckpt's step view has settled on the plans it runs on, and
    return how many steps that took. A step measured while the view still
    re-plans measures plans that do not run on, and what the re-plan's
    compile inside it allocates."""
    view = live_step_view()
    if view is None:  # no budgeted compile: nothing to settle
        return 0
    view.finish_step()
    steps = 0
    while view.sequences and not view.settled and steps < MAX_SETTLE_STEPS:
        prep.step()
        view.finish_step()
        steps += 1
    return steps


def plan_estimates(runner: Runner) -> tuple[int | None, int | None]:
    """ckpt's estimates for one step of ``runner``: the bytes its Plans save
    and the step peak they predict (None where unknown, or not ckpt)."""
    runs = step_plans(runner)
    saved = None if runs is None else _plans_sum(runs, "saved_activation_bytes")
    # Per-block compile runs the rest of the model (embeddings, head, loss)
    # eagerly, outside any Plan: a peak composed of the blocks' graphs alone
    # would read as the step's and be too low, so there is no prediction.
    predicted = None if runner.blocks is not None else predicted_step_peak(runner.plans_called())
    return saved, predicted


def step_plans(runner: Runner) -> list | None:
    """The Plans in the order one step runs their graphs (None when unknown):
    those the latest forward called, where it was logged.

    Otherwise: a whole-model compile runs each graph once. Blocks compiled
    one by one usually share one graph (Dynamo reuses it for every block of
    the class, the parameters being inputs): its Plan runs once per block.
    One Plan per block is one graph each; any other count (some blocks
    sharing, some not) does not say which block ran which graph.
    """
    plans = runner.plans_called()
    if runner.called or runner.blocks is None or len(plans) == runner.blocks:
        return list(plans)
    if len(plans) == 1:
        return list(plans) * runner.blocks
    return None


def predicted_step_peak(plans: list) -> int | None:
    """The step peak ckpt predicts for a model whose graphs have these Plans
    (None without a prediction for every graph).

    Graphs run forward in compile order and backward in reverse: while graph
    i runs forward, the earlier graphs hold what they saved; while it runs
    backward, the earlier graphs still hold theirs and the later ones have
    returned their parameters' gradients (the activation gradients they
    returned are read and freed by the graph before each; graph i's own
    tangents are in its backward peak): ``partitioners.step``'s rule, less
    the tensors handed to several calls, which only the step view sees.
    """
    peaks = [getattr(plan, "peak_estimate", None) for plan in plans]
    if not peaks or None in peaks:
        return None
    step = 0
    for i, peak in enumerate(peaks):
        before = sum(p.held_bytes for p in peaks[:i])
        outputs = sum(p.output_bytes for p in peaks[:i])  # the inputs of this graph
        after = sum(p.gradient_bytes - p.input_gradient_bytes for p in peaks[i + 1:])
        step = max(step, before + outputs + peak.forward_bytes, before + after + peak.backward_bytes)
    return step


def _reference_grads(case: Case, base, device: str) -> list[torch.Tensor | None]:
    prep = prepare(case, base, parse_mode(case.reference), case.batch, device)
    torch.manual_seed(0)
    prep.step()
    return [None if p.grad is None else p.grad.detach().clone() for p in prep.model.parameters()]


def _units(case: Case, batch: int) -> int:
    return batch * case.per_sample


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"


# Every compiled mode keeps its own entry in Dynamo's cache of the model's
# forward (each has a backend of its own); past Dynamo's default limit of 8
# entries, a 9th mode would run eagerly.
RECOMPILE_LIMIT = 64


def run_case(
    case: Case,
    modes: list[Mode],
    settings: Settings,
    bar=None,
    speed: bool = True,
    grads: bool = True,
) -> CaseResult:
    """Measure ``case`` under every mode. ``speed=False`` skips timing and the
    cap search (the depth sweep); ``bar`` is a tqdm bar advanced per mode."""
    with torch._dynamo.config.patch(recompile_limit=max(RECOMPILE_LIMIT, 2 * len(modes))):
        return _run_case(case, modes, settings, bar, speed, grads)


def _run_case(case: Case, modes: list[Mode], settings: Settings, bar, speed: bool, grads: bool) -> CaseResult:
    device = settings.device
    out = CaseResult(case.name, case.description, case.unit, case.batch, case.reference)
    results = {mode: ModeResult(str(mode), case.batch) for mode in modes}
    torch.manual_seed(0)
    try:
        base = case.build()
    except Exception as exc:  # e.g. an optional package that is installed but broken
        for result in results.values():
            result.error = f"building the model: {_error(exc)}"
        if bar is not None:
            bar.update(len(modes))
        out.modes = list(results.values())
        return out
    preps: dict[Mode, Prepared] = {}
    mode_grads = {}

    def status(mode, phase):
        if bar is not None:
            bar.set_postfix_str(f"{case.name} {mode} {phase}")

    for mode in modes:
        status(mode, "memory")
        try:
            prep = prepare(case, base, mode, case.batch, device)
            mode_grads[mode] = measure_memory(prep, results[mode], device)
            preps[mode] = prep
        except Exception as exc:  # one failing mode must not lose the others
            results[mode].error = _error(exc)
        if not speed and bar is not None:
            bar.update(1)

    if grads and mode_grads:
        reference = parse_mode(case.reference)
        try:
            ref = mode_grads.get(reference) or _reference_grads(case, base, device)
            for mode, g in mode_grads.items():
                results[mode].max_grad_diff = max_abs_diff(g, ref)
        except Exception as exc:
            for mode in mode_grads:
                results[mode].error = results[mode].error or f"reference {reference}: {_error(exc)}"

    if speed:
        _time_interleaved(case, preps, results, settings, status)
        out.cap_bytes, out.cap_source = _cap_phase(case, base, modes, preps, results, settings, status, bar)
    out.modes = [results[mode] for mode in modes]
    return out


def saved_bytes_of_step(prep: Prepared) -> int:
    """Bytes autograd saves in one training step of ``prep`` (its plan's
    fingerprint: another graph of the same model saves other bytes)."""
    prep.model.zero_grad(set_to_none=True)
    with count_saved_bytes(list(prep.model.parameters()) + list(prep.args)) as saved:
        loss = prep.runner(*prep.args)
    loss.backward()
    return saved["bytes"]


def _time_interleaved(case, preps, results, settings, status) -> None:
    sync = _sync_fn(settings.device)
    for mode, prep in list(preps.items()):
        # Untimed: the resets between modes dropped Dynamo's cache, so this
        # step recompiles, and Dynamo may hand the frame another mode's
        # cached graph (it did, for equal backends): the step must save
        # what the measured one saved, or its times would be another plan's.
        status(mode, "warm-up")
        try:
            timed_saved = saved_bytes_of_step(prep)
        except Exception as exc:
            results[mode].error = f"timing: {_error(exc)}"
            del preps[mode]
            continue
        if timed_saved != results[mode].saved_bytes:
            results[mode].error = (
                f"timing: the recompiled graph saves {timed_saved} bytes, not the {results[mode].saved_bytes} "
                "measured, so it is another plan; step times dropped"
            )
            del preps[mode]
    for _ in range(settings.repeats):
        for mode, prep in preps.items():  # interleaved: drift hits every mode alike
            status(mode, "timing")
            results[mode].step_times_s.append(time_once_s(prep.step, sync))
    for mode in preps:
        result = results[mode]
        if result.step_times_s:
            result.step_s = statistics.median(result.step_times_s)
            result.throughput = _units(case, case.batch) / result.step_s


def _cap_phase(case, base, modes, preps, results, settings, status, bar) -> tuple[int | None, str]:
    """The batch search of every mode that ran; returns the cap and where it came from.

    Without --cap, the cap is the ``compile`` mode's peak at the default batch
    in the graph the search itself runs (batch dimension dynamic), so that
    compile finds at least its own batch; compile is searched first."""
    cap, source = settings.cap, "--cap"
    searchable = [m for m in modes if m in preps] if settings.probes > 0 else []
    if cap is None:
        searchable.sort(key=lambda m: str(m) != "compile")  # stable: the rest keep their order
    for mode in modes:
        if mode not in searchable and bar is not None:
            bar.update(1)
    for mode in searchable:
        status(mode, "batch search")
        try:
            search = CapSearch(case, base, mode, settings)
            if cap is None and search.start_peak is not None:
                cap, source = search.start_peak, f"peak of {mode} at the default batch, batch dimension dynamic"
            if cap is not None:
                search.run(cap, results[mode])
        except Exception as exc:
            results[mode].error = f"batch search: {_error(exc)}"
        if bar is not None:
            bar.update(1)
    return cap, source if cap is not None else ""


class CapSearch:
    """One mode's search for the largest batch under a cap.

    One compile, with the batch dimension dynamic: each probe is then two
    steps, not a compile, so the search can afford a fine bisection. A mode
    under a peak budget (``ckpt+budget=peak:...``) compiles once per batch
    instead: its plan depends on the batch, and a plan made for one batch
    would not hold its peak at another."""

    def __init__(self, case: Case, base, mode: Mode, settings: Settings):
        self.case, self.settings, self.base, self.mode = case, settings, base, mode
        self.per_batch = mode.budget is not None and mode.budget.strip().lower().startswith("peak:")
        self.prep = prepare(case, base, mode, case.batch, settings.device, dynamic_batch=not self.per_batch)
        self.prep.step()  # compiles (for every batch size, unless per_batch)
        self.start_peak = self.peak_at(case.batch)

    def _prep_for(self, batch: int) -> Prepared:
        if self.per_batch and self.prep.args[0].shape[0] != batch:
            self.prep = prepare(self.case, self.base, self.mode, batch, self.settings.device)
        return self.prep

    def peak_at(self, batch: int) -> int | None:
        """Peak of one step at ``batch``; None when the device runs out of memory."""
        args = _inputs(self.case, batch, self.settings.device)
        try:
            prep = self._prep_for(batch)
            prep.step_with(args)  # warm (and compiles, per batch): a size's first step may allocate differently
            prep.model.zero_grad(set_to_none=True)
            return peak_bytes(lambda: prep.step_with(args), self.settings.device)
        except torch.OutOfMemoryError:
            return None

    def run(self, cap: int, result: ModeResult) -> None:
        """Fill the largest batch under ``cap``, the probes, and the throughput there."""
        case, settings = self.case, self.settings
        best, probes = largest_batch_under_cap(self.peak_at, cap, case.batch, self.start_peak, settings.probes)
        result.cap_batch, result.cap_probes = best, [(case.batch, self.start_peak), *probes]
        if best is None:
            return
        args = _inputs(case, best, settings.device)
        sync = _sync_fn(settings.device)
        prep = self._prep_for(best)
        prep.step_with(args)
        step_s = statistics.median(
            time_once_s(lambda: prep.step_with(args), sync) for _ in range(settings.cap_repeats)
        )
        result.cap_throughput = _units(case, best) / step_s
