"""The training run's side-by-side results: every mode trained, the ckpt
modes resumed in a new process, compared, and written as results.json,
results.md and plots."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time

from bench.corpus import Corpus
from bench.harness import fresh_inductor_cache, warm_up_compiler
from bench.ledger import Ledger
from bench.modes import Mode
from bench.report import busy_machine_note, ledger_table, machine_info, write_json
from bench.training import Run, TrainSettings, train

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REFERENCE = "compile"
"""The mode every other is compared with: torch.compile's default."""
RESUME_BEFORE_END = 50
"""By default the resume check starts this many steps before the end."""
FINAL_WINDOW = 20
"""The final training loss is the mean over this many last steps (one
step's loss is one batch's, and noisy)."""


@dataclasses.dataclass(frozen=True)
class Agreement:
    """One run's losses against another's, from the same step on."""

    steps: int
    bitwise_equal_steps: int
    """Steps whose float32 training loss is bit for bit the other's."""
    max_abs_diff: float
    validation_equal: bool
    """Every validation loss both runs have is bit for bit the same."""

    @property
    def bitwise(self) -> bool:
        return self.steps > 0 and self.bitwise_equal_steps == self.steps and self.validation_equal


def agreement(run: Run, other: Run) -> Agreement:
    """Compare ``run`` with ``other`` on the steps ``run`` trained."""
    theirs = other.losses[run.start - other.start:]
    pairs = list(zip(run.losses, theirs))
    their_validation = dict(other.validation)
    return Agreement(
        steps=len(pairs),
        bitwise_equal_steps=sum(a == b for a, b in pairs),
        max_abs_diff=max((abs(a - b) for a, b in pairs), default=0.0),
        validation_equal=all(their_validation.get(step, loss) == loss for step, loss in run.validation),
    )


def resume_in_new_process(checkpoint_path: str, timeout_s: float = 600) -> Run:
    """Run ``python -m bench.train --resume`` on a checkpoint in a new
    process; the Run it trained."""
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "run.json")
        subprocess.run([sys.executable, "-m", "bench.train", "--resume", checkpoint_path, "--json", out],
                       cwd=REPO_ROOT, check=True, timeout=timeout_s)
        with open(out) as f:
            return run_from_json(json.load(f))


def run_from_json(data: dict) -> Run:
    ledger = data.pop("ledger")
    run = Run(**data)
    run.validation = [tuple(v) for v in run.validation]
    run.ledger = Ledger(**ledger) if ledger else None
    return run


def run_all(modes: list[Mode], settings: TrainSettings, corpus: Corpus, args) -> dict:
    """Train every mode, resume the ckpt modes, write the results; exit with
    status 1 when a ckpt mode's losses are not the reference's, bit for bit."""
    began = time.perf_counter()
    resume_at = args.resume_check if args.resume_check is not None else max(0, settings.steps - RESUME_BEFORE_END)
    runs, resumed, loads = {}, {}, []
    with fresh_inductor_cache(), tempfile.TemporaryDirectory() as folder:
        warm_up_compiler("cpu")
        checkpoints = {}
        for index, mode in enumerate(modes):
            if mode.kind == "ckpt" and 0 < resume_at < settings.steps:
                checkpoints[mode] = os.path.join(folder, f"{index}.pt")
            reports = os.path.join(args.reports, str(mode).replace("+", "_").replace(":", "_")) if args.reports else None
            print(f"training {mode} ...", flush=True)
            runs[mode] = train(mode, settings, corpus, checkpoint_at=resume_at,
                               checkpoint_path=checkpoints.get(mode), report_dir=reports)
            print(_progress(runs[mode]), flush=True)
            loads.append(os.getloadavg()[0])
        for mode, path in checkpoints.items():
            print(f"resuming {mode} from step {resume_at} in a new process ...", flush=True)
            resumed[mode] = resume_in_new_process(path)
            loads.append(os.getloadavg()[0])
    data = results_json(runs, resumed, settings, corpus, time.perf_counter() - began)
    data["argv"], data["max_load_average"] = args.argv, max(loads, default=None)
    os.makedirs(args.out, exist_ok=True)
    data["plots"] = write_plots(runs, args.out)
    write_json(os.path.join(args.out, "results.json"), data)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(to_markdown(runs, resumed, data))
    print(f"wrote {args.out}/results.md, results.json and {len(data['plots'])} plot(s) in {data['elapsed_s']:.0f} s")
    failures = _failures(runs, resumed)
    for failure in failures:
        print(f"NOT EQUAL: {failure}", file=sys.stderr)
    if failures:
        raise SystemExit(1)
    return data


def _progress(run: Run) -> str:
    return (f"  {run.mode}: final loss {run.losses[-1]:.4f}, validation {run.validation[-1][1]:.4f}, "
            f"{run.wall_s:.0f} s")


def _failures(runs: dict, resumed: dict) -> list[str]:
    reference = _reference(runs)
    failures = []
    for mode, run in runs.items():
        if mode.kind == "ckpt" and reference is not None and not agreement(run, reference).bitwise:
            failures.append(f"{mode} vs {REFERENCE}")
    for mode, run in resumed.items():
        if not agreement(run, runs[mode]).bitwise:
            failures.append(f"{mode} resumed at step {run.start} vs uninterrupted")
    return failures


def _reference(runs: dict) -> Run | None:
    return next((run for mode, run in runs.items() if str(mode) == REFERENCE), None)


def final_train_loss(run: Run) -> float:
    window = run.losses[-FINAL_WINDOW:]
    return sum(window) / len(window)


