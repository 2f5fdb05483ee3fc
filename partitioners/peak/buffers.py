"""Which values of an order get a buffer of their own, by the rules of
Inductor's lowering (``materialized``), and which buffers each kernel reads
(``buffer_reads``).

A pointwise value is computed inside the kernel of each reader unless an
extern kernel (matmul, attention, convolution, an op Inductor cannot fuse)
reads it, it leaves the graph (saved, a gradient, an output), or Inductor
realizes it for reuse: read by more than one kernel and either containing an
op that is costly to repeat on CPU (exp, log, tanh...) or reading more than
Inductor's ``realize_reads_threshold`` buffers (``LoweredGraph.realize_reads``).
Reductions, scatters and concatenations always write a buffer. A random draw
only its own fused kernel reads gets no buffer. Views an extern kernel reads
and Inductor must copy are buffers too (``layouts.copied_views``).
"""
from __future__ import annotations

import bisect
import operator

import torch.fx as fx

from ..classify import GraphFacts
from .kinds import ALIAS, BUFFER, COSTLY_ON_CPU, FUSED_BUFFER, INLINE, NONE, REDUCTIONS, _numel, _op_name
from .layouts import copied_views
from .lowering import LoweredGraph, lower
from .schedule import _loop_numel


def materialized(facts: GraphFacts, order: list[fx.Node], kept: set[fx.Node],
                 kernel_local: dict | None = None, *, lowered: LoweredGraph | None = None,
                 late: dict | None = None, rank: dict | None = None) -> set[fx.Node]:
    """The nodes of ``order`` that write a buffer of their own, by Inductor's
    rules. ``kernel_local`` collects the values realized inside one kernel
    and dropped (``_kernel_local``), each with its span of steps. ``late``
    collects the values written only because an extern kernel reads them,
    each with the rank of the first such kernel in ``rank`` (the order
    Inductor lowers the graph in; ``order`` when not given): Inductor
    realizes such a value when it lowers that extern kernel, and a reader
    lowered before it computed the value inside its own kernel from the
    value's inputs (``buffer_reads``)."""
    lowered = lowered or lower(facts)
    in_order = set(order)
    kinds = lowered.kinds
    position = {node: step for step, node in enumerate(order)}
    rank = rank or position
    externs = [step for step, node in enumerate(order) if node in lowered.externs]
    buffers: set[fx.Node] = set()
    inline_reads: dict[fx.Node, frozenset] = {}
    costly: dict[fx.Node, bool] = {}
    for node in order:
        kind = kinds[node]
        if kind == BUFFER:
            buffers.add(node)
        if kind != INLINE:
            continue
        reads = frozenset().union(*(inline_reads.get(a, frozenset({a})) for a in node.all_input_nodes))
        costly[node] = (
            _op_name(node) in COSTLY_ON_CPU
            or any(costly.get(a, False) for a in node.all_input_nodes)
        )
        users = _readers(node, in_order, kinds)
        realized = len(users) > 1 and (costly[node] or len(reads) > lowered.realize_reads)
        local = realized and _kernel_local(node, users, kinds, position, externs)
        if (
            node in kept
            or node in facts.backward_outputs
            or any(_written_reader(u, facts, kinds[u], lowered) for u in users)
            or (realized and not local)
        ):
            buffers.add(node)
            if late is not None and not (node in kept or node in facts.backward_outputs or realized):
                externs_reading = [rank[u] for u in users if u in lowered.externs and u in rank]
                if externs_reading and all(
                        u in lowered.externs or not _written_reader(u, facts, kinds[u], lowered) for u in users):
                    late[node] = min(externs_reading)
        elif local and kernel_local is not None:
            kernel_local[node] = (position[node], max(position[u] for u in users))
        if node in buffers or realized:  # readers load it as one value
            inline_reads[node], costly[node] = frozenset({node}), False
        else:
            inline_reads[node] = reads
    for draw in [n for n in buffers if facts.nodes[n].category in FUSED_BUFFER]:
        last = _dropped_draw(draw, facts, kept, buffers, lowered, position, externs)
        if last is not None:
            buffers.discard(draw)
            if kernel_local is not None:
                kernel_local[draw] = (position[draw], last)
    return buffers | copied_views(facts, order, kept, lowered=lowered)


def _dropped_draw(draw: fx.Node, facts: GraphFacts, kept: set[fx.Node], buffers: set[fx.Node],
                  lowered: LoweredGraph, position: dict, externs: list) -> int | None:
    """The last step reading a random draw that only the kernels drawing
    it read (the dropout that applies it; in backward also the dropout's
    backward, fused across extern kernels: ``fused_across_externs``): the
    scheduler drops its buffer. None when the draw keeps a buffer."""
    if draw in kept or draw in facts.backward_outputs:
        return None
    readers, stack, seen = [], list(draw.users), set()
    while stack:  # the kernels reading it, through inlined values and views
        user = stack.pop()
        if user in seen or user not in position:
            continue
        seen.add(user)
        if user in buffers or user in lowered.externs:
            readers.append(user)
        elif lowered.kinds[user] in (INLINE, ALIAS):
            stack.extend(user.users)
    size = _loop_numel(draw, facts, lowered.kinds)
    if not readers or any(r in lowered.externs or _loop_numel(r, facts, lowered.kinds) != size for r in readers):
        return None
    last = max(position[r] for r in readers)
    if bisect.bisect_right(externs, position[draw]) != bisect.bisect_left(externs, last):
        return None  # an extern kernel runs between: it is written
    return last


