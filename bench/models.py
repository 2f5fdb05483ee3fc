"""Built-in models: no downloads, sizes set by arguments, deterministic init."""
from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    """``depth`` x (Linear, LayerNorm, GELU) blocks and a linear head."""

    def __init__(self, depth: int = 8, width: int = 512):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width), nn.GELU())
            for _ in range(depth)
        )
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).mean()


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    depth: int = 6
    width: int = 256
    heads: int = 8
    seq: int = 256
    vocab: int = 1024
    dropout: float = 0.0


class Block(nn.Module):
    """Pre-norm decoder block: causal self-attention and a GELU MLP."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads = cfg.heads
        self.dropout = cfg.dropout
        self.ln1 = nn.LayerNorm(cfg.width)
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width)
        self.proj = nn.Linear(cfg.width, cfg.width)
        self.ln2 = nn.LayerNorm(cfg.width)
        self.fc = nn.Linear(cfg.width, 4 * cfg.width)
        self.out = nn.Linear(4 * cfg.width, cfg.width)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(width, dim=-1)
        q, k, v = (t.view(batch, seq, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        x = x + self.resid_drop(self.proj(attn.transpose(1, 2).reshape(batch, seq, width)))
        return x + self.resid_drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    """A GPT-style decoder returning the mean next-token cross-entropy."""

    def __init__(self, cfg: GPTConfig = GPTConfig()):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.width)
        self.pos = nn.Embedding(cfg.seq, cfg.width)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.depth))
        self.ln = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class TPMLP(nn.Module):
    """Two (up, down) linear pairs for tensor parallelism: the first pair's
    all-reduced output feeds a layer whose backward needs it."""

    def __init__(self, width: int = 16, hidden: int = 32):
        super().__init__()
        self.up1, self.down1 = nn.Linear(width, hidden), nn.Linear(hidden, width)
        self.up2, self.down2 = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.down1(F.gelu(self.up1(x)))  # ends in an all-reduce under TP
        return self.down2(F.gelu(self.up2(h))).square().mean()


def tp_mlp_plan() -> dict:
    """``parallelize_module`` plan for TPMLP: column-parallel up, row-parallel down."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {name: ColwiseParallel() if name.startswith("up") else RowwiseParallel()
            for name in ("up1", "down1", "up2", "down2")}


class ConvNet(nn.Module):
    """Conv -> BatchNorm -> ReLU stages and a linear classifier."""

    def __init__(self, channels: int = 16, stages: int = 3, classes: int = 10):
        super().__init__()
        layers, c_in = [], 3
        for _ in range(stages):
            layers += [nn.Conv2d(c_in, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU()]
            c_in = channels
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(channels, classes)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.features(images).mean(dim=(2, 3))
        return F.cross_entropy(self.classifier(x), labels)


def gpt_batch(cfg: GPTConfig, batch: int, seq: int | None = None, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    seq = seq or cfg.seq
    tokens = torch.randint(cfg.vocab, (batch, seq), generator=generator)
    targets = torch.randint(cfg.vocab, (batch, seq), generator=generator)
    return tokens, targets
