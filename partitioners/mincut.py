"""The runtime-optimal saved set, as a minimum cut.

Each joint-graph node ``n`` becomes an edge ``(n, IN) -> (n, OUT)`` whose
capacity is what saving ``n`` costs (its bytes). Data edges between nodes,
"must be computed in backward" edges to the sink and "cannot be recomputed"
edges from the source are infinite. A finite cut separating source from
sink is then a set of values which, once saved, let backward run without
recomputing anything banned; the minimum cut is the fewest bytes.

Under a memory budget (budget.py) two things change: heavy ops may be
recomputed at a price (an edge from the source whose capacity is the op's
estimated runtime times a byte-per-second rate), and chosen segment
boundaries are forced into the saved set. Only edges to and from the
terminals change, so the search builds a joint graph's flow graph once
(``build_flow_graph``) and ``solve`` adds those edges for each cut.

The maximum flow is Dinic's algorithm over flat lists (a networkx graph
took most of the budget search's time: building it and its residual
network for every cut). The cut it reports is the one whose sink side is
what can still reach the sink: the same for every maximum flow, so the
saved set does not depend on the algorithm or on the order of the edges.
"""
from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Collection, Mapping

import torch.fx as fx

from .classify import GraphFacts, recompute_allowed, user_wants_recompute

SOURCE = 0
SINK = 1
IN = "in"
OUT = "out"
INFINITE = math.inf

# Ties between cuts of equal bytes are broken toward values closer to the
# backward pass (shorter recompute chains). Distances are clamped here and
# scaled below one byte, so the tie-break never outweighs a byte.
MAX_TIE_DISTANCE = 100


class PartitionError(RuntimeError):
    """The joint graph admits no valid partition under the policy."""


def byte_scale(facts: GraphFacts) -> int:
    """Capacity units per byte: room below one byte for the tie-breaks."""
    return (MAX_TIE_DISTANCE + 1) * len(facts.nodes) + 1


@dataclasses.dataclass(frozen=True)
class FlowGraph:
    """A joint graph's flow graph without its terminal edges, as lists.

    Vertices are numbers (SOURCE, SINK, then an IN and an OUT per forward
    node); arc ``a``'s residual twin is ``a ^ 1`` (capacity 0 to start).
    ``solve`` works on a copy: one FlowGraph serves every cut of a search."""

    facts: GraphFacts
    vertex: dict[tuple[fx.Node, str], int]
    heads: list[int]
    """Per arc, the vertex it enters."""
    arcs: list[list[int]]
    """Per vertex, the arcs leaving it, residual twins included."""
    capacities: list[float]
    terminals: dict[fx.Node, tuple[float, float, float]]
    """Per node, the capacities of its edges source -> IN, IN -> sink and
    OUT -> sink with no price and no forced save (0: no edge)."""


def build_flow_graph(facts: GraphFacts) -> FlowGraph:
    """The flow graph whose minimum cut is the cheapest saved set, less the
    terminal edges ``solve`` adds. Backward nodes are merged into the sink:
    they always run in backward."""
    scale = byte_scale(facts)
    backward_outputs = set(facts.backward_outputs)
    flow = FlowGraph(facts, vertex={}, heads=[], arcs=[[], []], capacities=[], terminals={})
    for node, node_facts in facts.nodes.items():
        if node in facts.backward:
            continue
        flow.terminals[node] = _terminal_capacities(node, facts, node in backward_outputs, {}, ())
        cost = _save_cost(node, facts, scale) if node_facts.savable else INFINITE
        add_edge(flow, _vertex(flow, node, IN), _vertex(flow, node, OUT), cost)
        read_in_backward = False
        for user in node.users:
            if user.op == "output":
                continue
            if user in facts.backward:
                read_in_backward = True  # one edge to the sink for all of them
            else:
                add_edge(flow, _vertex(flow, node, OUT), _vertex(flow, user, IN), INFINITE)
        if read_in_backward:
            add_edge(flow, _vertex(flow, node, OUT), SINK, INFINITE)
    return flow


