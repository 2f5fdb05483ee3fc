"""Side-by-side training-step comparison of compile backends on one model.

    python -m bench.compare --model gpt --repeats 10

Every mode trains its own copy of the same initial model on the same batch.
Peak memory and saved bytes come from one instrumented step each; step
times from repeated steps with the modes interleaved, so machine drift hits
all of them alike; medians and ratios are reported.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import time

import torch

from bench.measure import count_saved_bytes, max_grad_diff, peak_cpu_bytes, time_once_s
from bench.models import GPT, MLP, GPTConfig, gpt_batch
from ckpt import make_backend

MODES = ("eager", "compile", "ckpt")
MiB = 2**20


@dataclasses.dataclass
class ModeResult:
    mode: str
    compile_s: float = 0.0
    saved_bytes: int = 0
    peak_bytes: int = 0
    step_s: float = 0.0
    max_grad_diff: float = 0.0
    notes: str = ""


MODELS = ("gpt", "gpt-dropout", "mlp")


def build_model(name: str):
    """The model and one batch of its inputs, at the sizes in shared/DESIGN.md."""
    torch.manual_seed(0)
    if name in ("gpt", "gpt-dropout"):
        dropout = 0.1 if name == "gpt-dropout" else 0.0
        cfg = GPTConfig(depth=6, width=256, heads=8, seq=256, vocab=1024, dropout=dropout)
        return GPT(cfg), gpt_batch(cfg, batch=4)
    if name == "mlp":
        return MLP(depth=8, width=512), (torch.randn(1024, 512),)
    raise ValueError(f"unknown model {name!r}; choose one of: {', '.join(MODELS)}")


def reference_mode(model_name: str) -> str:
    """Whose gradients the others are compared with. With dropout, eager
    draws other masks than Inductor, so torch.compile's default (same seed,
    same masks) is the reference."""
    return "compile" if "dropout" in model_name else "eager"


def _reference_grads(model_name: str, base, args) -> list[torch.Tensor]:
    torch._dynamo.reset()
    model = copy.deepcopy(base)
    fn, _ = _compiled(model, reference_mode(model_name))
    torch.manual_seed(0)
    fn(*args).backward()
    return [p.grad for p in model.parameters()]


def _compiled(model, mode: str):
    """The callable for ``mode``, and the list where ckpt records its Plans."""
    if mode == "eager":
        return model, []
    if mode == "compile":
        return torch.compile(model), []
    if mode == "ckpt":
        backend = make_backend()
        return torch.compile(model, backend=backend), backend.plans
    raise ValueError(f"unknown mode {mode!r}; choose from {MODES}")


def compare(model_name: str, modes=MODES, repeats: int = 10) -> list[ModeResult]:
    base, args = build_model(model_name)
    reference = _reference_grads(model_name, base, args)

    steps, results = {}, {}
    for mode in modes:
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        fn, plans = _compiled(model, mode)

        def step(model=model, fn=fn):
            model.zero_grad(set_to_none=True)
            fn(*args).backward()

        torch.manual_seed(0)  # same masks as the reference's first step
        start = time.perf_counter()
        step()  # compiles
        result = ModeResult(mode, compile_s=time.perf_counter() - start)
        result.max_grad_diff = max_grad_diff(model, reference)
        if any(p.fallback for p in plans):
            result.notes = "fell back to PyTorch's partitioner"
        model.zero_grad(set_to_none=True)
        with count_saved_bytes(list(model.parameters()) + list(args)) as saved:
            loss = fn(*args)
        loss.backward()
        result.saved_bytes = saved["bytes"]
        # Free the gradients first: the peak counts from parameters and inputs alone.
        model.zero_grad(set_to_none=True)
        result.peak_bytes = peak_cpu_bytes(step)
        steps[mode], results[mode] = step, result

    times = {mode: [] for mode in modes}
    for _ in range(repeats):
        for mode in modes:  # interleaved: drift hits every mode alike
            times[mode].append(time_once_s(steps[mode]))
    for mode in modes:
        results[mode].step_s = statistics.median(times[mode])
    return [results[mode] for mode in modes]


def format_table(model_name: str, results: list[ModeResult]) -> str:
    by_mode = {r.mode: r for r in results}
    base = by_mode.get("compile")
    lines = [
        f"model: {model_name}, torch {torch.__version__}, {torch.get_num_threads()} threads",
        f"| mode | saved MiB | peak MiB | step ms (median) | vs compile "
        f"| max grad diff vs {reference_mode(model_name)} | compile s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        ratio = f"{r.step_s / base.step_s:.3f}" if base else "-"
        lines.append(
            f"| {r.mode} | {r.saved_bytes / MiB:.1f} | {r.peak_bytes / MiB:.1f} | "
            f"{r.step_s * 1e3:.0f} | {ratio} | {r.max_grad_diff:.1e} | {r.compile_s:.1f} |"
            + (f" {r.notes}" if r.notes else "")
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, default="gpt")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    print(format_table(args.model, compare(args.model, args.modes, args.repeats)))


if __name__ == "__main__":
    main()
