"""The torch.compile backend: Inductor with ckpt's partitioner."""
from __future__ import annotations

import difflib
import functools
import inspect
import weakref
from collections.abc import Mapping

import torch

import ckpt_compat as compat
from partitioners.budget import resolved_budget
from partitioners.fusion_policy import compile_fx_near_fusion_in_backward
from partitioners.config import Config, ConfigError, as_config, warn_once
from partitioners.partition import CkptPartitioner, Outcome
from partitioners.pytorch_settings import with_pytorch_budgets
from partitioners.regions import FramePlace, frame_place, parameter_names, region_keys
from partitioners.plan import Plan
from .reports.report import build_report, write_report

from passes.joint import define_ops

from .planned_graph import PlannedGraph
from .step_meter import stop_running_meter
from .step_view import StepView

PARTITIONER_OPTION = "custom_partitioner_fn"
"""The Inductor option through which ckpt plugs in; ckpt sets it itself."""


class CompileTimeConfigError(ConfigError, compat.ShortenTraceback):
    """A ConfigError found while Dynamo compiles a graph: a bad ``CKPT_*``
    variable, or a torch.compile mode or option Inductor rejects.

    Dynamo re-raises this class as it is instead of wrapping it in
    BackendCompilerFailed, so the message is the first line the user reads.
    It is still a ConfigError (and a ValueError) for ``except`` clauses.
    """

    def __init__(self, message: str, first_useful_frame):
        # ValueError.__init__ takes no keywords: initialize through Dynamo's class.
        compat.ShortenTraceback.__init__(self, message, first_useful_frame=first_useful_frame)