def _vertex(flow: FlowGraph, node: fx.Node, side: str) -> int:
    """The number of ``node``'s IN or OUT vertex, added if new."""
    key = (node, side)
    if key not in flow.vertex:
        flow.vertex[key] = len(flow.arcs)
        flow.arcs.append([])
    return flow.vertex[key]


def _terminal_capacities(node: fx.Node, facts: GraphFacts, backward_output: bool,
                         recompute_price, forced_saves) -> tuple:
    """Capacities of ``node``'s edges source -> IN, IN -> sink, OUT -> sink
    (0: no edge). ``recompute_price`` lets an otherwise banned forward node
    be recomputed at that capacity; ``forced_saves`` must be saved."""
    forced = node in forced_saves
    out_to_sink = INFINITE if forced or backward_output else 0
    forward = node in facts.forward
    banned = forced or node in facts.inputs or node in facts.forced_saves or (
        forward and not recompute_allowed(facts.nodes[node])
    )
    if banned:
        return recompute_price.get(node, INFINITE) if not forced else INFINITE, 0, out_to_sink
    if forward and user_wants_recompute(facts.nodes[node]):
        return 0, INFINITE, out_to_sink
    return 0, 0, out_to_sink


def add_edge(flow: FlowGraph, tail: int, head: int, capacity: float) -> None:
    """Add the edge and its residual twin."""
    flow.arcs[tail].append(len(flow.heads))
    flow.arcs[head].append(len(flow.heads) + 1)
    flow.heads.extend((head, tail))
    flow.capacities.extend((capacity, 0))


def _save_cost(node: fx.Node, facts: GraphFacts, byte_scale: int) -> int:
    """Bytes saving ``node`` keeps alive (a view keeps its base), tie-break below a byte."""
    node_facts = facts.nodes[node]
    root = node_facts.storage_root
    root_bytes = 0 if root in facts.static_inputs else facts.nodes[root].nbytes
    if root is not node:
        # Prefer saving a base over a view of it: backward re-creates views for free.
        tie = MAX_TIE_DISTANCE
    elif node in facts.static_inputs:
        tie = 0
    else:
        tie = min(node_facts.dist_from_bw, MAX_TIE_DISTANCE)
    return root_bytes * byte_scale + tie


def solve(
    flow: FlowGraph,
    recompute_price: Mapping[fx.Node, int] | None = None,
    forced_saves: Collection[fx.Node] = (),
) -> list[fx.Node]:
    """The nodes whose values the minimum cut saves, in graph order.

    ``recompute_price`` lets otherwise banned forward nodes be recomputed at
    that capacity (in units of ``byte_scale``); ``forced_saves`` must be saved."""
    residual = _with_terminals(flow, recompute_price or {}, set(forced_saves))
    path = _infinite_path(residual)
    if path is not None:
        names = {v: node.name for (node, side), v in flow.vertex.items() if side == IN}
        raise PartitionError(
            "no finite cut: some value backward needs can neither be saved nor recomputed "
            "(infinite path through " + " -> ".join(names[v] for v in path if v in names) + ")"
        )
    reaches_sink = sink_side(residual)
    saved = []
    for node in flow.terminals:
        inside, outside = flow.vertex[(node, IN)], flow.vertex[(node, OUT)]
        if inside not in reaches_sink and outside in reaches_sink:
            saved.append(node)
    return saved


def _with_terminals(flow: FlowGraph, recompute_price, forced_saves) -> FlowGraph:
    """A copy of ``flow`` with the terminal edges of this cut added."""
    copy = dataclasses.replace(
        flow, heads=flow.heads[:], arcs=[vertex_arcs[:] for vertex_arcs in flow.arcs],
        capacities=flow.capacities[:],
    )
    changed = {
        # (with no forced save, only a backward output has an OUT -> sink edge)
        node: _terminal_capacities(node, flow.facts, bool(flow.terminals[node][2]), recompute_price, forced_saves)
        for node in {*recompute_price, *forced_saves} & flow.terminals.keys()
    }
    for node, base in flow.terminals.items():
        source_in, in_sink, out_sink = changed.get(node) or base
        for edge in (
            (SOURCE, flow.vertex[(node, IN)], source_in),
            (flow.vertex[(node, IN)], SINK, in_sink),
            (flow.vertex[(node, OUT)], SINK, out_sink),
        ):
            if edge[2]:
                add_edge(copy, *edge)
    return copy


