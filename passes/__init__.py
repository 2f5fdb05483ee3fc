"""FX graph rewrites around the partition, each a ``GraphModule -> GraphModule``
function whose docstring says what it changes:

- joint.py: on the joint graph, before ckpt decides (dead code, common
  subexpressions), so each value is decided once; and, under a budget,
  the late matmul adds partitioners/partition.py may unfold and refold;
- partitioned.py: on the forward and backward graphs extracted from a Plan
  (recomputed nodes moved to their first use, getitems, RNG state).

Passes decide nothing. They reach torch's private APIs through
ckpt_compat (the bottom layer) and import nothing else of the project;
partitioners/partition.py runs them.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch.fx as fx

Pass = Callable[[fx.GraphModule], fx.GraphModule]


def run_passes(passes: Iterable[Pass], gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` after each of ``passes`` in turn."""
    for graph_pass in passes:
        gm = graph_pass(gm)
    return gm
