"""Classify a joint graph: which nodes forward needs, which backward needs,
and each node's op category, bytes and user checkpoint tag; and the facts a
saved set implies (the bytes it keeps, the nodes backward then recomputes).

Facts live in a side mapping (``GraphFacts.nodes``), never on ``fx.Node``.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

import ckpt_compat as compat
from .cost import is_savable_value, node_bytes
from .ops import OpCategory, Recompute, categorize

Policy = compat.CheckpointPolicy


@dataclasses.dataclass(frozen=True)
class NodeFacts:
    category: OpCategory
    nbytes: int
    savable: bool
    user_tag: Policy | None
    """The policy a user's torch.utils.checkpoint region put on the node."""
    region_boundary: bool
    """Tagged recompute, but read by a later checkpoint region: like eager
    checkpointing, the boundary between two regions is kept."""
    dist_from_bw: int
    """Edges to the nearest backward user (0 for backward nodes)."""
    storage_root: fx.Node
    """The node that owns this value's storage: itself, or a view's base."""


@dataclasses.dataclass(frozen=True)
class GraphFacts:
    nodes: dict[fx.Node, NodeFacts]
    forward: frozenset[fx.Node]
    """Nodes the forward graph computes (ancestors of the forward outputs)."""
    backward: frozenset[fx.Node]
    """Nodes that can only run in backward (they depend on tangents)."""
    backward_outputs: tuple[fx.Node, ...]
    inputs: frozenset[fx.Node]
    """Primal inputs and forward RNG seeds: available in forward only."""
    static_inputs: frozenset[fx.Node]
    """Parameters and buffers: alive all step, so free to save."""
    forced_saves: frozenset[fx.Node]
    """Sources of input mutations repeated in backward: saving them is the only
    way not to apply a mutation twice."""
    relaid_inputs: frozenset[fx.Node] = frozenset()
    """Inputs Inductor copies channels-last for a convolution: saved, it is
    the copy that backward keeps, so saving them costs bytes."""
    forward_outputs: tuple[fx.Node, ...] = ()
    """What forward returns to the caller (the loss, logits...)."""
    input_positions: dict[fx.Node, int] = dataclasses.field(default_factory=dict)
    """Each primal's index among the arguments Dynamo calls the compiled
    graph with; effect tokens and inputs AOTAutograd made have none."""
    input_gradient_positions: tuple[tuple[int, fx.Node], ...] = ()
    """(position, gradient) of the backward outputs that are gradients of
    inputs other than parameters and buffers: the activations an earlier graph handed this one (a
    block's input under per-block compile), whose gradients the earlier
    graph's backward reads and frees, unlike a parameter's, which stays in
    ``.grad``. Empty where the graph does not say which inputs are static.
    A leaf the user hands in with requires_grad is one too, though its
    gradient stays (a prompt-tuning embedding): the step model misses it."""
    derived: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)
    """What later modules build from these facts once per graph and keep
    for its lifetime (partitioners/peak's ``LoweredGraph``, per Inductor
    setting), keyed by their builder; not part of the facts themselves."""

    @property
    def input_gradients(self) -> frozenset[fx.Node]:
        """The gradients of ``input_gradient_positions``."""
        return frozenset(gradient for _, gradient in self.input_gradient_positions)

    @property
    def free_inputs(self) -> frozenset[fx.Node]:
        """Inputs whose saving keeps nothing alive the caller does not hold."""
        return self.inputs - self.relaid_inputs

    def saved_storages(self, saved) -> set[fx.Node]:
        """The storages saving ``saved`` keeps alive beyond what the caller holds."""
        return {self.nodes[node].storage_root for node in saved} - self.free_inputs


def graph_device(nodes) -> torch.device | None:
    """The device of the first tensor value among a graph's ``nodes`` (None: no tensors)."""
    for node in nodes:
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor):
            return value.device
    return None


def activation_bytes(facts: GraphFacts, saved) -> int:
    """Bytes that saving ``saved`` keeps alive beyond the graph inputs, each storage once."""
    return sum(facts.nodes[root].nbytes for root in facts.saved_storages(saved))


def recomputed_nodes(facts: GraphFacts, saved: set[fx.Node]) -> set[fx.Node]:
    """Forward nodes backward needs that are not saved: backward re-runs them."""
    needed, _ = _backward_reads(facts, saved)
    return {n for n in needed if n in facts.forward}


def read_by_backward(facts: GraphFacts, saved) -> list[fx.Node]:
    """The values of ``saved`` that backward reads, in order. A forced
    segment boundary may be read by no one (the next boundary, or a value
    after it, serves backward instead): torch's extraction drops such a value
    from the saved set, so counting it would overstate the saved bytes."""
    saved = list(saved)
    _, read = _backward_reads(facts, set(saved))
    read |= set(facts.backward_outputs)
    return [node for node in saved if node in read]