class CkptBackend:
    """A torch.compile backend; ``plans`` lists the Plan of every graph it
    partitioned (a graph the step view planned again: the plan in force),
    and ``reports`` the report of each when ``report_dir`` is set.

    A graph served from Inductor's cache was partitioned in an earlier
    process and adds no Plan.

    Under a budget the backend owns a ``step_view`` (made at its first
    budgeted compile); ``close()`` ends it. What ckpt puts into the process
    while a view lives: a profiler recording memory events, and a wrapper
    around autograd's engine object, only while a step is being measured
    (ckpt/step_meter.py); one gloo process group under torch.distributed
    (partitioners/rank_sync.py); the ``ckpt::accumulate`` op, defined at the
    first compile.
    """

    def __init__(self, config: Config | Mapping | None = None, model: torch.nn.Module | None = None):
        self._config = None if config is None else as_config(config)
        # Held weakly: the backend must not keep a user's model alive.
        self._model = None if model is None else weakref.ref(model)
        self._names: dict[int, str] = {}
        self.plans: list[Plan] = []
        self.reports: list[dict] = []
        self._step_view: StepView | None = None

    @property
    def step_view(self) -> StepView:
        """The graphs of the training step this backend compiled, and the
        plans chosen for it (made at first use). Backends alive together
        share one view, as their graphs share one step (blocks compiled
        each with a backend of its own); a closed view is not shared."""
        if self._step_view is None:
            view = live_step_view()
            self._step_view = view if view is not None and not view.closed else _new_shared_view()
        return self._step_view

    def close(self) -> None:
        """Stop measuring and forget the steps seen (idempotent); a later
        compile starts a new view. Nothing of the view stays in the
        process; an exit without it is clean too."""
        if self._step_view is not None:
            self._step_view.close()
            self._step_view = None

    @property
    def config(self) -> Config:
        # The default backend reads the environment at each compile, so a
        # variable set after import still takes effect.
        return self._config if self._config is not None else Config.from_env()

    def __call__(self, gm, example_inputs, *, mode: str | None = None, options: Mapping | None = None):
        """Compile ``gm`` with Inductor and ckpt's partitioner.

        ``mode`` and ``options`` are torch.compile's: torch.compile passes them
        on when they are set, and they are applied as Inductor applies them.
        """
        # A compile inside a measured step: what it allocates is not the step's.
        stop_running_meter()
        # Defined at the first compile, before a graph from a compile cache
        # looks it up, not at import (the default backend is made there).
        define_ops()
        try:
            # PyTorch's own budget settings (region annotations, functorch's
            # activation_memory_budget) are honored, not dropped.
            config = with_pytorch_budgets(self.config, gm)
            # Per-module budgets match paths from the model's root, also in
            # a frame that starts inside it (graph breaks, per-block compile).
            place = self._place(config, gm, example_inputs)
            if place is not None:
                config = config.replace(module_prefix=place.prefix)
            patches = inductor_patches(mode, options)
            # Resolved once, before Inductor starts: every plan of this
            # graph (the step view's re-plans too) is for the same bytes.
            config = config.replace(memory_budget=resolved_budget(config.memory_budget, inputs_device(example_inputs)))
        except ConfigError as error:
            # Raised here, a setting error would reach the user as the second
            # line of Dynamo's BackendCompilerFailed; this class passes through.
            raise CompileTimeConfigError(str(error), inspect.currentframe()) from None
        if config.memory_budget is None or not config.step_planning:
            partitioner = self.make_partitioner(config)
            compiled = compile_fx_near_fusion_in_backward(
                gm, example_inputs,
                config_patches={**plan_settings(config.memory_budget, patches), PARTITIONER_OPTION: partitioner},
                uncached=partitioner.uuid() is None,
            )
        else:
            # A budget is the step's: plans are chosen, and re-chosen, by the step view.
            view = self.step_view
            if config.report_dir is not None:
                view.report_dir = config.report_dir
            planned = PlannedGraph(
                gm, functools.partial(self._compile_plan, config, patches), config.memory_budget,
                config.measure_steps, view, inputs_device(example_inputs),
            )
            compiled = planned.compile_first(example_inputs)
        return compiled if place is None else _checking_place(compiled, gm, config.memory_budget, place, self._names)

    def _place(self, config: Config, gm, example_inputs) -> FramePlace | None:
        """Where ``gm``'s frame sits in the model given to make_backend, when
        per-module budgets need it (None: no model, no regions, not found)."""
        model = self._model and self._model()
        if model is None or config.memory_budget is None or not config.memory_budget.regions:
            return None
        self._names = parameter_names(model)
        return frame_place(gm, example_inputs, self._names)

    def _compile_plan(self, config: Config, patches: dict, gm, example_inputs, step, sizes, budget, replaces=None):
        """Compile ``gm`` with a plan for ``budget`` in ``step`` at ``sizes``
        (the step view's choices); returns Inductor's callable and the Plan
        (None if no graph was partitioned: an inference graph). The new Plan
        takes the place of the one it ``replaces`` in ``plans``, which lists
        the plans in force."""
        before = len(self.plans)
        # step_planning: the view must see the plan, never one from a cache
        # (the runtime-optimal rung plans with no budget at all).
        partitioner = self.make_partitioner(
            config.replace(memory_budget=budget), step=step, sizes=sizes, step_planning=True,
            optimal_settings=None if budget is None else optimal_rung_settings(patches),
        )
        compiled = compile_fx_near_fusion_in_backward(
            gm, example_inputs, config_patches={**plan_settings(budget, patches), PARTITIONER_OPTION: partitioner},
            uncached=True,
        )
        if len(self.plans) == before:
            return compiled, None
        plan = self.plans[-1]
        old = next((i for i, p in enumerate(self.plans[:-1]) if p is replaces), None)
        if old is not None:
            self.plans[old] = self.plans.pop()
        return compiled, plan

    def make_partitioner(self, config: Config | None = None, *, step=None, sizes=None,
                         step_planning: bool | None = None, optimal_settings=None) -> CkptPartitioner:
        """The partitioner one compile hands Inductor: it records each graph's
        Plan here and, with ``report_dir`` set, asks for PyTorch's decisions
        too and writes the graph's report. ``step`` and ``sizes``: what the
        step view plans the graph for; ``optimal_settings``: the Inductor
        settings its runtime-optimal rung compiles with."""
        config = self.config if config is None else config
        return CkptPartitioner(
            config,
            on_outcome=functools.partial(self._record, config.report_dir),
            compare_with_pytorch=config.report_dir is not None,
            step=step,
            step_planning=(config.memory_budget is not None and config.step_planning)
            if step_planning is None else step_planning,
            sizes=sizes,
            optimal_settings=optimal_settings,
        )

    def _record(self, report_dir: str | None, outcome: Outcome) -> None:
        if report_dir is not None:
            report = write_graph_report(outcome, report_dir)
            if report is not None:
                self.reports.append(report)
        self.plans.append(outcome.plan)

    def __repr__(self) -> str:
        return f"CkptBackend({self._config!r})"


