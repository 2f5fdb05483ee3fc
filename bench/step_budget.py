"""Budgets in the step, as users compile (per block, with graph breaks, whole
model), on architecture families of bench/families.py the peak model was
not fitted on: decoders (Qwen2, Mistral, GPT-NeoX, Gemma, Mamba2) and T5, Whisper,
ConvNeXt and Swin; transformers configs, random weights, no downloads.

    python -m bench.step_budget                       # Qwen2, GPT-NeoX, Gemma; every layout
    python -m bench.step_budget --families qwen2 --layouts per-block
    python -m bench.step_budget --families t5 convnext --layouts whole

(Batches of varying length under a cap: python -m bench.variable_length.)

Each row trains a fresh copy (same seed, AdamW) for ``--steps`` steps, so
that ckpt's step view has learnt the step, planned it again, measured it
and tried the looser budgets it had to (ckpt/step_view.py), then measures
two more steps: peak bytes allocated during forward and backward above
what is alive before it (CPU: profiler memory events). Next to it: the
peak against the reference (per-layer eager checkpointing, or eager where
transformers cannot checkpoint the family) and against ckpt's default plan;
the step view's predicted and measured peak at its first measured step
(the uncorrected model) and for the plans that run; what learning the step
cost (measured steps, recompiles, wall time of the steps before the
measured ones); and whether the losses equal torch.compile's in the same
layout bit for bit. Writes results.md and results.json into --out.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import statistics
import time

import torch
import torch._dynamo

from bench import families
from bench.measure import peak_cpu_bytes
from bench.report import machine_info, machine_line
from ckpt import make_backend, step_view
from ckpt.backend import fresh_step_view
from ckpt.step_report import sequence_id

DEFAULT_OUT = pathlib.Path("bench/results/step_budget")
FAMILIES = tuple(families.FAMILIES)
VOCAB = families.VOCAB
DEFAULT_FAMILIES = ("qwen2", "gpt_neox", "gemma")
LAYOUTS = ("per-block", "graph-broken", "whole")


def build(family: str, layers: int, width: int, seq: int) -> torch.nn.Module:
    """A model of ``family`` (bench/families.py), random weights."""
    return families.build(family, layers, width, seq)


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The model's list of decoder layers (``model.layers``, ``gpt_neox.layers``)."""
    return next(m for name, m in model.named_modules() if name.endswith("layers") and isinstance(m, torch.nn.ModuleList))


def _break_graph(module, args):
    torch._dynamo.graph_break()


