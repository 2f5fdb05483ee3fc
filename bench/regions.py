"""Per-module budgets measured: saved bytes and step peak of a two-stack
model (a "vision" stack then a "text" stack of transformer MLP blocks),
with the budget on the vision stack only, against no budget and a uniform
0.0, compiled whole, per block (the backend given the model) and with a
graph break inside every block.

    python -m bench.regions                 # d=256, 4+4 blocks, batch 1024
    python -m bench.regions --steps 6

Saved bytes: saved-tensor hooks (bench.measure.count_saved_bytes), the
parameters and input excluded; peak: the profiler's memory events of the
last step (CPU), above what is live before it. Losses are compared with
torch.compile's, bit for bit. Prints a markdown table.
"""
from __future__ import annotations

import argparse

import torch
import torch._dynamo
import torch.nn as nn

from bench.measure import count_saved_bytes, peak_cpu_bytes
from ckpt import make_backend


class Block(nn.Module):
    def __init__(self, width: int, graph_break: bool):
        super().__init__()
        self.norm, self.graph_break = nn.LayerNorm(width), graph_break
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        hidden = torch.nn.functional.gelu(self.up(self.norm(x)))
        if self.graph_break:
            torch._dynamo.graph_break()
        return x + self.down(hidden)


class TwoStacks(nn.Module):
    def __init__(self, width: int, depth: int, graph_break: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.vision = nn.Sequential(*(Block(width, graph_break) for _ in range(depth)))
        self.text = nn.Sequential(*(Block(width, graph_break) for _ in range(depth)))

    def forward(self, x):
        return self.text(self.vision(x)).pow(2).mean()


def run(layout: str, budget, args) -> dict:
    """One mode: the losses of ``args.steps`` steps, the last step's saved bytes and peak."""
    torch._dynamo.reset()
    model = TwoStacks(args.width, args.depth, graph_break=layout == "graph-broken")
    def backend():
        return "inductor" if budget == "compile" else make_backend(
            strict=True, model=model, **({} if budget is None else {"memory_budget": budget}))

    if layout == "per-block":
        # One backend per block: Dynamo shares a graph between identical
        # blocks compiled with one backend, and so would their plan.
        for block in [*model.vision, *model.text]:
            block.compile(backend=backend())
        step_model = model
    else:
        step_model = torch.compile(model, backend=backend())
    x = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(1))
    losses = []

    def step():
        model.zero_grad(set_to_none=True)
        loss = step_model(x)
        loss.backward()
        losses.append(loss.detach().clone())

    for _ in range(args.steps - 1):
        step()
    with count_saved_bytes(exclude=[*model.parameters(), x]) as saved:
        peak = peak_cpu_bytes(step)
    return {"losses": losses, "saved": saved["bytes"], "peak": peak}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.regions", description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--layouts", nargs="+", default=["whole", "per-block", "graph-broken"])
    args = p.parse_args(argv)
    modes = [
        ("whole", "compile"), ("whole", None), ("whole", 0.0), ("whole", {"vision": 0.0}),
        ("per-block", "compile"), ("per-block", None), ("per-block", 0.0), ("per-block", {"vision": 0.0}),
        ("graph-broken", "compile"), ("graph-broken", None), ("graph-broken", {"vision": 0.0}),
    ]
    reference = {}
    print(f"| layout (d={args.width}, {args.depth}+{args.depth} blocks, batch {args.batch}) | mode | "
          "saved MiB | peak MiB | losses vs torch.compile |")
    print("|---|---|---|---|---|")
    for layout, budget in modes:
        if layout not in args.layouts:
            continue
        result = run(layout, budget, args)
        name = "torch.compile" if budget == "compile" else "ckpt" if budget is None else f"ckpt, memory_budget={budget}"
        if budget == "compile":
            reference[layout] = result["losses"]
        compile_losses = reference.get(layout, reference.get("whole"))
        if compile_losses is None:
            same = "(torch.compile not run)"
        else:
            same = "bitwise" if all(torch.equal(a, b) for a, b in zip(result["losses"], compile_losses)) else (
                f"max rel {max(((a - b).abs() / b.abs()).item() for a, b in zip(result['losses'], compile_losses)):.1e}")
        print(f"| {layout} | {name} | {result['saved'] / 2**20:.2f} | {result['peak'] / 2**20:.2f} | {same} |",
              flush=True)


if __name__ == "__main__":
    main()