_shared_view = None
"""A weak reference to the StepView the live backends share (none is kept
alive by it: a view lives while a backend or a compiled graph holds it)."""


def live_step_view() -> StepView | None:
    """The view the live backends share, if any."""
    return _shared_view() if _shared_view is not None else None


def fresh_step_view() -> StepView:
    """Close the view the live backends share and start another, which
    backends compiling from now on share: their step is learnt from
    nothing (a benchmark's or a test's fresh start). The caller holds it."""
    view = live_step_view()
    if view is not None:
        view.close()
    return _new_shared_view()


def _new_shared_view() -> StepView:
    global _shared_view
    view = StepView()
    _shared_view = weakref.ref(view)
    return view


def write_graph_report(outcome: Outcome, folder: str) -> dict | None:
    """Write the report of one partitioned graph into ``folder`` and return it;
    a failure only warns (None): a report never costs a user their run."""
    problem = outcome.pytorch_error
    if problem is None:
        try:
            report = build_report(outcome)
            write_report(report, folder)
            return report
        except Exception as error:
            problem = f"{type(error).__name__}: {error}"
    warn_once(f"ckpt could not write its report ({problem})")
    return None


def inputs_device(example_inputs) -> torch.device | None:
    """Where the graph runs: a CUDA device if any input is on one."""
    devices = [t.device for t in example_inputs if isinstance(t, torch.Tensor)]
    return next((d for d in devices if d.type == "cuda"), devices[0] if devices else None)


BUDGET_INDUCTOR_SETTINGS = {"unroll_reductions_threshold": 1, "allow_buffer_reuse": False}
"""Inductor settings of a graph compiled under a budget. Inductor unrolls a
reduction over fewer than 8 elements into a pointwise read of its input,
which it may then inline into a consumer far later: T5's position-bias
gradient (a sum over the batch, per layer) held every layer's 4 MiB score
gradient to the end of backward (47.65 MiB at 0.0 against 27.53 without
unrolling, ``python -m bench.calibrate t5 --budget 0.0``). Inductor's
wrapper pools a freed buffer for a later one of its size: under a budget a
pooled MLP value waits through the attention backward for the next layer's
recompute (Gemma at 0.0: 18.63 MiB with reuse, 17.64 without). The peak
model reads both settings, so a plan is predicted with what runs; the
step view's runtime-optimal rung, predicted while the budget's own plan
is made but compiled without them (``plan_settings``), is predicted under
``optimal_rung_settings``."""


def plan_settings(budget, patches: dict) -> dict:
    """The Inductor settings a plan for ``budget`` compiles with: the
    budget's own (BUDGET_INDUCTOR_SETTINGS) under a budget, the user's
    ``patches`` winning; none of them with no budget, which is also how the
    step view's runtime-optimal rung compiles, so falling back to it runs
    the default plan's code (the MoE's rung peaked 512 bytes above it when
    compiled without buffer reuse)."""
    return dict(patches) if budget is None else {**BUDGET_INDUCTOR_SETTINGS, **patches}


