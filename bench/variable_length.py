"""A variable-length training run under a ``peak:`` cap: the cap must hold on
the longest batch, not only on average.

    python -m bench.variable_length                   # Qwen2, GPT-NeoX
    python -m bench.variable_length --families qwen2 --steps 24

Batches of the standard library's source with dynamic padding: each batch
is as long as its longest sample, samples are the corpus' paragraphs (a
heavy tail of lengths, capped at ``--seq``), padding is on the right and
ignored by the loss, so padded and unpadded steps train the same tokens.
Whole-model compile, modes side by side, each a fresh model (same seed):

- ``eager+checkpoint``: transformers' per-layer checkpointing, dynamic padding;
- ``compile``: torch.compile, dynamic padding (Dynamo's automatic dynamic shapes);
- ``ckpt peak``: ckpt under the cap, dynamic padding (one plan per
  power-of-two length bucket);
- ``ckpt peak, bound declared``: the same with
  ``mark_dynamic(tokens, 1, min=2, max=seq)`` on every batch (one plan at the bound);
- ``ckpt peak, padded``: ckpt under the cap, every batch padded to ``--seq``
  (static shapes: the usual way to avoid recompiles, paid in wasted tokens).

The cap is ``--cap-of-checkpoint`` times eager checkpointing's largest step
peak. Every step's peak is measured in a first pass (ckpt modes: the step
view's own meter, ``meter_every_step``; others: bench.measure.peak_cpu_bytes);
tokens/s (non-padding tokens) is timed in a second pass over the same
batches with nothing measured. Writes results.md, results.json and
per_step_peak.png into --out.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import time

import torch
import torch._dynamo

from bench.corpus import load_corpus
from bench.measure import peak_cpu_bytes
from bench.report import machine_info, machine_line
from bench.step_budget import VOCAB, build, losses_against
from ckpt import make_backend
from ckpt.backend import fresh_step_view

DEFAULT_OUT = pathlib.Path("bench/results/variable_length")
MODES = ("eager+checkpoint", "compile", "ckpt peak", "ckpt peak, bound declared", "ckpt peak, padded")
IGNORED = -100  # transformers' label for "no loss here"


class Settings(argparse.Namespace):
    families = ["qwen2", "gpt_neox"]
    layers = 6
    width = 128
    seq = 512
    batch = 4
    steps = 24
    cap_of_checkpoint = 1.15
    out = DEFAULT_OUT


def corpus_batches(settings) -> list[torch.Tensor]:
    """``settings.steps`` batches of paragraph samples, each row as long as
    its sample; the longest batch the run can see (a full ``seq`` sample)
    comes two thirds of the way in, after shorter ones have been planned."""
    text = bytes(load_corpus().train[:2_000_000].tolist())
    paragraphs = [p for p in text.split(b"\n\n") if p.strip()]
    generator = torch.Generator().manual_seed(0)
    batches = []
    for index in range(settings.steps):
        picks = torch.randint(len(paragraphs), (settings.batch,), generator=generator).tolist()
        samples = [paragraphs[p][: settings.seq] for p in picks]
        if index == 2 * settings.steps // 3:
            samples[0] = text[: settings.seq]
        batches.append([torch.tensor(list(s), dtype=torch.long) % VOCAB for s in samples])
    return batches


def padded(samples: list[torch.Tensor], length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens right-padded to ``length`` (default: the longest sample), and
    labels with the padding ignored."""
    length = length or max(len(s) for s in samples)
    tokens = torch.zeros(len(samples), length, dtype=torch.long)
    labels = torch.full((len(samples), length), IGNORED, dtype=torch.long)
    for row, sample in enumerate(samples):
        tokens[row, : len(sample)] = sample
        labels[row, : len(sample)] = sample
    return tokens, labels


def run_mode(family: str, mode: str, settings, batches, cap: int | None) -> dict:
    torch._dynamo.reset()
    view = fresh_step_view()
    model = build(family, settings.layers, settings.width, settings.seq)
    compiles = [0]
    if mode == "eager+checkpoint":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        fn = model
    else:
        inner = make_backend(memory_budget=f"peak:{cap}") if mode.startswith("ckpt") else "inductor"
        inner = torch._dynamo.lookup_backend(inner) if isinstance(inner, str) else inner

        def backend(gm, example_inputs):
            compiles[0] += 1
            return inner(gm, example_inputs)

        fn = torch.compile(model, backend=backend)
    length = settings.seq if mode.endswith("padded") else None
    steps = [padded(samples, length) for samples in batches]
    if mode.endswith("bound declared"):
        for tokens, labels in steps:
            for tensor in (tokens, labels):
                torch._dynamo.mark_dynamic(tensor, 1, min=2, max=settings.seq)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    by_view = mode.startswith("ckpt")
    view.meter_every_step = by_view
    losses, peaks = [], []
    for tokens, labels in steps:
        box = {}

        def step():
            loss = fn(input_ids=tokens, labels=labels).loss
            loss.backward()
            box["loss"] = loss.detach()

        optimizer.zero_grad(set_to_none=True)
        if by_view:
            step()
            view.finish_step()
            mine = [m for m in view.measurements if m.step == view.steps]
            peaks.append(mine[-1].measured_bytes if mine else None)
        else:
            peaks.append(peak_cpu_bytes(step))
        optimizer.step()
        losses.append(box["loss"].item())
    view.meter_every_step = False
    first_pass_compiles = compiles[0]
    real_tokens = sum(len(s) for samples in batches for s in samples)
    start = time.perf_counter()
    for tokens, labels in steps:
        optimizer.zero_grad(set_to_none=True)
        fn(input_ids=tokens, labels=labels).loss.backward()
        optimizer.step()
    seconds = time.perf_counter() - start
    known = [p for p in peaks if p is not None]
    return {
        "family": family, "mode": mode, "lengths": [int(t.shape[1]) for t, _ in steps],
        "peaks": peaks, "largest_peak_bytes": max(known), "losses": losses,
        "tokens_per_s": real_tokens / seconds, "dynamo_compiles": first_pass_compiles,
        "ckpt_recompiles": view.recompiles, "later_compiles": compiles[0] - first_pass_compiles,
        "view": view.describe() if by_view else None,
    }


