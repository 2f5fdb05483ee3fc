"""Benchmark modes: how a model runs, parsed from strings like ``ckpt+budget=0.3``.

    eager                  plain PyTorch
    eager+checkpoint       torch.utils.checkpoint around each block
    compile                torch.compile, Inductor's default partitioner
    compile+budget=F       the same under PyTorch's activation_memory_budget=F
    ckpt                   torch.compile with ckpt's backend
    ckpt+budget=B          ckpt with Config.memory_budget=B (B: 0.3, 16MiB, peak:64MiB)
    ckpt-per-block         each repeated block compiled on its own with ckpt's backend
                           (``block.compile(...)``, as torchtitan and transformers users do);
                           the rest of the model runs eagerly
    ckpt-per-block+budget=B  the same under Config.memory_budget=B, applied to each block's graph
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import torch

from partitioners.config import ConfigError, MemoryBudget

KINDS = ("eager", "eager+checkpoint", "compile", "ckpt", "ckpt-per-block")
CKPT_KINDS = ("ckpt", "ckpt-per-block")
VALID_FORMS = (
    "eager, eager+checkpoint, compile, compile+budget=F (F a fraction 0..1), "
    "ckpt, ckpt+budget=B (B a fraction 0..1, bytes such as 16MiB, 2GB, or a step peak such as peak:64MiB), "
    "ckpt-per-block, ckpt-per-block+budget=B"
)
DEFAULT_MODES = ("eager", "eager+checkpoint", "compile", "compile+budget=0.5", "ckpt", "ckpt+budget=0.5")

_NUMBER = r"(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?"
_MODE_RE = re.compile(r"(eager\+checkpoint|eager|compile|ckpt-per-block|ckpt)(?:\+budget=(.*))?")


class ModeError(ValueError):
    """A mode string that is none of the valid forms."""


def parse_bytes(text: str) -> int:
    """``"64MiB"`` -> 67108864; a bare number above 1 is bytes. ValueError otherwise."""
    try:
        nbytes = MemoryBudget.parse(text).nbytes
    except ConfigError:
        nbytes = None
    if nbytes is None:  # not a size, or a fraction
        raise ValueError(f"{text!r} is not a byte size; use e.g. 64MiB, 1.5GB, 1000000")
    return nbytes


@dataclasses.dataclass(frozen=True)
class Mode:
    kind: str
    """One of KINDS."""
    budget: str | None = None
    """The memory budget as written on the command line, or None."""

    def __str__(self) -> str:
        return self.kind if self.budget is None else f"{self.kind}+budget={self.budget}"

    @property
    def compiled(self) -> bool:
        return self.kind in ("compile", *CKPT_KINDS)

    @property
    def checkpoint_blocks(self) -> bool:
        return self.kind == "eager+checkpoint"


def parse_mode(text: str) -> Mode:
    """A Mode from its string; anything else is a ModeError listing the valid forms."""
    match = _MODE_RE.fullmatch(text.strip())
    if not match:
        raise ModeError(f"unknown mode {text!r}; valid forms: {VALID_FORMS}")
    kind, budget = match.groups()
    if budget is None:
        return Mode(kind)
    budget = budget.strip()
    if kind not in ("compile", *CKPT_KINDS):
        raise ModeError(
            f"mode {text!r}: only compile, ckpt and ckpt-per-block take a budget; valid forms: {VALID_FORMS}"
        )
    if not _valid_budget(kind, budget):
        raise ModeError(f"mode {text!r}: bad budget {budget!r}; valid forms: {VALID_FORMS}")
    return Mode(kind, budget)


def _valid_budget(kind: str, budget: str) -> bool:
    if kind == "compile":  # PyTorch's budget is a fraction only
        return re.fullmatch(_NUMBER, budget) is not None and float(budget) <= 1
    try:
        MemoryBudget.parse(budget)
    except ConfigError:
        return False
    return True


def parse_modes(texts) -> list[Mode]:
    """Modes from strings, in order, without duplicates."""
    modes = []
    for text in texts:
        mode = parse_mode(text)
        if mode not in modes:
            modes.append(mode)
    return modes


@dataclasses.dataclass
class Runner:
    """How one mode calls a model."""

    fn: Callable
    """The model, or its torch.compile wrapper."""
    plans: list
    """The Plans ckpt recorded (empty for other modes)."""
    blocks: int | None = None
    """How many blocks were compiled one by one (ckpt-per-block); None when the
    whole model is one torch.compile. Blocks of one class usually share one
    compiled graph, and so one Plan, run once per block."""
    reports: list = dataclasses.field(default_factory=list)
    """The reports ckpt wrote (when its config has a report_dir)."""
    called: list[int] = dataclasses.field(default_factory=list)
    """Which of ``plans`` the latest forward ran, by index, in call order."""

    def __call__(self, *args):
        """The forward pass (what a step calls: it starts ``called`` afresh)."""
        self.called.clear()
        return self.fn(*args)

    def plans_called(self) -> list:
        """The Plans of the graphs the latest forward ran, in order (all the
        Plans when it ran none: not a ckpt mode, or not called yet). Not every
        Plan recorded: transformers' classification loss sets
        ``config.problem_type`` on its first call, Dynamo compiles the model
        again on the second, and the first graph no longer runs."""
        return [self.plans[i] for i in self.called] if self.called else list(self.plans)


def build_runner(model: torch.nn.Module, mode: Mode, dynamic: bool | None = False,
                 report_dir: str | None = None) -> Runner:
    """The Runner of ``mode`` over ``model`` (checkpointing already set on the model).

    ``dynamic`` goes to torch.compile. False (the default): compiled for the
    shapes it is called with, as a fixed-shape training run is.
    ``report_dir``: where ckpt writes its reports (default: CKPT_REPORT).
    """
    if not mode.compiled:
        return Runner(model, [])
    if mode.kind == "compile":
        if mode.budget is None:
            return Runner(torch.compile(model, dynamic=dynamic), [])
        return Runner(torch.compile(model, backend=InductorUnderBudget(float(mode.budget)), dynamic=dynamic), [])
    from ckpt import make_backend

    overrides = {} if mode.budget is None else {"memory_budget": MemoryBudget.parse(mode.budget)}
    if report_dir is not None:
        overrides["report_dir"] = report_dir
    backend = make_backend(**overrides)
    runner = Runner(model, backend.plans, reports=backend.reports)
    logged = _logging_calls(backend, runner.called)
    if mode.kind == "ckpt-per-block":
        blocks = repeated_blocks(model)
        for block in blocks:  # one backend for all: its plans list collects every block's Plan
            block.compile(backend=logged, dynamic=dynamic)
        runner.blocks = len(blocks)
        return runner
    runner.fn = torch.compile(model, backend=logged, dynamic=dynamic)
    return runner


def _logging_calls(backend, called: list[int]):
    """``backend``, each graph it partitions noting its Plan's index in
    ``called`` when it runs (the step view's re-plans keep that index)."""

    def compile_graph(gm, example_inputs, **kwargs):
        index = len(backend.plans)
        compiled = backend(gm, example_inputs, **kwargs)
        if len(backend.plans) == index:  # no Plan: an inference graph
            return compiled

        def call(*args):
            called.append(index)
            return compiled(*args)

        call._boxed_call = getattr(compiled, "_boxed_call", False)  # Dynamo then passes one list
        return call

    return compile_graph


class InductorUnderBudget:
    """Inductor with PyTorch's partitioner under ``activation_memory_budget``,
    as a backend of its own.

    The budget must travel with the backend, not with a config patch around
    the call: Dynamo hands a recompiled frame any cached graph whose backend
    compares equal, and torch.compile's default Inductor backends all do. A
    patch only around the steps lost the budget after a ``_dynamo.reset()``:
    the bench timed PyTorch's budget modes on ``compile``'s graph.
    """

    def __init__(self, budget: float):
        self.budget = budget

    def __call__(self, gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        with torch._functorch.config.patch(activation_memory_budget=self.budget):
            return compile_fx(gm, example_inputs)

    def __repr__(self) -> str:
        return f"InductorUnderBudget({self.budget})"


def repeated_blocks(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The model's list of repeated blocks: the ``nn.ModuleList`` whose elements
    all have one class (``blocks``, a decoder's ``model.layers``, GPT-2's
    ``transformer.h``, BERT's ``encoder.layer``), the one with the most
    parameters where there are several (an expert list inside a layer holds
    fewer than the layer list). ValueError when the model has none."""
    candidates = [
        (sum(p.numel() for p in module.parameters()), name, module)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.ModuleList) and len(module) > 0
        and len({type(block) for block in module}) == 1
    ]
    if not candidates:
        raise ValueError(
            f"{type(model).__name__} has no list of repeated blocks to compile one by one (an "
            "nn.ModuleList whose elements share one class, such as model.layers or transformer.h); "
            "use the ckpt mode, which compiles the whole model"
        )
    _, _, blocks = max(candidates, key=lambda c: c[0])  # ties: the first in module order
    return blocks