def results_json(runs: dict, resumed: dict, settings: TrainSettings, corpus: Corpus, elapsed_s: float) -> dict:
    reference = _reference(runs)
    return {
        "machine": machine_info("cpu"),
        "settings": dataclasses.asdict(settings),
        "corpus": {"files": len(corpus.files), "train_bytes": len(corpus.train),
                   "validation_bytes": len(corpus.validation), "digest": corpus.digest},
        "elapsed_s": elapsed_s,
        "runs": [
            {**dataclasses.asdict(run), "step_s": run.step_s, "final_train_loss": final_train_loss(run),
             "vs_reference": None if reference is None else dataclasses.asdict(agreement(run, reference))}
            for run in runs.values()
        ],
        "resumed": [
            {"mode": run.mode, "start": run.start, "losses": run.losses, "validation": run.validation,
             "vs_uninterrupted": dataclasses.asdict(agreement(run, runs[mode]))}
            for mode, run in resumed.items()
        ],
    }


def write_plots(runs: dict, out: str) -> list[str]:
    from bench.plots import loss_curves, memory_ledger

    written = []
    path = os.path.join(out, "train_loss.png")
    if loss_curves(list(runs.values()), path):
        written.append(os.path.basename(path))
    path = os.path.join(out, "train_memory_ledger.png")
    rows = [(run.mode, run.ledger, run.predicted_peak_bytes) for run in runs.values() if run.ledger]
    if memory_ledger(rows, "memory at the peak of one training step (forward, backward, AdamW)", path):
        written.append(os.path.basename(path))
    return written


LEGEND = """\
Losses are float32 values compared bit for bit. Every mode starts from the
same initial model and sees the same batches. The compiled modes draw their
dropout masks from one `inductor_seeds` draw per step from the default
generator, so they share them; eager dropout draws its masks from that
generator in its own way, so eager's losses differ through its masks alone
(with `torch._inductor.config.fallback_random=True`, compiled dropout draws
as eager does and matches it: tests/test_random_replay.py). The run uses
`torch.use_deterministic_algorithms(True)`: without it Inductor's CPU
embedding backward adds rows with atomic adds from several threads, and two
runs of one compiled graph already differ in the last bits of that
gradient. Validation: eager, dropout off, a fixed set of batches of the validation
split. Step times: median, modes run one after another on a shared machine
(not interleaved), so compare them loosely; compile s: the first step."""


def _rounded(value) -> str:
    return "-" if value is None else f"{value:.1f}" if value < 100 else f"{value:.0f}"


def _agreement_text(a: Agreement | None) -> str:
    if a is None:
        return "-"
    if a.bitwise:
        return f"bitwise equal ({a.steps} steps)"
    return f"{a.bitwise_equal_steps} of {a.steps} steps equal, max abs diff {a.max_abs_diff:.1e}"


def to_markdown(runs: dict, resumed: dict, data: dict) -> str:
    m, s, c = data["machine"], data["settings"], data["corpus"]
    model = s["model"]
    reference = _reference(runs)
    lines = [
        "# Training run: a GPT-style byte model on the Python standard library's source",
        "",
        f"{m['date']}; {m['platform']}, {m['cpu_count']} CPUs, {m['threads']} threads, torch {m['torch']}, "
        f"Python {m['python']}; {data['elapsed_s']:.0f} s in all "
        f"(`{' '.join(['python -m bench.train', *data['argv']])}`).",
        "",
        *busy_machine_note(data),
        f"Model: {model['depth']} layers, d={model['width']}, {model['heads']} heads, seq {model['seq']}, "
        f"byte vocabulary ({model['vocab']}), dropout {model['dropout']} (attention and residual). "
        f"Batch {s['batch']}, {s['steps']} steps, AdamW (lr {s['lr']}, {s['warmup']} warm-up steps, cosine "
        f"to a tenth, weight decay {s['weight_decay']}), seed {s['seed']}. Corpus: {c['files']} modules, "
        f"{c['train_bytes']:,} training and {c['validation_bytes']:,} validation bytes (every 10th file), "
        f"digest {c['digest']}.",
        "",
        f"| mode | final train loss (mean of last {FINAL_WINDOW}) | final validation loss "
        f"| training losses vs {REFERENCE} | step ms (median) | compile s | wall s |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode, run in runs.items():
        vs = None if reference is None or run is reference else agreement(run, reference)
        lines.append(
            f"| {mode} | {final_train_loss(run):.4f} | {run.validation[-1][1]:.4f} "
            f"| {'(reference)' if run is reference else _agreement_text(vs)} "
            f"| {_rounded(run.step_s and run.step_s * 1e3)} | {_rounded(run.compile_s)} | {run.wall_s:.0f} |"
        )
    lines += ["", LEGEND, "", "![training and validation loss per step](train_loss.png)", ""]
    if resumed:
        lines += ["Resumed in a new process from a checkpoint (model, AdamW state, `torch.get_rng_state()`):", "",
                  "| mode | resumed at step | losses from there vs the uninterrupted run |", "|---|---|---|"]
        for mode, run in resumed.items():
            lines.append(f"| {mode} | {run.start} | {_agreement_text(agreement(run, runs[mode]))} |")
        lines.append("")
    rows = [(str(mode), run.ledger, run.plan_saved_bytes, run.predicted_peak_bytes)
            for mode, run in runs.items() if run.ledger]
    if rows:
        lines += [f"Memory ledger of training step {s['ledger_step']} (forward, backward, AdamW step; "
                  "in parentheses, ckpt's plan and predicted forward/backward peak):", "",
                  ledger_table(rows), "", "![memory ledger](train_memory_ledger.png)", ""]
    return "\n".join(lines)

