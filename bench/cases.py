"""Workloads of the suite: a model, its inputs at any batch size, and sizes per preset.

Presets: ``quick`` (tiny, the smoke test and a 2-minute look), ``default``
(the full CPU suite, under 15 minutes on 2 cores), ``cuda`` (larger, for
one GPU) and ``cuda-quick`` (cuda's sizes, a shorter sweep).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch.nn as nn

from bench.models import GPT, MLP, ConvNet, GPTConfig, MoE, MoEConfig, gpt_batch, image_batch, mlp_batch, moe_batch

PRESETS = ("quick", "default", "cuda", "cuda-quick")
BUILTIN = ("mlp", "gpt", "gpt-dropout", "convnet", "moe")
SWEEP = "gpt-depth"
"""The depth sweep: GPT at several depths, memory and compile/partitioner time only."""


def _set_checkpoint_blocks(model: nn.Module) -> None:
    model.checkpoint_blocks = True


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    description: str
    build: Callable[[], nn.Module]
    """A fresh model; called after torch.manual_seed(0)."""
    inputs: Callable[[int], tuple]
    """The CPU inputs for a batch size, the same for the same size."""
    batch: int
    unit: str = "samples"
    """What throughput counts: "tokens" or "samples"."""
    per_sample: int = 1
    """Units per batch element (tokens per sequence)."""
    reference: str = "eager"
    """The mode whose gradients the others are compared with."""
    enable_checkpointing: Callable[[nn.Module], None] = _set_checkpoint_blocks


# Sizes per preset. quick and default: few layers, since on CPU a compile
# costs about a C++ compiler run per kernel, and kernels grow with depth
# (the depth sweep shows how); cuda: large enough that a GPU step is not all
# launch overhead, still a few GiB at most per mode.
MLP_SIZES = {"quick": (2, 64, 64), "default": (4, 256, 512), "cuda": (8, 2048, 8192)}  # depth, width, batch
GPT_SIZES = {
    "quick": (GPTConfig(depth=2, width=64, heads=4, seq=32, vocab=128), 2),
    "default": (GPTConfig(depth=2, width=128, heads=4, seq=128, vocab=512), 4),
    "cuda": (GPTConfig(depth=6, width=512, heads=8, seq=512, vocab=8192), 8),
}
CONV_SIZES = {"quick": (8, 2, 8, 4), "default": (16, 2, 32, 16), "cuda": (64, 4, 64, 64)}  # channels, stages, image, batch
MOE_SIZES = {
    "quick": (MoEConfig(depth=2, width=32, hidden=64, experts=4, seq=16), 2),
    "default": (MoEConfig(depth=2, width=64, hidden=128, experts=4, seq=32), 4),
    "cuda": (MoEConfig(depth=4, width=512, hidden=1024, experts=8, seq=512), 8),
}
SWEEP_DEPTHS = {"quick": (1, 2), "default": (2, 4, 8, 16), "cuda": (4, 8, 16, 32, 48), "cuda-quick": (4, 8, 16)}
SWEEP_SIZES = {  # small width: the sweep is about depth
    "quick": (GPTConfig(width=32, heads=2, seq=16, vocab=64), 2),
    "default": (GPTConfig(width=64, heads=4, seq=64, vocab=256), 2),
    "cuda": (GPTConfig(width=256, heads=8, seq=256, vocab=1024), 4),
}


def _sizes(preset: str) -> str:
    """The size key of a preset: cuda-quick has cuda's sizes."""
    return "cuda" if preset == "cuda-quick" else preset


def mlp_case(preset: str) -> Case:
    depth, width, batch = MLP_SIZES[_sizes(preset)]
    return Case(
        "mlp", f"MLP, {depth} x (Linear, LayerNorm, GELU), d={width}",
        lambda: MLP(depth=depth, width=width), lambda b: mlp_batch(b, width), batch,
    )


def gpt_case(cfg: GPTConfig, batch: int, name: str | None = None) -> Case:
    described = f"GPT-style, {cfg.depth} layers, d={cfg.width}, {cfg.heads} heads, seq {cfg.seq}"
    return Case(
        name or ("gpt-dropout" if cfg.dropout else "gpt"),
        described + (f", dropout {cfg.dropout}" if cfg.dropout else ""),
        lambda: GPT(cfg), lambda b: gpt_batch(cfg, b), batch,
        unit="tokens", per_sample=cfg.seq,
        # Eager draws other dropout masks than Inductor; torch.compile's default
        # draws the same ones under the same seed.
        reference="compile" if cfg.dropout else "eager",
    )


def convnet_case(preset: str) -> Case:
    channels, stages, size, batch = CONV_SIZES[_sizes(preset)]
    return Case(
        "convnet", f"ConvNet, {stages} x (Conv, BatchNorm, ReLU), {channels} channels, {size}x{size} images",
        lambda: ConvNet(channels=channels, stages=stages), lambda b: image_batch(b, size), batch,
    )


def moe_case(preset: str) -> Case:
    cfg, batch = MOE_SIZES[_sizes(preset)]
    return Case(
        "moe", f"top-{cfg.top_k} MoE, {cfg.depth} layers, {cfg.experts} einsum experts, "
               f"d={cfg.width}, h={cfg.hidden}, seq {cfg.seq}",
        lambda: MoE(cfg), lambda b: moe_batch(cfg, b), batch,
        unit="tokens", per_sample=cfg.seq,
    )


def sweep_cases(preset: str, depths=None) -> list[Case]:
    """GPT at each depth of the sweep, small width."""
    base, batch = SWEEP_SIZES[_sizes(preset)]
    return [
        gpt_case(dataclasses.replace(base, depth=depth), batch, name=f"{SWEEP}-{depth}")
        for depth in (depths or SWEEP_DEPTHS[preset])
    ]


def builtin_case(name: str, preset: str) -> Case:
    if name == "mlp":
        return mlp_case(preset)
    if name == "gpt":
        return gpt_case(*GPT_SIZES[_sizes(preset)])
    if name == "gpt-dropout":
        cfg, batch = GPT_SIZES[_sizes(preset)]
        return gpt_case(dataclasses.replace(cfg, dropout=0.1), batch)
    if name == "convnet":
        return convnet_case(preset)
    if name == "moe":
        return moe_case(preset)
    raise ValueError(f"unknown built-in model {name!r}; choose from {', '.join(BUILTIN)}")
