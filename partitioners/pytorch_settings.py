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

Several regions in one graph, or a region beside ops outside it (which
PyTorch rejects), each keep their own budget (partitioners/regions.py): the
ops outside keep ckpt's budget, or functorch's. Under a ``peak:`` cap the
regions are the preferences and the cap the limit.
"""
from __future__ import annotations

import dataclasses

import torch.fx as fx

import ckpt_compat as compat
from .config import Config, MemoryBudget, warn_once

PYTORCH_DEFAULT_BUDGET = 1.0
"""torch._functorch.config.activation_memory_budget's default: no budget."""
_OPS = ("call_function", "call_method", "call_module")


def with_pytorch_budgets(config: Config, gm: fx.GraphModule) -> Config:
    """``config`` with the budget PyTorch's settings ask of Dynamo graph ``gm``."""
    budgets, outside = _region_budgets(gm)
    functorch = compat.functorch_memory_budget()
    own = config.memory_budget
    if own is None and functorch < PYTORCH_DEFAULT_BUDGET:
        own = MemoryBudget(fraction=functorch, pytorch_meaning=True)
    elif own is not None and functorch < PYTORCH_DEFAULT_BUDGET:
        warn_once(
            f"ckpt: memory_budget={own} is used; torch._functorch.config."
            f"activation_memory_budget={functorch:g} is not (ckpt's budget wins when both are set)"
        )
    if not budgets:
        return config if own is config.memory_budget else config.replace(memory_budget=own)
    whole = len(budgets) == 1 and not outside
    if whole and (own is None or not (own.is_peak or own.regional)):
        if own is not None and config.memory_budget is not None:
            warn_once(
                f"ckpt: region_activation_memory_budget({budgets[0]:g}) overrides memory_budget="
                f"{own} for the graphs it covers, as it overrides PyTorch's global setting"
            )
        return config.replace(memory_budget=MemoryBudget(fraction=budgets[0], pytorch_meaning=True))
    # Regions beside other ops, beside per-module budgets, or under a cap:
    # each region its own budget, the rest keeps ``own``.
    return config.replace(memory_budget=dataclasses.replace(own or MemoryBudget(), pytorch_regions=True))


def _region_budgets(gm: fx.GraphModule) -> tuple[list[float], int]:
    """The distinct region budgets in ``gm`` and how many ops are outside any region."""
    budgets, outside = set(), 0
    for node in gm.graph.nodes:
        if node.op not in _OPS:
            continue
        budget = compat.region_budget_of(node)
        if budget is None:
            outside += 1
        else:
            budgets.add(budget)
    return sorted(budgets), outside
