"""Rewrites of the forward and backward graphs extracted from a Plan.

Extraction keeps joint-graph order; these passes give each graph the order
and inputs it runs with. They are the ones torch's own partitioner applies
after its extraction.
"""
from __future__ import annotations

import torch.fx as fx

import ckpt_compat as compat


def reorder_recomputed_to_first_use(bwd: fx.GraphModule) -> fx.GraphModule:
    """Backward in the autograd engine's order: gradient ops in their order,
    each recomputed forward node placed just before its first use, so a
    recomputed value is not alive from the start of backward (torch's
    ``reordering_to_mimic_autograd_engine``; returns a new module)."""
    return compat.reorder_to_autograd_engine(bwd)


def raise_getitems(gm: fx.GraphModule) -> fx.GraphModule:
    """Moves each ``getitem`` right after the node whose tuple it reads, so a
    multi-output op's parts exist as soon as the op has run (torch's
    ``raise_getitems``; in place)."""
    return compat.raise_getitems(gm)


def thread_forward_rng_state(fwd: fx.GraphModule) -> fx.GraphModule:
    """Adds forward placeholders for the graph-safe RNG state that
    ``invoke_subgraph`` subgraphs with random ops expect, and passes them in
    (torch's ``thread_graphsafe_rng_from_hops``); other graphs are unchanged."""
    return compat.thread_graphsafe_rng_from_hops(fwd, is_backward=False)


def thread_backward_rng_state(bwd: fx.GraphModule) -> fx.GraphModule:
    """As ``thread_forward_rng_state``, for backward's RNG state."""
    return compat.thread_graphsafe_rng_from_hops(bwd, is_backward=True)


FORWARD = (raise_getitems, thread_forward_rng_state)
"""What partitioners/partition.py runs on the extracted forward graph, in order."""
BACKWARD = (reorder_recomputed_to_first_use, raise_getitems, thread_backward_rng_state)
"""What partitioners/partition.py runs on the extracted backward graph, in order."""