def table(rows: list[dict], caps: dict) -> list[str]:
    lines = [
        "| family | mode | largest step peak MiB | / cap | tokens/s | Dynamo compiles | ckpt re-plans | losses vs compile |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        compile_losses = next(r["losses"] for r in rows if (r["family"], r["mode"]) == (row["family"], "compile"))
        same = "-" if row["mode"] == "compile" else losses_against(row["losses"], compile_losses)
        cap = caps[row["family"]]
        lines.append(
            f"| {row['family']} | {row['mode']} | {row['largest_peak_bytes'] / 2**20:.2f} | "
            f"{row['largest_peak_bytes'] / cap:.3f} | {row['tokens_per_s']:.0f} | {row['dynamo_compiles']} | "
            f"{row['ckpt_recompiles']} | {same} |"
        )
    return lines


def plot(rows: list[dict], caps: dict, path: pathlib.Path) -> None:
    from bench.plots import plt, save, style_axes

    families = list(caps)
    fig, axes = plt.subplots(1, len(families), figsize=(6 * len(families), 4), squeeze=False)
    for ax, family in zip(axes[0], families):
        for row in (r for r in rows if r["family"] == family):
            steps = [i for i, p in enumerate(row["peaks"]) if p is not None]
            ax.plot(steps, [row["peaks"][i] / 2**20 for i in steps], marker=".", label=row["mode"])
        ax.axhline(caps[family] / 2**20, color="black", linestyle="--", label="cap")
        style_axes(ax, "step", "step peak, MiB", f"{family}: per-step peak under peak:{caps[family] / 2**20:.1f}MiB",
                   legend=True)
        lengths = next(r["lengths"] for r in rows if r["family"] == family and r["mode"] == "compile")
        twin = ax.twinx()
        twin.bar(range(len(lengths)), lengths, color="gray", alpha=0.15)
        twin.set_ylabel("batch length (tokens)")
    save(fig, str(path))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.variable_length", description=__doc__.splitlines()[0])
    p.add_argument("--families", nargs="+")
    p.add_argument("--steps", type=int)
    p.add_argument("--layers", type=int)
    p.add_argument("--seq", type=int)
    p.add_argument("--cap-of-checkpoint", type=float)
    p.add_argument("--out", type=pathlib.Path)
    args = p.parse_args(argv, namespace=Settings())
    torch._dynamo.config.cache_size_limit = 64
    batches = corpus_batches(args)
    rows, caps, repeats = [], {}, {}
    for family in args.families:
        checkpointed = run_mode(family, "eager+checkpoint", args, batches, None)
        caps[family] = cap = int(checkpointed["largest_peak_bytes"] * args.cap_of_checkpoint)
        rows.append(checkpointed)
        for mode in MODES[1:]:
            rows.append(run_mode(family, mode, args, batches, cap))
            print(rows[-1]["mode"], rows[-1]["largest_peak_bytes"] / cap, flush=True)
        first = next(r for r in rows if (r["family"], r["mode"]) == (family, "ckpt peak"))
        again = run_mode(family, "ckpt peak", args, batches, cap)
        repeats[family] = again["losses"] == first["losses"]
    lengths = rows[0]["lengths"]
    lines = [
        "# A variable-length run under a peak cap", "", machine_line(machine_info("cpu")), "",
        f"{args.steps} steps of batch {args.batch}, lengths {min(lengths)}..{max(lengths)} "
        f"(median {sorted(lengths)[len(lengths) // 2]}); caps: "
        + ", ".join(f"{f} {c / 2**20:.2f} MiB ({args.cap_of_checkpoint}x eager+checkpoint)" for f, c in caps.items()),
        "", *table(rows, caps), "",
        "A second `ckpt peak` run in the same process, losses equal to the first bit for bit: "
        + ", ".join(f"{f} {'yes' if same else 'NO'}" for f, same in repeats.items()) + ".", "",
        "Per-step peaks (MiB; '-': a step the view could not measure):", "",
    ]
    for row in rows:
        peaks = " ".join("-" if v is None else f"{v / 2**20:.1f}" for v in row["peaks"])
        lines.append(f"- {row['family']} {row['mode']}: {peaks}")
    for row in rows:
        if row["view"]:
            lines += ["", f"## {row['family']} {row['mode']}", "", row["view"]]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    (args.out / "results.json").write_text(json.dumps(rows, indent=1))
    plot(rows, caps, args.out / "per_step_peak.png")
    print("\n".join(lines[:12 + len(rows)]))


if __name__ == "__main__":
    main()
