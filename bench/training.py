"""The training loop behind ``python -m bench.train`` (bench/train.py, the
command line): a GPT-style byte model on the standard library's source
(bench/corpus.py), with dropout and AdamW, one Run per mode.

Every mode builds the same model from the same seed and sees the same batches
(a function of the step, bench/corpus.py). Dropout draws from the default
generator: Inductor through one ``inductor_seeds`` draw per step, eager
through its own draws, so the compiled modes share their masks and eager has
others.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import statistics
import time

import torch

from bench.checkpoint import restore, save_checkpoint
from bench.corpus import VOCAB, Corpus, train_batch, validation_batches
from bench.harness import plan_estimates
from bench.ledger import Ledger, measure_ledger, optimizer_state_bytes
from bench.models import GPT, GPTConfig
from bench.modes import Mode, Runner, build_runner

DEFAULT_OUT = os.path.join(os.path.dirname(__file__), "results", "train")


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    model: GPTConfig
    batch: int
    steps: int
    lr: float = 2e-3
    """AdamW's peak learning rate, after a linear warm-up."""
    warmup: int = 20
    """Warm-up steps; then a cosine decay to a tenth of ``lr`` at ``steps``."""
    weight_decay: float = 0.1
    eval_every: int = 20
    """Validation loss every this many steps (eager, dropout off)."""
    eval_batches: int = 8
    seed: int = 0
    """Seeds the model's initialization (and so the dropout generator after
    it) and the batches."""
    ledger_step: int = 1
    """The step measured by the memory ledger: after AdamW's first step,
    when its state exists."""
    deterministic: bool = True
    """Train under ``torch.use_deterministic_algorithms``. Inductor's CPU
    embedding backward adds rows into the gradient with atomic adds from
    several threads, in no fixed order, so two runs of one compiled graph
    differ in the last bits of that gradient (measured: up to 4e-9 at 2
    threads) and no two runs stay bitwise equal. In deterministic mode
    Inductor calls aten's index_put there instead, which is deterministic."""

    @staticmethod
    def from_dict(data: dict) -> TrainSettings:
        return TrainSettings(**{**data, "model": GPTConfig(**data["model"])})


SIZES = {
    "default": TrainSettings(GPTConfig(depth=4, width=128, heads=4, seq=128, vocab=VOCAB, dropout=0.1),
                             batch=4, steps=300),
    "quick": TrainSettings(GPTConfig(depth=1, width=32, heads=2, seq=32, vocab=VOCAB, dropout=0.1),
                           batch=4, steps=12, warmup=2, eval_every=4, eval_batches=2),
}
DEFAULT_MODES = ("eager", "compile", "ckpt", "ckpt+budget=0.0", "ckpt+budget=peak:12MiB")
QUICK_MODES = ("eager", "compile", "ckpt", "ckpt+budget=0.0")


@dataclasses.dataclass
class Run:
    """One mode's training, from step ``start``."""

    mode: str
    start: int = 0
    losses: list[float] = dataclasses.field(default_factory=list)
    """Training loss of each step from ``start`` (float32 values, exact)."""
    validation: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    """(steps trained, validation loss) pairs."""
    step_times_s: list[float] = dataclasses.field(default_factory=list)
    """Wall time of each step but the first (compile) and the ledger's."""
    compile_s: float | None = None
    ledger: Ledger | None = None
    plan_saved_bytes: int | None = None
    predicted_peak_bytes: int | None = None
    wall_s: float = 0.0

    @property
    def step_s(self) -> float | None:
        return statistics.median(self.step_times_s) if self.step_times_s else None


def lr_at(step: int, settings: TrainSettings) -> float:
    """Linear warm-up, then cosine decay to a tenth: a pure function of the
    step, so a resumed run needs no scheduler state."""
    if step < settings.warmup:
        return settings.lr * (step + 1) / settings.warmup
    progress = (step - settings.warmup) / max(1, settings.steps - settings.warmup)
    return settings.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


def build(settings: TrainSettings) -> tuple[GPT, torch.optim.AdamW]:
    """The model and its optimizer, the same for every mode: seeded here."""
    torch.manual_seed(settings.seed)
    model = GPT(settings.model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=settings.weight_decay)
    return model, optimizer