def _backward_reads(facts: GraphFacts, saved: set[fx.Node]) -> tuple[set[fx.Node], set[fx.Node]]:
    """Walking back from backward: the unsaved nodes it needs, and the saved
    values where the walk stops (those backward reads)."""
    needed: set[fx.Node] = set()
    read: set[fx.Node] = set()
    stack = [
        arg
        for node in list(facts.backward) + list(facts.backward_outputs)
        for arg in node.all_input_nodes
    ]
    while stack:
        node = stack.pop()
        if node in saved:
            read.add(node)
        elif node not in needed and node not in facts.backward:
            needed.add(node)
            stack.extend(node.all_input_nodes)
    return needed, read


def classify(
    joint_gm: fx.GraphModule,
    *,
    num_fwd_outputs: int,
    static_lifetime_input_indices: list[int] | None = None,
) -> GraphFacts:
    graph = joint_gm.graph
    (output,) = graph.find_nodes(op="output")
    outputs = _flatten(output.args[0])
    forward_outputs = [o for o in outputs[:num_fwd_outputs] if isinstance(o, fx.Node)]
    backward_outputs = tuple(o for o in outputs[num_fwd_outputs:] if isinstance(o, fx.Node))

    backward = compat.backward_nodes(graph)
    forward = _ancestors(
        forward_outputs + [n for n in graph.nodes if compat.must_be_in_forward(n)],
        exclude=backward,
    )
    placeholders = graph.find_nodes(op="placeholder")
    primals = [p for p in placeholders if compat.is_primal(p)]
    positions = _argument_positions(primals)
    static_inputs = _static_inputs(primals, static_lifetime_input_indices or ())
    input_gradient_positions = (
        () if static_lifetime_input_indices is None
        else _input_gradients(output, num_fwd_outputs, primals, positions, static_inputs)
    )
    inputs = frozenset(primals + [p for p in placeholders if compat.is_fwd_seed_offset(p)])

    dist = _distance_from_backward(graph, forward)
    nodes: dict[fx.Node, NodeFacts] = {}
    for node in graph.nodes:
        if node.op == "output":
            continue
        category = categorize(node, node_bytes)
        nodes[node] = NodeFacts(
            category=category,
            nbytes=node_bytes(node),
            savable=is_savable_value(node),
            user_tag=node.meta.get("recompute"),
            region_boundary=_is_region_boundary(node),
            dist_from_bw=dist[node],
            storage_root=_storage_root(node, category, nodes),
        )
    return GraphFacts(
        nodes=nodes,
        forward=frozenset(forward),
        backward=frozenset(backward),
        backward_outputs=backward_outputs,
        inputs=inputs,
        static_inputs=static_inputs,
        forced_saves=frozenset(_mutation_sources_repeated_in_backward(graph)),
        relaid_inputs=_relaid_inputs(joint_gm, inputs),
        forward_outputs=tuple(forward_outputs),
        input_positions=positions,
        input_gradient_positions=input_gradient_positions,
    )


def _relaid_inputs(joint_gm: fx.GraphModule, inputs: frozenset[fx.Node]) -> frozenset[fx.Node]:
    convolutions = joint_gm.graph.find_nodes(op="call_function", target=torch.ops.aten.convolution.default)
    if not convolutions or not compat.inductor_relayouts_convolutions(joint_gm):
        return frozenset()
    return frozenset(arg for conv in convolutions for arg in conv.args[:2] if arg in inputs)


def recompute_allowed(facts: NodeFacts) -> bool:
    """Whether the op policy, together with the user's tag, lets a node be recomputed."""
    policy = facts.category.policy
    if policy is Recompute.MUST_SAVE or facts.region_boundary:
        return False
    if facts.user_tag in (Policy.MUST_SAVE, Policy.PREFER_SAVE):
        return False
    if user_wants_recompute(facts):
        return True
    return policy is Recompute.CHEAP


def user_wants_recompute(facts: NodeFacts) -> bool:
    """Tagged recompute by a checkpoint region, and safe to honor."""
    return (
        facts.user_tag in (Policy.MUST_RECOMPUTE, Policy.PREFER_RECOMPUTE)
        and facts.category.policy is not Recompute.MUST_SAVE
        and not facts.region_boundary
    )


def _storage_root(node: fx.Node, category: OpCategory, earlier: dict) -> fx.Node:
    # Every aten view op aliases its first argument.
    if category is OpCategory.VIEW and node.args and isinstance(node.args[0], fx.Node):
        return earlier[node.args[0]].storage_root
    # An element of a multi-output view op (split, chunk, unbind) aliases
    # that op's input too: a chunk of a parameter is the parameter's storage.
    if category is OpCategory.GETITEM and earlier[node.args[0]].category is OpCategory.VIEW:
        return earlier[node.args[0]].storage_root
    return node


