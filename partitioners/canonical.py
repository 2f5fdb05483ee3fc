"""Canonical names for joint-graph nodes: stable across runs and edits elsewhere.

A node is named by the module that produced it and its op, counted within
that module: ``blocks.0.fc/addmm``, ``blocks.0.ln1/mul#2``. Inputs are
``input:K``. The names do not depend on the Dynamo and AOTAutograd name
counters (``addmm_17``), so adding a layer at the end of a model does not
rename everything before it.
"""
from __future__ import annotations

import collections
import hashlib
import json
import operator
import re

import torch.fx as fx

import ckpt_compat as compat

# Dynamo writes module paths as "L['self'].blocks.0.fc"; where the frame is
# a wrapper of forward (transformers decorates its models' forward), the
# module is the wrapper's first argument: "L['args'][0].model.layers.0".
DYNAMO_ROOT = re.compile(r"^L\[['\"](?:args['\"]\]\[0\]|[^'\"]*['\"]\])\.?")
"""Dynamo's name for the frame's module (``L['self'].``, ``L['args'][0].``),
whatever its argument is called."""


def canonical_names(graph: fx.Graph) -> dict[fx.Node, str]:
    names: dict[fx.Node, str] = {}
    counts: collections.Counter[str] = collections.Counter()
    for node in graph.nodes:
        if node.op == "placeholder":
            kind = "tangent" if compat.is_tangent(node) else "input"
            names[node] = f"{kind}:{counts[kind]}"
            counts[kind] += 1
            continue
        base = f"{module_path(node)}/{op_label(node)}"
        counts[base] += 1
        names[node] = base if counts[base] == 1 else f"{base}#{counts[base]}"
    return names


def module_path(node: fx.Node) -> str:
    """The innermost module that produced the node, or ``-`` when unknown
    (backward nodes, code outside any submodule, Inductor's fused seeds)."""
    stack = compat.module_stack(node)
    if not stack:
        return "-"
    paths = [path for path, _ in stack.values()]
    # A function transformers registers as a kernel (``G[...].apply_rotary_pos_emb``)
    # enters the stack too: the node is the frame's module's.
    path = next((p for p in reversed(paths) if DYNAMO_ROOT.match(p)), paths[-1])
    return DYNAMO_ROOT.sub("", path) or "-"


def op_label(node: fx.Node, *, overload: bool = False) -> str:
    """A short op name: ``addmm`` (``addmm.default`` with ``overload``);
    a tuple element is ``op[i]``."""
    if node.op != "call_function":
        return node.op
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        return f"{op_label(node.args[0], overload=overload)}[{node.args[1]}]"
    target = node.target
    packet = getattr(target, "_overloadpacket", None)
    if packet is not None and not overload:
        return packet.__name__
    return getattr(target, "__name__", str(target))


def structure_digest(nodes, names: dict[fx.Node, str]) -> str:
    """A short digest of a graph's structure (canonical names, ops, shapes,
    edges), independent of any decision: the same graph gets the same digest
    on every run, rank and setting."""
    structure = [
        [names[n], op_label(n), shape_of(n), [names[a] for a in n.all_input_nodes]]
        for n in nodes
    ]
    return hashlib.sha256(json.dumps(structure).encode()).hexdigest()[:12]


def shape_of(node: fx.Node) -> list:
    """A tensor node's shape (symbolic sizes by name); ``[]`` for other values."""
    value = node.meta.get("val")
    if not hasattr(value, "shape"):
        return []
    return [int(d) if isinstance(d, int) else str(d) for d in value.shape]
