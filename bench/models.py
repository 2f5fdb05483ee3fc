"""Built-in models: no downloads, sizes set by arguments, deterministic init."""
from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def run_block(block: nn.Module, x: torch.Tensor, checkpoint_blocks: bool) -> torch.Tensor:
    """``block(x)``, under torch.utils.checkpoint when ``checkpoint_blocks`` is set
    and autograd records (checkpointing without grad would only cost time)."""
    if checkpoint_blocks and torch.is_grad_enabled():
        return checkpoint(block, x, use_reentrant=False)
    return block(x)


class MLP(nn.Module):
    """``depth`` x (Linear, LayerNorm, GELU) blocks and a linear head.

    ``checkpoint_blocks``: run each block under torch.utils.checkpoint (also
    settable later as an attribute, e.g. on a deep copy)."""

    def __init__(self, depth: int = 8, width: int = 512, checkpoint_blocks: bool = False):
        super().__init__()
        self.checkpoint_blocks = checkpoint_blocks
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width), nn.GELU())
            for _ in range(depth)
        )
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = run_block(block, x, self.checkpoint_blocks)
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
    """A GPT-style decoder returning the mean next-token cross-entropy.

    ``checkpoint_blocks``: run each decoder block under torch.utils.checkpoint."""

    def __init__(self, cfg: GPTConfig = GPTConfig(), checkpoint_blocks: bool = False):
        super().__init__()
        self.cfg = cfg
        self.checkpoint_blocks = checkpoint_blocks
        self.embed = nn.Embedding(cfg.vocab, cfg.width)
        self.pos = nn.Embedding(cfg.seq, cfg.width)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.depth))
        self.ln = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.pos(positions)
        for block in self.blocks:
            x = run_block(block, x, self.checkpoint_blocks)
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
    """Conv -> BatchNorm -> ReLU stages and a linear classifier.

    ``checkpoint_blocks``: run each stage under torch.utils.checkpoint. Its
    recompute runs BatchNorm again, so running statistics update twice per
    step (gradients are unchanged: the batch statistics are the same)."""

    STAGE_LAYERS = 3  # Conv2d, BatchNorm2d, ReLU

    def __init__(self, channels: int = 16, stages: int = 3, classes: int = 10,
                 checkpoint_blocks: bool = False):
        super().__init__()
        self.checkpoint_blocks = checkpoint_blocks
        layers, c_in = [], 3
        for _ in range(stages):
            layers += [nn.Conv2d(c_in, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU()]
            c_in = channels
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(channels, classes)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.checkpoint_blocks:
            # Slices of the one flat Sequential: the parameter names (and so
            # the canonical names in reports and goldens) stay as they are.
            x = images
            for start in range(0, len(self.features), self.STAGE_LAYERS):
                x = run_block(self.features[start:start + self.STAGE_LAYERS], x, True)
        else:
            x = self.features(images)
        x = x.mean(dim=(2, 3))
        return F.cross_entropy(self.classifier(x), labels)


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    depth: int = 2
    width: int = 64
    hidden: int = 128
    experts: int = 4
    top_k: int = 2
    seq: int = 32


class MoELayer(nn.Module):
    """Pre-norm top-k mixture of SwiGLU experts with a residual.

    The experts' weights are stacked parameters: a fused gate/up weight
    (E, d, 2h), split into its two halves (views of the parameter), and a
    down weight (E, h, d). torch.einsum applies them to every token densely
    (it permutes and reshapes the weights for its batched matmuls); each
    token's output is the sum of its top-k experts' outputs weighted by
    their renormalized router probabilities (the other experts get 0)."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.top_k = cfg.top_k
        self.ln = nn.LayerNorm(cfg.width)
        self.router = nn.Linear(cfg.width, cfg.experts, bias=False)
        scale_in, scale_out = cfg.width ** -0.5, cfg.hidden ** -0.5
        self.w_gate_up = nn.Parameter(torch.randn(cfg.experts, cfg.width, 2 * cfg.hidden) * scale_in)
        self.w_down = nn.Parameter(torch.randn(cfg.experts, cfg.hidden, cfg.width) * scale_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        probs = self.router(h).softmax(dim=-1)                         # (b, t, E)
        top_w, top_i = probs.topk(self.top_k, dim=-1)                  # (b, t, k)
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        gate = torch.zeros_like(probs).scatter(-1, top_i, top_w)       # (b, t, E)
        w_gate, w_up = self.w_gate_up.chunk(2, dim=-1)                 # (E, d, h) each
        hidden = (F.silu(torch.einsum("btd,edh->beth", h, w_gate))
                  * torch.einsum("btd,edh->beth", h, w_up))            # (b, E, t, h)
        down = torch.einsum("beth,ehd->betd", hidden, self.w_down)     # (b, E, t, d)
        return x + torch.einsum("betd,bte->btd", down, gate)


class MoE(nn.Module):
    """``depth`` top-k mixture-of-experts layers with einsum experts, a final
    LayerNorm, and a mean-square loss. Input: (batch, seq, width) floats.

    ``checkpoint_blocks``: run each layer under torch.utils.checkpoint."""

    def __init__(self, cfg: MoEConfig = MoEConfig(), checkpoint_blocks: bool = False):
        super().__init__()
        self.cfg = cfg
        self.checkpoint_blocks = checkpoint_blocks
        self.blocks = nn.ModuleList(MoELayer(cfg) for _ in range(cfg.depth))
        self.ln = nn.LayerNorm(cfg.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = run_block(block, x, self.checkpoint_blocks)
        return self.ln(x).square().mean()


def moe_batch(cfg: MoEConfig, batch: int, seed: int = 0):
    """Random inputs (batch, seq, width) for MoE, the same for the same seed."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, cfg.seq, cfg.width, generator=generator),)


def gpt_batch(cfg: GPTConfig, batch: int, seq: int | None = None, seed: int = 0):
    """Random (tokens, targets) of shape (batch, seq), the same for the same seed."""
    generator = torch.Generator().manual_seed(seed)
    seq = seq or cfg.seq
    tokens = torch.randint(cfg.vocab, (batch, seq), generator=generator)
    targets = torch.randint(cfg.vocab, (batch, seq), generator=generator)
    return tokens, targets


def image_batch(batch: int, size: int = 32, classes: int = 10, seed: int = 0):
    """Random (images, labels) for ConvNet, the same for the same seed."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(batch, 3, size, size, generator=generator)
    labels = torch.randint(classes, (batch,), generator=generator)
    return images, labels


def mlp_batch(batch: int, width: int, seed: int = 0):
    """Random inputs (batch, width) for MLP, the same for the same seed."""
    return (torch.randn(batch, width, generator=torch.Generator().manual_seed(seed)),)
