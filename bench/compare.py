"""Side-by-side training-step comparison of compile backends on one model.

    python -m bench.compare --model gpt --repeats 10

A thin front end over bench.harness, at the sizes of build_case below: the
same measurements as ``python -m bench`` (every mode on its own copy of the
same initial model and batch; step times with the modes interleaved, medians
and ratios reported), without the batch search and the files.
"""
from __future__ import annotations

import argparse

import torch

from bench.cases import Case, gpt_case
from bench.harness import ModeResult, Settings, fresh_inductor_cache, run_case, warm_up_compiler
from bench.models import MLP, GPTConfig, mlp_batch
from bench.modes import parse_modes

MODES = ("eager", "compile", "ckpt")
MODELS = ("gpt", "gpt-dropout", "mlp")
MiB = 2**20


def build_case(name: str) -> Case:
    """The workload: a 6-layer GPT (d=256, seq 256, batch 4) or an MLP."""
    if name in ("gpt", "gpt-dropout"):
        dropout = 0.1 if name == "gpt-dropout" else 0.0
        return gpt_case(GPTConfig(depth=6, width=256, heads=8, seq=256, vocab=1024, dropout=dropout), batch=4)
    if name == "mlp":
        return Case("mlp", "MLP, 8 x (Linear, LayerNorm, GELU), d=512",
                    lambda: MLP(depth=8, width=512), lambda b: mlp_batch(b, 512), batch=1024)
    raise ValueError(f"unknown model {name!r}; choose one of: {', '.join(MODELS)}")


def reference_mode(model_name: str) -> str:
    """Whose gradients the others are compared with (see Case.reference)."""
    return build_case(model_name).reference


def compare(model_name: str, modes=MODES, repeats: int = 10) -> list[ModeResult]:
    settings = Settings(repeats=repeats, probes=0)  # no batch search: one table, quickly
    with fresh_inductor_cache():
        warm_up_compiler("cpu")  # the first mode's compile time without Inductor's start-up
        return run_case(build_case(model_name), parse_modes(modes), settings).modes


def format_table(model_name: str, results: list[ModeResult]) -> str:
    base = next((r for r in results if r.mode == "compile" and r.step_s), None)
    lines = [
        f"model: {model_name}, torch {torch.__version__}, {torch.get_num_threads()} threads",
        f"| mode | saved MiB | peak MiB | step ms (median) | vs compile "
        f"| max grad diff vs {reference_mode(model_name)} | compile s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r.error:
            lines.append(f"| {r.mode} | error: {r.error} |")
            continue
        ratio = f"{r.step_s / base.step_s:.3f}" if base else "-"
        lines.append(
            f"| {r.mode} | {r.saved_bytes / MiB:.1f} | {r.peak_bytes / MiB:.1f} | "
            f"{r.step_s * 1e3:.0f} | {ratio} | {r.max_grad_diff:.1e} | {r.compile_s:.1f} |"
            + (" fell back to PyTorch's partitioner" if r.fallback else "")
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, default="gpt")
    parser.add_argument("--modes", nargs="+", default=list(MODES),
                        help="any mode of python -m bench, e.g. eager compile ckpt ckpt+budget=0.5")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    print(format_table(args.model, compare(args.model, args.modes, args.repeats)))


if __name__ == "__main__":
    main()
