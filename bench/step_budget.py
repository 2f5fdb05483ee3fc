"""Budgets in the step, as users compile: per block and with graph breaks,
on transformers decoders the rest of the bench does not use (Qwen2,
GPT-NeoX, Gemma, Mistral; random weights, no downloads). Qwen2 and Mistral differ only in biases at these settings;
GPT-NeoX (parallel attention and MLP, LayerNorm, GELU, partial rotary) and
Gemma (GeGLU, one KV head, tied embeddings) are other shapes of layer.

    python -m bench.step_budget                       # Qwen2, GPT-NeoX, Gemma; every layout
    python -m bench.step_budget --families qwen2 --layouts per-block

(Batches of varying length under a cap: python -m bench.variable_length.)

Each row trains a fresh copy (same seed, AdamW) for ``--steps`` steps, so
that ckpt's step view has learnt the step, planned it again and measured it,
then measures one more step: peak bytes allocated during forward and
backward above what is alive before it (CPU: profiler memory events). Next
to it: the step view's predicted and measured peak for the plan that runs,
its recompiles, and whether the losses equal torch.compile's in the same
layout bit for bit. Writes results.md and results.json into --out.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

import torch
import torch._dynamo

from bench.measure import peak_cpu_bytes
from ckpt import make_backend, step_view

DEFAULT_OUT = pathlib.Path("bench/results/step_budget")
FAMILIES = ("qwen2", "gpt_neox", "gemma", "mistral")
DEFAULT_FAMILIES = ("qwen2", "gpt_neox", "gemma")
LAYOUTS = ("per-block", "graph-broken", "whole")
VOCAB = 512


def build(family: str, layers: int, width: int, seq: int) -> torch.nn.Module:
    """A decoder of ``family`` from its transformers config, random weights, SDPA."""
    import transformers as tf

    torch.manual_seed(0)
    common = dict(
        vocab_size=VOCAB, hidden_size=width, intermediate_size=width * 11 // 4, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max(seq, 512), use_cache=False,
        attn_implementation="sdpa",
    )
    if family == "qwen2":
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**common))
    if family == "mistral":
        return tf.MistralForCausalLM(tf.MistralConfig(sliding_window=None, **common))
    if family == "gemma":
        common.update(num_key_value_heads=1, head_dim=width // 4)
        return tf.GemmaForCausalLM(tf.GemmaConfig(**common))
    if family == "gpt_neox":
        del common["num_key_value_heads"]
        common.update(intermediate_size=width * 4, use_parallel_residual=True)
        return tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(**common))
    raise ValueError(f"unknown family {family!r}; use one of {', '.join(FAMILIES)}")


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The model's list of decoder layers (``model.layers``, ``gpt_neox.layers``)."""
    return next(m for name, m in model.named_modules() if name.endswith("layers") and isinstance(m, torch.nn.ModuleList))


def _break_graph(module, args):
    torch._dynamo.graph_break()


def prepare(model: torch.nn.Module, layout: str, mode: str):
    """``model`` compiled as ``layout`` for ``mode``: "eager+checkpoint",
    "compile", "compile+budget=F" (PyTorch's own budget) or "ckpt[+budget=B]".
    Returns the callable to step."""
    layers = decoder_layers(model)
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
    view = step_view.reset()
    model = build(family, settings.layers, settings.width, settings.seq)
    fn = prepare(model, layout, mode)
    budget_patch = {}
    if mode.startswith("compile+budget="):
        budget_patch = {"activation_memory_budget": float(mode.partition("=")[2])}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, peaks, times = [], [], []
    with torch._functorch.config.patch(**budget_patch):
        for index, tokens in enumerate(batches):
            optimizer.zero_grad(set_to_none=True)
            box = {}

            def step():
                loss = fn(input_ids=tokens, labels=tokens).loss
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
    last = view.measurements[-1] if view.measurements else None
    return {
        "family": family, "layout": layout, "mode": mode,
        "peak_bytes": max(peaks), "peaks": peaks, "losses": losses,
        "step_s": statistics.median(times[-settings.measured_steps:]),
        "recompiles": view.recompiles,
        "view_predicted_bytes": last.predicted_bytes if last else None,
        "view_measured_bytes": last.measured_bytes if last else None,
        "view": view.describe() if mode.startswith("ckpt") else None,
    }


class Settings(argparse.Namespace):
    layers = 6
    width = 128
    seq = 512
    batch = 2
    steps = 8
    measured_steps = 2


def fixed_batches(settings) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(VOCAB, (settings.batch, settings.seq), generator=generator) for _ in range(settings.steps)]


def losses_against(losses: list[float], reference: list[float]) -> str:
    """"bitwise", or the largest relative difference of ``losses`` from ``reference``."""
    if losses == reference:
        return "bitwise"
    return f"max rel {max(abs(a - b) / abs(b) for a, b in zip(losses, reference)):.1e}"


def table(rows: list[dict], reference: dict) -> list[str]:
    lines = [
        "| family | layout | mode | step peak MiB | / eager+checkpoint | view predicted MiB | view measured MiB | recompiles | losses = compile's |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        ref = reference.get(row["family"])
        compile_losses = next(
            (r["losses"] for r in rows if (r["family"], r["layout"], r["mode"]) == (row["family"], row["layout"], "compile")),
            None,
        )
        same = "-" if compile_losses is None or row["mode"] in ("compile", "eager+checkpoint") else (
            losses_against(row["losses"], compile_losses)
        )
        mib = lambda v: "-" if v is None else f"{v / 2**20:.2f}"  # noqa: E731
        lines.append(
            f"| {row['family']} | {row['layout']} | {row['mode']} | {mib(row['peak_bytes'])} | "
            f"{row['peak_bytes'] / ref:.2f} | {mib(row['view_predicted_bytes'])} | {mib(row['view_measured_bytes'])} | "
            f"{row['recompiles']} | {same} |"
        )
    return lines


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.step_budget", description=__doc__.splitlines()[0])
    p.add_argument("--families", nargs="+", default=list(DEFAULT_FAMILIES), choices=FAMILIES)
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS))
    p.add_argument("--cap-of-checkpoint", type=float, default=1.15,
                   help="the peak: cap as a multiple of eager+checkpoint's measured peak")
    p.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
    p.add_argument("--steps", type=int, default=Settings.steps)
    args = p.parse_args(argv, namespace=Settings())
    torch._dynamo.config.cache_size_limit = 64  # per-block compile: one entry per layer's backend
    rows, reference, lines = [], {}, ["# Budgets in the step", ""]
    for family in args.families:
        batches = fixed_batches(args)
        checkpointed = run_mode(family, "eager", "eager+checkpoint", args, batches)
        rows.append(checkpointed)
        reference[family] = checkpointed["peak_bytes"]
        cap = int(checkpointed["peak_bytes"] * args.cap_of_checkpoint)
        for layout in args.layouts:
            modes = ["compile", "ckpt", "ckpt+budget=0.0", f"ckpt+budget=peak:{cap}"]
            if layout == "per-block":
                modes.insert(1, "compile+budget=0.5")
                modes.insert(4, "ckpt+budget=0.5")
            for mode in modes:
                row = run_mode(family, layout, mode, args, batches)
                rows.append(row)
                print(table([row], reference)[-1], flush=True)
        lines.append(f"{family}: cap {cap / 2**20:.2f} MiB ({args.cap_of_checkpoint}x eager+checkpoint)")
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
