"""Estimated peak bytes of backward for a saved set, by a liveness walk.

Backward runs as the extracted graph will (partitioners/_torch_compat.py
reorders it like the autograd engine): backward nodes in joint-graph order,
each recomputed forward node placed just before its first user. Saved values
and tangents are alive from the start; a value is freed after its last use;
gradients stay alive to the end. Views and tuple elements share their
owner's storage. Parameters are not counted: they are alive anyway.

Fusion is modelled coarsely, as Inductor does it: a pointwise result read
by exactly one pointwise user is computed inside that user's kernel and never
allocated. The walk is for comparing plans, not for predicting bytes.
"""
from __future__ import annotations

import operator

import torch.fx as fx

from .classify import GraphFacts
from .ops import OpCategory

# Categories Inductor fuses into the kernel of a consumer.
FUSIBLE = frozenset({
    OpCategory.POINTWISE, OpCategory.SEEDED_RANDOM, OpCategory.DATA_MOVEMENT,
    OpCategory.CONSTANT, OpCategory.VIEW, OpCategory.GETITEM,
})


def backward_schedule(facts: GraphFacts, saved: set[fx.Node]) -> list[fx.Node]:
    """Nodes backward runs, in order: recomputed nodes just before their first use."""
    done: set[fx.Node] = set(saved)
    backward_outputs = set(facts.backward_outputs)
    order: list[fx.Node] = []
    for node in facts.nodes:  # graph order
        if node in facts.backward or node in backward_outputs:
            _schedule(node, facts, done, order)
    return order


def _schedule(root: fx.Node, facts: GraphFacts, done: set, order: list) -> None:
    stack = [(root, False)]
    while stack:
        node, inputs_ready = stack.pop()
        if node in done:
            continue
        if inputs_ready:
            done.add(node)
            order.append(node)
            continue
        stack.append((node, True))
        stack.extend((arg, False) for arg in reversed(node.all_input_nodes) if arg not in done)


def estimate_backward_peak(facts: GraphFacts, saved) -> int:
    """Peak bytes alive during backward (saved values included) for ``saved``."""
    saved = set(saved)
    order = backward_schedule(facts, saved)
    owner = {node: _owner(node, facts, saved) for node in order}
    last_use: dict[fx.Node, int] = {}
    for step, node in enumerate(order):
        last_use[owner[node]] = max(last_use.get(owner[node], step), step)
        for arg in node.all_input_nodes:
            key = owner.get(arg) or _owner(arg, facts, saved)
            last_use[key] = step
    keep = {_owner(n, facts, saved) for n in facts.backward_outputs}

    # Alive from the start: the storages saved values keep (inputs excluded).
    held = facts.saved_storages(saved)
    live = sum(facts.nodes[n].nbytes for n in held)
    frees: dict[int, list[fx.Node]] = {}
    for key, step in last_use.items():
        if key not in keep:
            frees.setdefault(step, []).append(key)
    peak = live
    for step, node in enumerate(order):
        if owner[node] is node and node not in held and not _fused_away(node, facts):
            held.add(node)
            live += facts.nodes[node].nbytes
        peak = max(peak, live)
        for freed in frees.get(step, ()):
            if freed in held:
                held.discard(freed)
                live -= facts.nodes[freed].nbytes
    return peak


def _fused_away(node: fx.Node, facts: GraphFacts) -> bool:
    """A pointwise result whose only reader is pointwise fuses into it."""
    if facts.nodes[node].category not in FUSIBLE or node in facts.backward_outputs:
        return False
    users = [user for user in node.users if user.op != "output"]
    return len(users) == 1 and users[0].op != "output" and facts.nodes[users[0]].category in FUSIBLE


def _owner(node: fx.Node, facts: GraphFacts, saved: set[fx.Node]) -> fx.Node:
    """The node whose allocation holds ``node``'s value: a view's base, a
    recomputed tuple element's tuple, or the node itself."""
    while True:
        root = facts.nodes[node].storage_root
        if root is not node:
            node = root
        elif node.target is operator.getitem and node not in saved:
            node = node.args[0]
        else:
            return node
