"""Rewrites of the joint graph before ckpt decides what to save.

Both work in place and return the same module: Inductor's joint graph object
stays the one that is partitioned (by ckpt, or by PyTorch on a fallback).
"""
from __future__ import annotations

import torch.fx as fx

import ckpt_compat as compat


def eliminate_dead_code(gm: fx.GraphModule) -> fx.GraphModule:
    """Removes nodes whose values nothing reads, unless they have side effects
    (FX's ``Graph.eliminate_dead_code`` by ``Node.is_impure``: mutations and
    random draws stay)."""
    if gm.graph.eliminate_dead_code():
        gm.recompile()
    return gm


def eliminate_common_subexpressions(gm: fx.GraphModule) -> fx.GraphModule:
    """Merges nodes that apply the same op to the same inputs into one, so a
    value is saved or recomputed once (torch's ``fx_graph_cse``, which leaves
    random ops, ``empty`` and values aliasing an output alone)."""
    compat.cse(gm)
    return gm


BEFORE_DECIDING = (eliminate_dead_code, eliminate_common_subexpressions)
"""What partitioners/partition.py runs on the joint graph, in this order."""