@torch.no_grad()
def validation_loss(model: torch.nn.Module, batches) -> float:
    """Mean loss over ``batches``, eager, in eval mode (dropout off, so no
    generator draws), then back to train mode."""
    model.eval()
    loss = sum(model(*batch).item() for batch in batches) / len(batches)
    model.train()
    return loss


@contextlib.contextmanager
def deterministic_algorithms(enabled: bool):
    """``torch.use_deterministic_algorithms(enabled)`` inside the block only,
    without filling new tensors with NaN (which only costs time here: no
    kernel of these models reads memory it has not written)."""
    before, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(enabled)
    torch.utils.deterministic.fill_uninitialized_memory = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before, warn_only=warn_only)
        torch.utils.deterministic.fill_uninitialized_memory = fill


def train(mode: Mode, settings: TrainSettings, corpus: Corpus, **options) -> Run:
    """Train under ``mode`` (see _train for the options), deterministically
    if the settings say so."""
    with deterministic_algorithms(settings.deterministic):
        return _train(mode, settings, corpus, **options)


def _train(mode: Mode, settings: TrainSettings, corpus: Corpus, *, resume: dict | None = None,
           stop_at: int | None = None, checkpoint_at: int | None = None, checkpoint_path: str | None = None,
           report_dir: str | None = None) -> Run:
    """Train under ``mode`` from step 0, or from the state in ``resume``
    (a checkpoint), up to step ``stop_at`` (default: ``settings.steps``).
    With ``checkpoint_path``, save the state before step ``checkpoint_at``
    (which may be ``stop_at``) runs."""
    start_time = time.perf_counter()
    torch._dynamo.reset()
    model, optimizer = build(settings)
    start = 0 if resume is None else restore(resume, model, optimizer)
    end = settings.steps if stop_at is None else stop_at
    runner = build_runner(model, mode, report_dir=report_dir)
    run = Run(str(mode), start)
    valid = validation_batches(corpus, settings.eval_batches, settings.batch, settings.model.seq)
    if start == 0:
        run.validation.append((0, validation_loss(model, valid)))
    for step in range(start, end + 1):
        if checkpoint_path is not None and step == checkpoint_at:
            save_checkpoint(checkpoint_path, str(mode), settings, corpus, step, model, optimizer)
        if step == end:
            break
        _step(runner, model, optimizer, train_batch(corpus, step, settings.batch, settings.model.seq, settings.seed),
              lr_at(step, settings), run, measure=step == settings.ledger_step and step > start)
        if (step + 1) % settings.eval_every == 0 or step + 1 == settings.steps:
            run.validation.append((step + 1, validation_loss(model, valid)))
    run.plan_saved_bytes, run.predicted_peak_bytes = plan_estimates(runner)
    _add_optimizer_state(runner, optimizer, report_dir)
    run.wall_s = time.perf_counter() - start_time
    return run


def _step(runner: Runner, model, optimizer, inputs: tuple, lr: float, run: Run, measure: bool) -> None:
    """One training step; ``measure``: under the memory ledger (untimed)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    if measure:
        run.ledger = measure_ledger(model, lambda: _loss(runner, inputs, run), optimizer, inputs)
        return
    began = time.perf_counter()
    _loss(runner, inputs, run).backward()
    optimizer.step()
    elapsed = time.perf_counter() - began
    if run.compile_s is None:  # the first step compiles
        run.compile_s = elapsed
    else:
        run.step_times_s.append(elapsed)


def _loss(runner: Runner, inputs: tuple, run: Run) -> torch.Tensor:
    """The forward pass; records the loss value."""
    loss = runner(*inputs)
    run.losses.append(loss.item())
    return loss


def _add_optimizer_state(runner: Runner, optimizer: torch.optim.Optimizer, report_dir: str | None) -> None:
    """Rewrite ckpt's reports in ``report_dir`` with the optimizer's state in their ledger."""
    from ckpt.reports.report import add_optimizer_state, write_report

    if report_dir is None:
        return
    for report in runner.reports:
        write_report(add_optimizer_state(report, optimizer_state_bytes(optimizer), type(optimizer).__name__),
                     report_dir)
