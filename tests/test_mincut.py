"""The maximum flow of mincut.py against networkx's on random graphs."""
import random

import networkx as nx
import pytest
import torch
import torch.fx as fx
from networkx.algorithms.flow import shortest_augmenting_path

from partitioners.mincut import IN, INFINITE, SINK, SOURCE, FlowGraph, PartitionError, add_edge, sink_side, solve


def _random_graph(rng: random.Random, vertices: int, edges: int) -> list[tuple[int, int, float]]:
    """Edges ``(tail, head, capacity)``: byte-sized, some zero, some
    infinite, a few parallel; finite out of the source (a finite cut exists)."""
    result = []
    for _ in range(edges):
        tail, head = rng.sample(range(vertices), 2)
        finite = [0, rng.randrange(1, 10), rng.randrange(1, 10**12)]
        capacity = rng.choice(finite if tail == SOURCE else [*finite, INFINITE, INFINITE])
        result.append((tail, head, capacity))
    return result


def _networkx_sink_side(vertices: int, edges) -> set[int]:
    """networkx's sink side of the minimum cut. Parallel edges add."""
    graph = nx.DiGraph()
    graph.add_nodes_from(range(vertices))
    for tail, head, capacity in edges:
        if graph.has_edge(tail, head):
            capacity += graph[tail][head].get("capacity", INFINITE)
        if capacity == INFINITE:
            graph.add_edge(tail, head)
            graph[tail][head].pop("capacity", None)  # networkx: no capacity is infinite
        else:
            graph.add_edge(tail, head, capacity=capacity)
    _, (_, sink_side) = nx.minimum_cut(graph, SOURCE, SINK, flow_func=shortest_augmenting_path)
    return set(sink_side)


@pytest.mark.parametrize("seed", range(40))
def test_sink_side_is_networkx_minimum_cuts(seed):
    # The sink side of the cut closest to the sink is the same for every
    # maximum flow: the saved set must not depend on the algorithm.
    rng = random.Random(seed)
    # (large enough that some maximum flows must push flow back along an edge)
    vertices = rng.randrange(10, 60)
    edges = _random_graph(rng, vertices, rng.randrange(2 * vertices, 6 * vertices))
    flow = _flow_graph(vertices, edges)
    assert sink_side(flow) == _networkx_sink_side(vertices, edges)


def test_an_infinite_path_is_a_partition_error_naming_it():
    graph = fx.Graph()
    x = graph.placeholder("x")
    neg = graph.call_function(torch.neg, (x,))
    flow = _flow_graph(4, [(SOURCE, 2, INFINITE), (2, 3, INFINITE), (3, SINK, INFINITE)])
    flow.vertex.update({(x, IN): 2, (neg, IN): 3})
    with pytest.raises(PartitionError, match="infinite path through x -> neg"):
        solve(flow)


def _flow_graph(vertices: int, edges) -> FlowGraph:
    flow = FlowGraph(None, vertex={}, heads=[], arcs=[[] for _ in range(vertices)], capacities=[], terminals={})
    for edge in edges:
        add_edge(flow, *edge)
    return flow