def _infinite_path(flow: FlowGraph) -> list[int] | None:
    """The vertices of a source-to-sink path of infinite edges, if any."""
    heads, arcs, capacities = flow.heads, flow.arcs, flow.capacities
    parent = {SOURCE: None}
    queue = deque([SOURCE])
    while queue:
        tail = queue.popleft()
        for arc in arcs[tail]:
            head = heads[arc]
            if capacities[arc] == INFINITE and head not in parent:
                parent[head] = tail
                if head == SINK:
                    path = [SINK]
                    while parent[path[-1]] is not None:
                        path.append(parent[path[-1]])
                    return path[::-1]
                queue.append(head)
    return None


def sink_side(flow: FlowGraph) -> set[int]:
    """The vertices that can still reach the sink once the flow is maximum:
    the sink side of the minimum cut closest to the sink. ``flow`` must
    have a finite cut; its capacities are left residual."""
    heads, arcs, capacities = flow.heads, flow.arcs, flow.capacities
    while _augment_shortest_paths(heads, arcs, capacities):
        pass
    return _reaching_sink(heads, arcs, capacities)


def _augment_shortest_paths(heads, arcs, capacities) -> bool:
    """One phase of Dinic's algorithm: saturate every shortest augmenting
    path (a blocking flow). False when the sink is out of reach (the flow is
    maximum)."""
    level = _levels(heads, arcs, capacities)
    if level[SINK] < 0:
        return False
    next_arc = [0] * len(arcs)
    path: list[int] = []  # arcs from the source to ``at``
    at = SOURCE
    while True:
        if at == SINK:
            pushed = min(capacities[arc] for arc in path)
            for arc in path:
                capacities[arc] -= pushed
                capacities[arc ^ 1] += pushed
            # Back to the tail of the first arc the push saturated.
            first = next(i for i, arc in enumerate(path) if not capacities[arc])
            del path[first:]
            at = heads[path[-1]] if path else SOURCE
            continue
        vertex_arcs, i, wanted = arcs[at], next_arc[at], level[at] + 1
        while i < len(vertex_arcs) and not (
            capacities[vertex_arcs[i]] and level[heads[vertex_arcs[i]]] == wanted
        ):
            i += 1
        next_arc[at] = i
        if i < len(vertex_arcs):
            path.append(vertex_arcs[i])
            at = heads[vertex_arcs[i]]
        elif not path:
            return True
        else:  # a dead end: never try it again in this phase
            level[at] = -1
            path.pop()
            at = heads[path[-1]] if path else SOURCE


def _levels(heads, arcs, capacities) -> list[int]:
    """Per vertex, its distance from the source over arcs with capacity
    left (-1: out of reach); vertices beyond the sink's distance are left out."""
    level = [-1] * len(arcs)
    level[SOURCE] = 0
    frontier = [SOURCE]
    while frontier and level[SINK] < 0:
        following = []
        for tail in frontier:
            for arc in arcs[tail]:
                head = heads[arc]
                if level[head] < 0 and capacities[arc]:
                    level[head] = level[tail] + 1
                    following.append(head)
        frontier = following
    return level


def _reaching_sink(heads, arcs, capacities) -> set[int]:
    """Vertices with a path of arcs with capacity left to the sink."""
    reached = {SINK}
    stack = [SINK]
    while stack:
        head = stack.pop()
        for arc in arcs[head]:
            tail = heads[arc]  # arc ^ 1 runs from tail to head
            if tail not in reached and capacities[arc ^ 1]:
                reached.add(tail)
                stack.append(tail)
    return reached