def optimal_rung_settings(patches: dict) -> dict:
    """The values of BUDGET_INDUCTOR_SETTINGS's keys that the runtime-optimal
    rung compiles with (``plan_settings(None, patches)``): the user's, else
    Inductor's in force outside the compile."""
    return {name: patches.get(name, compat.inductor_setting(name)) for name in BUDGET_INDUCTOR_SETTINGS}


def inductor_patches(mode: str | None, options: Mapping | None) -> dict:
    """The Inductor config for torch.compile's ``mode`` and ``options``, as
    ``backend="inductor"`` would apply them: the same mode presets, option
    names and type checks. Anything Inductor rejects is a ConfigError."""
    if options is not None and not isinstance(options, Mapping):
        raise ConfigError(
            f"torch.compile(options={options!r}) is not a dict; pass Inductor option "
            "names and values, e.g. options={'max_autotune': True}"
        )
    options = dict(options or {})
    names = {key: str(key).replace("-", "_") for key in options}  # Inductor's spelling rule
    known = set(compat.inductor_option_names())
    for key, name in names.items():
        if name not in known:
            raise ConfigError(_unknown_option_message(key, name, known))
        if name == PARTITIONER_OPTION:
            raise ConfigError(
                f"torch.compile(options={{{key!r}: ...}}) cannot be combined with backend='ckpt': "
                "ckpt is the partitioner and sets it itself; use backend='inductor' for your own"
            )
    try:
        return compat.inductor_config_patches(mode, options)
    except RuntimeError as error:  # Inductor's own checks: an unknown mode, a value of the wrong type
        raise ConfigError(f"torch.compile(mode={mode!r}, options=...) with backend='ckpt': {error}") from None


def _unknown_option_message(key, name: str, known: set[str]) -> str:
    close = difflib.get_close_matches(name, sorted(known), n=3)
    hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
    return (
        f"torch.compile(options={{{key!r}: ...}}): {key!r} is not an Inductor option{hint}; "
        "torch._inductor.list_options() lists them (backend='inductor' rejects it too)"
    )


def _checking_place(compiled, gm, budget, place: FramePlace, names: dict[int, str]):
    """``compiled``, warning once when Dynamo runs it for a module at another
    place whose per-module budgets differ: Dynamo reuses one graph for
    identical blocks compiled with one backend, so ckpt planned them alike."""
    seen = {place.prefix}
    boxed = getattr(compiled, "_boxed_call", False)  # Dynamo then passes one list

    def call(*args):
        value = (args[0] if boxed else args)[place.index]
        other = place.of_call(value, names)
        if other is not None and other not in seen:
            seen.add(other)
            if region_keys(gm, budget, other) != region_keys(gm, budget, place.prefix):
                warn_once(
                    f"ckpt: one compiled graph runs for {place.prefix or 'the model'!r} and {other!r}, whose "
                    f"per-module budgets differ; it was planned for {place.prefix or 'the model'!r}. Dynamo "
                    "shares a graph between identical blocks compiled with one backend: give each such "
                    "block its own, block.compile(backend=make_backend(..., model=model))"
                )
        return compiled(*args)

    call._boxed_call = boxed
    return call


def make_backend(config: Config | Mapping | None = None, *, model: torch.nn.Module | None = None,
                 **overrides) -> CkptBackend:
    """A backend with ``config`` and field overrides.

    ``config`` is a Config, a dict of its fields (the rest keep their
    defaults), or None for ``Config.from_env()``. ``model``: the model whose
    module paths per-module budgets name; with it, a graph that starts
    inside the model (after a graph break in a submodule, or a block
    compiled alone) finds its own place (else: ``module_prefix``).

    >>> torch.compile(model, backend=make_backend(strict=True))
    """
    base = Config.from_env() if config is None else as_config(config)
    return CkptBackend(base.replace(**overrides), model=model)


ckpt_backend = CkptBackend()
"""The default backend: settings from ``CKPT_*`` environment variables."""