def _is_region_boundary(node: fx.Node) -> bool:
    region = node.meta.get("ac_graph_id")
    if region is None or not _tagged_recompute(node):
        return False
    return any(
        _tagged_recompute(user) and user.meta.get("ac_graph_id", region) > region
        for user in node.users
    )


def _tagged_recompute(node: fx.Node) -> bool:
    return node.meta.get("recompute") in (Policy.MUST_RECOMPUTE, Policy.PREFER_RECOMPUTE)


def _argument_positions(primals: list[fx.Node]) -> dict[fx.Node, int]:
    """Each primal's index among the arguments the compiled graph is called
    with (the step view names a call's inputs by it). From AOTAutograd's
    descriptors where the graph has them: effect tokens and inputs AOTAutograd
    made itself have none. Otherwise the primals' order."""
    if all("desc" in p.meta for p in primals):
        indices = {p: compat.argument_index(p) for p in primals}
        return {p: index for p, index in indices.items() if index is not None}
    return {p: index for index, p in enumerate(primals)}


def _static_inputs(primals: list[fx.Node], static_indices) -> frozenset[fx.Node]:
    # AOTAutograd counts static inputs before it prepends effect tokens to
    # the primals (torch's own partitioner reads them shifted by the tokens).
    counted = [p for p in primals if not compat.is_effect_token(p)]
    static = set(static_indices)
    return frozenset(p for index, p in enumerate(counted) if index in static)


def _input_gradients(output: fx.Node, num_fwd_outputs: int, primals: list[fx.Node],
                     positions: dict[fx.Node, int], static: frozenset[fx.Node]) -> tuple[tuple[int, fx.Node], ...]:
    """(position, gradient) of the gradients of primals that are not static
    inputs (position -1: an input that is no argument as is, a synthetic
    base). A gradient is paired with its primal by AOTAutograd's
    descriptors where the graph has them, else by order (one output per
    primal, None where there is none); none where neither is known."""
    pairs = _gradient_pairs(output, num_fwd_outputs, primals)
    return tuple(
        (positions.get(primal, -1), gradient) for primal, gradient in pairs
        if isinstance(gradient, fx.Node) and primal not in static
    )


def _gradient_pairs(output: fx.Node, num_fwd_outputs: int, primals: list[fx.Node]) -> list[tuple]:
    flat = list(output.args[0]) if isinstance(output.args[0], (list, tuple)) else None
    owners = compat.gradient_of(output)
    if flat is not None and owners is not None and len(owners) == len(flat):
        primal_of = {p.meta["desc"]: p for p in primals if "desc" in p.meta}
        return [(primal_of[owner], gradient) for owner, gradient in zip(owners, flat) if owner in primal_of]
    gradients = _flatten(output.args[0])[num_fwd_outputs:]
    return list(zip(primals, gradients)) if len(gradients) == len(primals) else []


def _flatten(value) -> list:
    if isinstance(value, (list, tuple)):
        return [leaf for item in value for leaf in _flatten(item)]
    return [value]


def _ancestors(roots: list[fx.Node], exclude: set[fx.Node]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = [r for r in roots if r not in exclude]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        stack.extend(a for a in node.all_input_nodes if a not in exclude)
    return seen


def _distance_from_backward(graph: fx.Graph, forward: set[fx.Node]) -> dict[fx.Node, int]:
    """Edges from each node to its nearest user outside the forward graph."""
    unreachable = len(graph.nodes)
    dist: dict[fx.Node, int] = {}
    for node in reversed(graph.nodes):
        if node.op == "output":
            continue
        if node not in forward:
            dist[node] = 0
            continue
        users = [dist[u] + 1 for u in node.users if u.op != "output"]
        dist[node] = min(users, default=unreachable)
    return dist


def _mutation_sources_repeated_in_backward(graph: fx.Graph) -> list[fx.Node]:
    """Values copied into an input in forward when backward mutates that input too.

    AOTAutograd emits input mutations as copy_ nodes at the end of the joint
    graph; recomputing such a source would replay the forward mutation.
    """
    mutated_in_backward: set[fx.Node] = set()
    sources = []
    for node in reversed(graph.nodes):
        if node.op == "output":
            continue
        if node.target is not torch.ops.aten.copy_.default:
            break
        if compat.must_be_in_backward(node):
            mutated_in_backward.add(node.args[0])
        elif compat.must_be_in_forward(node) and node.args[0] in mutated_in_backward:
            sources.append(node.args[1])
    return sources
