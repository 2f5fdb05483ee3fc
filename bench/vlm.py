"""Per-region budgets against one uniform budget on a vision-language model
assembled from transformers configs: a ViT encoder (``vision_tower``), a
two-layer projector, and a Qwen2 decoder (``language_model``) reading the
image's patches before the text tokens; whole-model compile.

    python -m bench.vlm                       # MODES, 7 interleaved steps each
    python -m bench.vlm --all                 # ALL_MODES: every uniform fraction and region setting
    python -m bench.vlm --repeats 9 --out bench/results/vlm

Every mode is measured by the suite's harness (bench/harness.py: peak of a
step from the profiler's memory events, saved bytes, gradients against
eager, interleaved step times). ``eager+checkpoint`` checkpoints the vision
tower's layers only. The summary answers, for each uniform fraction, which
per-region setting reaches the same or a lower measured peak, and how much
faster its step is (ratio of interleaved medians).
"""
from __future__ import annotations

import argparse
import json
import pathlib

import torch
import torch.nn as nn

from bench.cases import Case
from bench.families import VOCAB, _decoder_common
from bench.harness import Settings, run_case
from bench.modes import parse_modes
from bench.report import machine_info, machine_line

UNIFORM = ("0.0", "0.25", "0.5", "0.75")
REGIONAL = (
    "vision_tower=0.0",
    "vision_tower=0.0,language_model=0.75",
    "vision_tower=0.0,language_model=0.5",
    "vision_tower=0.0,language_model=0.25",
    "vision_tower=0.25,language_model=0.5",
    "vision_tower=0.25,language_model=0.75",
    "vision_tower=0.5,language_model=0.75",
    "vision_tower=0.5,language_model=0.9",
    "vision_tower=0.25",
    "vision_tower=0.4",
    "vision_tower=0.5",
    "language_model=0.0",
)
ALL_MODES = (
    "eager", "eager+checkpoint", "compile", "ckpt",
    *(f"ckpt+budget={u}" for u in UNIFORM), *(f"ckpt+budget={r}" for r in REGIONAL),
)
# The default run (about 20 minutes on 2 idle cores; ALL_MODES takes twice that).
MODES = (
    "eager+checkpoint", "compile", "ckpt", "ckpt+budget=0.0", "ckpt+budget=0.5",
    "ckpt+budget=vision_tower=0.0", "ckpt+budget=vision_tower=0.0,language_model=0.5",
)
# (vision layers, text layers, width, image side, patch, text tokens, batch):
# 256 patches against 128 text tokens, as an image-heavy prompt has.
SIZE = (4, 2, 128, 64, 4, 128, 2)


class VisionLanguage(nn.Module):
    """ViT -> projector -> Qwen2, the image's patch embeddings first."""

    def __init__(self, vision_layers: int, text_layers: int, width: int, image: int, patch: int, seq: int):
        super().__init__()
        import transformers as tf

        self.vision_tower = tf.ViTModel(tf.ViTConfig(
            hidden_size=width, num_hidden_layers=vision_layers, num_attention_heads=4,
            intermediate_size=4 * width, image_size=image, patch_size=patch, num_channels=3,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_implementation="sdpa",
        ), add_pooling_layer=False)
        self.projector = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width))
        patches = (image // patch) ** 2 + 1  # and ViT's class token
        self.language_model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**_decoder_common(text_layers, width, seq + patches)))

    def forward(self, pixel_values, input_ids, labels):
        image = self.projector(self.vision_tower(pixel_values=pixel_values).last_hidden_state)
        text = self.language_model.get_input_embeddings()(input_ids)
        logits = self.language_model(inputs_embeds=torch.cat([image, text], dim=1)).logits[:, image.shape[1]:]
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def vlm_case(size=SIZE) -> Case:
    vision_layers, text_layers, width, image, patch, seq, batch = size

    def inputs(n: int) -> tuple:
        generator = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, VOCAB, (n, seq + 1), generator=generator)
        return torch.randn(n, 3, image, image, generator=generator), tokens[:, :-1], tokens[:, 1:]

    def checkpoint_vision_tower(model):
        model.vision_tower.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    return Case(
        "vlm", f"ViT ({vision_layers} layers, {(image // patch) ** 2} patches) + projector + Qwen2 "
               f"({text_layers} layers, {seq} text tokens), width {width}",
        lambda: VisionLanguage(vision_layers, text_layers, width, image, patch, seq), inputs, batch,
        unit="tokens", per_sample=seq, enable_checkpointing=checkpoint_vision_tower,
    )


def summary(results: dict) -> list[str]:
    """For each uniform fraction: the fastest per-region mode at the same or a lower peak."""
    lines = ["| uniform | its peak MiB | per-region setting at <= that peak, fastest | peak MiB | step vs uniform |",
             "|---|---|---|---|---|"]
    for u in UNIFORM:
        uniform = results.get(f"ckpt+budget={u}")
        if not uniform or uniform["peak_bytes"] is None or uniform["step_s"] is None:
            continue
        fitting = [
            (results[m]["step_s"], m) for m in (f"ckpt+budget={r}" for r in REGIONAL)
            if m in results and results[m]["step_s"] and results[m]["peak_bytes"] <= uniform["peak_bytes"]
        ]
        if not fitting:
            lines.append(f"| {u} | {uniform['peak_bytes'] / 2**20:.2f} | none | | |")
            continue
        step, mode = min(fitting)
        lines.append(
            f"| {u} | {uniform['peak_bytes'] / 2**20:.2f} | {mode.split('=', 1)[1]} | "
            f"{results[mode]['peak_bytes'] / 2**20:.2f} | {step / uniform['step_s']:.3f} |"
        )
    return lines


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.vlm", description=__doc__.splitlines()[0])
    p.add_argument("--modes", nargs="+", default=list(MODES))
    p.add_argument("--all", action="store_true", help="every mode of ALL_MODES")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", type=pathlib.Path, default=None)
    args = p.parse_args(argv)
    case = vlm_case()
    modes = ALL_MODES if args.all else args.modes
    result = run_case(case, parse_modes(modes), Settings(repeats=args.repeats, probes=0))
    compile_step = next((m.step_s for m in result.modes if m.mode == "compile"), None)
    lines = [f"{case.description}, batch {case.batch}; {machine_line(machine_info('cpu'))}", "",
             "| mode | saved MiB | peak MiB | predicted MiB | step ms | vs compile | max grad diff | error |",
             "|---|---|---|---|---|---|---|---|"]
    for m in result.modes:
        mib = lambda b: "" if b is None else f"{b / 2**20:.2f}"  # noqa: E731
        ratio = f"{m.step_s / compile_step:.3f}" if m.step_s and compile_step else ""
        lines.append(
            f"| {m.mode} | {mib(m.saved_bytes)} | {mib(m.peak_bytes)} | {mib(m.predicted_peak_bytes)} | "
            f"{'' if m.step_s is None else f'{m.step_s * 1e3:.0f}'} | {ratio} | "
            f"{'' if m.max_grad_diff is None else f'{m.max_grad_diff:.1e}'} | {m.error or ''} |"
        )
    by_mode = {m.mode: {"peak_bytes": m.peak_bytes, "step_s": m.step_s, "saved_bytes": m.saved_bytes,
                        "step_times_s": m.step_times_s, "predicted_peak_bytes": m.predicted_peak_bytes}
               for m in result.modes}
    lines += ["", *summary(by_mode)]
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.md").write_text(text + "\n")
        (args.out / "results.json").write_text(json.dumps(by_mode, indent=1) + "\n")


if __name__ == "__main__":
    main()