def prepare(model: torch.nn.Module, layout: str, mode: str):
    """``model`` compiled as ``layout`` for ``mode``: "eager+checkpoint",
    "compile", "compile+budget=F" (PyTorch's own budget) or "ckpt[+budget=B]".
    Returns the callable to step."""
    layers = [layer for stack in families.checkpointed_layers(model) for layer in stack]
    if mode == "eager":
        return model
    if mode == "eager+checkpoint":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model
    if mode.startswith("ckpt"):
        budget = mode.partition("=")[2] or None
        backend = make_backend(memory_budget=budget)
    else:
        backend = "inductor"
    if layout == "per-block":
        for layer in layers:
            layer.compile(backend=backend)
        return model
    if layout == "graph-broken":
        # A hook that breaks the graph, on two layers: three graphs per step.
        for index in (len(layers) // 3, 2 * len(layers) // 3):
            layers[index].register_forward_pre_hook(_break_graph)
    return torch.compile(model, backend=backend)


def run_mode(family, layout, mode, settings, batches) -> dict:
    torch._dynamo.reset()
    view = fresh_step_view()
    model = build(family, settings.layers, settings.width, settings.seq)
    fn = prepare(model, layout, mode)
    budget_patch = {}
    if mode.startswith("compile+budget="):
        budget_patch = {"activation_memory_budget": float(mode.partition("=")[2])}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, peaks, times = [], [], []
    with torch._functorch.config.patch(**budget_patch):
        for index, inputs in enumerate(batches):
            optimizer.zero_grad(set_to_none=True)
            box = {}

            def step():
                loss = families.FAMILIES[family].loss(fn, inputs)
                loss.backward()
                box["loss"] = loss.detach()

            measured = index >= settings.steps - settings.measured_steps
            start = time.perf_counter()
            if measured:
                peaks.append(peak_cpu_bytes(step))
            else:
                step()
            times.append(time.perf_counter() - start)
            optimizer.step()
            losses.append(box["loss"].item())
    view.finish_step()
    last = _of_plans_that_run(view)
    first = view.measurements[0] if view.measurements else None
    return {
        "family": family, "layout": layout, "mode": mode,
        "peak_bytes": max(peaks), "peaks": peaks, "losses": losses,
        "step_s": statistics.median(times[-settings.measured_steps:]),
        # What learning the step cost: every step before the measured ones
        # (compiles, re-plans, measured steps), next to compile's.
        "warmup_s": sum(times[:-settings.measured_steps]),
        "recompiles": view.recompiles,
        "view_steps": len(view.measurements),
        "view_first_predicted_bytes": first.predicted_bytes if first else None,
        "view_first_measured_bytes": first.measured_bytes if first else None,
        "view_predicted_bytes": last.predicted_bytes if last else None,
        "view_measured_bytes": last.measured_bytes if last else None,
        "view_measurements": [dataclasses.asdict(m) for m in view.measurements],
        "view": view.describe() if mode.startswith("ckpt") else None,
    }


def _of_plans_that_run(view) -> step_view.Measurement | None:
    """The latest measurement of the plans the step runs now (after a
    fallback the view may go back to plans it measured earlier)."""
    running = {sequence_id(seq): state.rung for seq, state in view.sequences.items()}
    return next((m for m in reversed(view.measurements) if running.get(m.sequence_id) == m.rung), None)


class Settings(argparse.Namespace):
    """Sizes default to each family's (bench/families.py)."""

    layers = width = seq = batch = None
    steps = 12
    measured_steps = 2


def sized(settings, family: str) -> Settings:
    """``settings`` with the family's realistic sizes where none was given."""
    result = Settings(**vars(settings))
    for name, value in zip(("layers", "width", "seq", "batch"), families.FAMILIES[family].size):
        if getattr(result, name) is None:
            setattr(result, name, value)
    return result


def fixed_batches(settings, family: str = "qwen2") -> list[dict]:
    return families.batches(family, settings.steps, settings.batch, settings.seq)


def losses_against(losses: list[float], reference: list[float]) -> str:
    """"bitwise", or the largest relative difference of ``losses`` from ``reference``."""
    if losses == reference:
        return "bitwise"
    return f"max rel {max(abs(a - b) / abs(b) for a, b in zip(losses, reference)):.1e}"


def table(rows: list[dict], reference: dict) -> list[str]:
    lines = [
        "| family | layout | mode | step peak MiB | / reference | / ckpt | view predicted / measured MiB, first step | "
        "the plan that runs | view steps | recompiles | warm-up s | losses = compile's |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        ref = reference.get(row["family"])
        same_layout = lambda mode: next(  # noqa: E731
            (r for r in rows if (r["family"], r["layout"], r["mode"]) == (row["family"], row["layout"], mode)), None
        )
        compiled, default = same_layout("compile"), same_layout("ckpt")
        same = "-" if compiled is None or row["mode"] in ("compile", "eager+checkpoint", "eager") else (
            losses_against(row["losses"], compiled["losses"])
        )
        mib = lambda v: "-" if v is None else f"{v / 2**20:.2f}"  # noqa: E731
        pair = lambda a, b: "-" if a is None else f"{mib(a)} / {mib(b)} ({b / a - 1:+.0%})"  # noqa: E731
        lines.append(
            f"| {row['family']} | {row['layout']} | {row['mode']} | {mib(row['peak_bytes'])} | "
            f"{row['peak_bytes'] / ref:.2f} | "
            f"{'-' if default is None else format(row['peak_bytes'] / default['peak_bytes'], '.2f')} | "
            f"{pair(row.get('view_first_predicted_bytes'), row.get('view_first_measured_bytes'))} | "
            f"{pair(row['view_predicted_bytes'], row['view_measured_bytes'])} | {row.get('view_steps', '-')} | "
            f"{row['recompiles']} | {row.get('warmup_s', 0):.0f} | {same} |"
        )
    return lines


def modes_for(layout: str, cap: int) -> list[str]:
    modes = ["compile", "ckpt", "ckpt+budget=0.5", "ckpt+budget=0.0", f"ckpt+budget=peak:{cap}"]
    if layout == "per-block":
        modes.insert(1, "compile+budget=0.5")
    return modes


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.step_budget", description=__doc__.splitlines()[0])
    p.add_argument("--families", nargs="+", default=list(DEFAULT_FAMILIES), choices=FAMILIES)
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS))
    p.add_argument("--modes", nargs="+", help="instead of every mode (a peak: cap is given as 'peak')")
    p.add_argument("--cap-of-checkpoint", type=float, default=1.15,
                   help="the peak: cap as a multiple of the reference's measured peak")
    p.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
    p.add_argument("--steps", type=int, default=Settings.steps)
    for name in ("layers", "width", "seq", "batch"):
        p.add_argument(f"--{name}", type=int, help="instead of the family's own (bench/families.py)")
    args = p.parse_args(argv, namespace=Settings())
    torch._dynamo.config.cache_size_limit = 64  # per-block compile: one entry per layer's backend
    rows, reference, lines = [], {}, ["# Budgets in the step", "", machine_line(machine_info("cpu")), ""]
    for family in args.families:
        settings = sized(args, family)
        batches = fixed_batches(settings, family)
        # The reference: per-layer eager checkpointing, or eager where
        # transformers cannot checkpoint the model per layer.
        checkpointing = families.FAMILIES[family].per_layer_checkpointing
        ref_mode = "eager+checkpoint" if checkpointing else "eager"
        checkpointed = run_mode(family, "eager", ref_mode, settings, batches)
        rows.append(checkpointed)
        reference[family] = checkpointed["peak_bytes"]
        cap = int(checkpointed["peak_bytes"] * args.cap_of_checkpoint)
        for layout in args.layouts:
            modes = modes_for(layout, cap)
            if args.modes:
                modes = [f"ckpt+budget=peak:{cap}" if m == "peak" else m for m in args.modes]
            for mode in modes:
                row = run_mode(family, layout, mode, settings, batches)
                rows.append(row)
                print(table([row], reference)[-1], flush=True)
        lines.append(
            f"{family} ({settings.layers} layers, width {settings.width}, seq/image {settings.seq}, "
            f"batch {settings.batch}): reference {ref_mode}, cap {cap / 2**20:.2f} MiB ({args.cap_of_checkpoint}x it)"
        )
    lines += ["", *table(rows, reference), ""]
    for row in rows:
        if row["view"]:
            lines += [f"## {row['family']} {row['layout']} {row['mode']}", "", row["view"]]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.md").write_text("\n".join(lines))
    (args.out / "results.json").write_text(json.dumps(rows, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
