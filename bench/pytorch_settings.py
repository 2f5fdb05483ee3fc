"""PyTorch's own budget settings under torch.compile's default and under
ckpt: saved bytes of a 4-block MLP (Linear, LayerNorm, GELU; d=256), as the
issue that asked for them measured it.

    python -m bench.pytorch_settings              # batch 512
    python -m bench.pytorch_settings --batch 128

Saved bytes: what autograd saves for backward, parameters and the input
excluded (saved-tensor hooks, bench.measure.count_saved_bytes). Prints a
markdown table.
"""
from __future__ import annotations

import argparse

import torch
import torch._dynamo
import torch.nn as nn

from bench.measure import count_saved_bytes
from ckpt import make_backend

WIDTH = 256


class RegionBlocks(nn.Module):
    """Four blocks and a mean, the forward inside
    ``region_activation_memory_budget(budget)`` (None: no region);
    ``loss_outside``: the mean after the region."""

    def __init__(self, budget: float | None = None, loss_outside: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.Sequential(
            *(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH), nn.GELU()) for _ in range(4))
        )
        self.budget, self.loss_outside = budget, loss_outside

    def forward(self, x):
        if self.budget is None:
            return self.blocks(x).mean()
        with torch.autograd.graph.region_activation_memory_budget(self.budget):
            y = self.blocks(x)
            if not self.loss_outside:
                return y.mean()
        return y.mean()


def saved_bytes(model: nn.Module, backend, batch: int = 512, functorch_budget: float | None = None) -> int:
    """Bytes the compiled model saves for backward in one step."""
    torch._dynamo.reset()
    x = torch.randn(batch, WIDTH)
    patch = {} if functorch_budget is None else {"activation_memory_budget": functorch_budget}
    with torch._functorch.config.patch(**patch), torch.compiler.config.patch(force_disable_caches=True):
        compiled = torch.compile(model, backend=backend)
        with count_saved_bytes(exclude=[*model.parameters(), x]) as saved:
            loss = compiled(x)
        loss.backward()
    return saved["bytes"]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.pytorch_settings", description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=512)
    args = p.parse_args(argv)
    settings = [
        ("none", lambda: RegionBlocks(), None),
        ("region_activation_memory_budget(0.0) around the forward", lambda: RegionBlocks(0.0), None),
        ("region_activation_memory_budget(0.5) around the forward", lambda: RegionBlocks(0.5), None),
        ("functorch activation_memory_budget = 0.0", lambda: RegionBlocks(), 0.0),
        ("functorch activation_memory_budget = 0.5", lambda: RegionBlocks(), 0.5),
    ]
    print(f"| setting (4-block MLP, d={WIDTH}, batch {args.batch}) | torch.compile saved bytes | ckpt saved bytes |")
    print("|---|---|---|")
    for name, model, functorch_budget in settings:
        pytorch = saved_bytes(model(), "inductor", args.batch, functorch_budget)
        ckpt = saved_bytes(model(), make_backend(strict=True), args.batch, functorch_budget)
        print(f"| {name} | {pytorch:,} | {ckpt:,} |", flush=True)


if __name__ == "__main__":
    main()
