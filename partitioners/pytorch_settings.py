"""PyTorch's own activation-budget settings, honored by ckpt: a user moving
from torch.compile's default to ``backend="ckpt"`` keeps them.

Both keep PyTorch's meaning: at most ``b`` of the runtime-optimal saved
bytes, a hard limit (0.0 saves no more than checkpointing the whole region
would), reached ckpt's way (the cheapest recomputation within it).

- ``torch._functorch.config.activation_memory_budget`` (what torchtitan's
  memory-budget mode sets): used when no ckpt budget is set; when both
  are, ckpt's wins and a warning says so once.
- ``torch.autograd.graph.region_activation_memory_budget(b)`` around code in
  a compiled region: the budget of the graph it covers. It overrides ckpt's
  fraction or byte budget for that graph, as it overrides PyTorch's global
  setting; a ``peak:`` cap stays the limit.

ckpt plans one budget per graph for now. PyTorch rejects a region that does
not cover the whole graph, and conflicting regions in one graph; ckpt
applies the tightest region's budget to the whole graph instead, with a
warning that names how many ops it also covers (a graph break between
regions gives each its own graph and budget).
"""
from __future__ import annotations

import torch.fx as fx

import ckpt_compat as compat
from .config import Config, MemoryBudget, warn_once

PYTORCH_DEFAULT_BUDGET = 1.0
"""torch._functorch.config.activation_memory_budget's default: no budget."""
_OPS = ("call_function", "call_method", "call_module")


def with_pytorch_budgets(config: Config, gm: fx.GraphModule) -> Config:
    """``config`` with the budget PyTorch's settings ask of Dynamo graph ``gm``."""
    region = _region_budget(gm)
    if region is not None:
        if config.memory_budget is not None and config.memory_budget.is_peak:
            warn_once(
                f"ckpt: memory_budget={config.memory_budget} is a cap on the step and stays the "
                f"limit; region_activation_memory_budget({region:g}) in this graph is not combined "
                "with a peak: cap yet. Set a fraction or byte budget instead of the cap to use the region's"
            )
            return config
        if config.memory_budget is not None:
            warn_once(
                f"ckpt: region_activation_memory_budget({region:g}) overrides memory_budget="
                f"{config.memory_budget} for the graphs it covers, as it overrides PyTorch's global setting"
            )
        return config.replace(memory_budget=MemoryBudget(fraction=region, pytorch_meaning=True))
    value = compat.functorch_memory_budget()
    if value >= PYTORCH_DEFAULT_BUDGET:
        return config
    if config.memory_budget is None:
        return config.replace(memory_budget=MemoryBudget(fraction=value, pytorch_meaning=True))
    warn_once(
        f"ckpt: memory_budget={config.memory_budget} is used; torch._functorch.config."
        f"activation_memory_budget={value:g} is not (ckpt's budget wins when both are set)"
    )
    return config


def _region_budget(gm: fx.GraphModule) -> float | None:
    """The region budget for ``gm``: the tightest of its regions (None: no region)."""
    budgets, outside = set(), 0
    for node in gm.graph.nodes:
        if node.op not in _OPS:
            continue
        budget = compat.region_budget_of(node)
        if budget is None:
            outside += 1
        else:
            budgets.add(budget)
    if not budgets:
        return None
    tightest = min(budgets)
    if len(budgets) > 1 or outside:
        parts = []
        if len(budgets) > 1:
            parts.append(f"regions of budgets {', '.join(f'{b:g}' for b in sorted(budgets))}")
        if outside:
            parts.append(f"{outside} op(s) outside any region")
        warn_once(
            f"ckpt: one compiled graph holds {' and '.join(parts)}; ckpt plans one budget per graph "
            f"for now and applies the tightest, {tightest:g}, to all of it. A torch._dynamo.graph_break() "
            "between regions gives each its own graph and budget"
        )
    return tightest