def _kernel_local(node: fx.Node, users: list[fx.Node], kinds: dict, position: dict, externs: list) -> bool:
    """A value Inductor realizes for reuse, read only by pointwise ops over
    the same elements with no extern kernel between: they fuse into the
    kernel that writes it, and the scheduler drops a buffer written and last
    read in one kernel (a GELU's tanh, read by the GELU and by its backward)."""
    size = _numel(node)
    if not all(kinds[u] == INLINE and _numel(u) == size for u in users):
        return False
    last = max(position[u] for u in users)
    return bisect.bisect_right(externs, position[node]) == bisect.bisect_left(externs, last)


def _readers(node: fx.Node, in_order: set, kinds: dict) -> list[fx.Node]:
    """The nodes of this phase that read ``node``, looking through views."""
    readers, stack = [], [node]
    while stack:
        for user in stack.pop().users:
            if user not in in_order or user.op == "output":
                continue
            if kinds[user] == ALIAS:
                stack.append(user)
            elif user not in readers:
                readers.append(user)
    return readers


def _written_reader(reader: fx.Node, facts: GraphFacts, kind: str, lowered: LoweredGraph) -> bool:
    """A reader that needs its input in memory: an extern kernel (also one
    with several outputs, such as convolution_backward) or a buffer-writing
    kernel other than a reduction, which computes inlined inputs inside its
    own loop."""
    if reader in lowered.externs:
        return True
    return kind == BUFFER and facts.nodes[reader].category not in REDUCTIONS


def buffer_reads(facts: GraphFacts, order: list[fx.Node], buffers: set[fx.Node], *,
                 lowered: LoweredGraph | None = None, late: dict | None = None,
                 rank: dict | None = None) -> dict[fx.Node, set[fx.Node]]:
    """Per buffer-writing node of ``order``, the buffers its kernel reads
    (through inlined values and views). Values from outside ``order`` (saved
    values, inputs) are read as themselves. A value of ``late``
    (``materialized``) is read by a node ranked before its first extern
    reader in ``rank`` as what it reads itself: T5's softmax backward is
    read by the position bias gradient's sum over the batch before the
    matmuls that realize it, so the sum reads the softmax output and its
    gradient."""
    lowered = lowered or lower(facts)
    late = late or {}
    if late and rank is None:
        rank = {node: step for step, node in enumerate(order)}
    inlined: dict[fx.Node, frozenset] = {}  # a late value, as what it reads
    kinds, owners = lowered.kinds, lowered.owners
    sources: dict[fx.Node, frozenset] = {}
    itself: dict[fx.Node, frozenset] = {}

    def source(arg: fx.Node) -> frozenset:
        # A placeholder (a tangent, a saved value) is read as itself.
        found = sources.get(arg)
        if not found:
            found = itself.get(arg) or itself.setdefault(arg, frozenset({owners[arg]}))
        return found

    # A copied view (``copied_views``) is read as itself by the extern kernels
    # it was copied for; other readers index its base, as for any view.
    copies = {node for node in buffers if kinds[node] == ALIAS}
    reads: dict[fx.Node, set[fx.Node]] = {}
    for node in order:
        args = node.all_input_nodes
        # (the budget search walks each graph many times: skip the union for one input)
        arg_sources = source(args[0]) if len(args) == 1 else frozenset().union(*map(source, args))
        if copies and not copies.isdisjoint(args) and node in lowered.externs:
            arg_sources = frozenset().union(*(frozenset({a}) if a in copies else source(a) for a in args))
        if inlined and node in rank and kinds[node] in (INLINE, BUFFER) and node not in lowered.externs \
                and node.target is not operator.getitem and not inlined.keys().isdisjoint(arg_sources):
            arg_sources = frozenset().union(*(
                inlined[b] if b in inlined and rank[node] < late[b] else frozenset({b}) for b in arg_sources))
        if node in late:
            inlined[node] = arg_sources
        if node in copies:
            sources[node] = source(owners[node])
            reads[node] = set(arg_sources)
        elif node in buffers:
            sources[node] = frozenset({node})
            reads[node] = set(arg_sources)
        elif kinds[node] == ALIAS:
            sources[node] = source(owners[node]) if owners[node] is not node else arg_sources
        else:  # inlined, or no tensor: its readers read what it reads
            sources[node] = arg_sources
            if kinds[node] == NONE and node.op != "placeholder":
                reads[node] = set(arg_sources)  # a tuple-valued kernel reads its inputs
    return reads
