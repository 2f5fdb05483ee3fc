"""The order kernels run in, as Inductor's scheduler runs them.

Backward runs ``backward_schedule``: backward nodes in joint-graph order,
each recomputed node just before its first reader. Within a phase, kernels
run as fused runs between extern kernels (``kernel_order``); a matmul
Inductor folds into the add reading it runs at that add
(``mm_at_its_add``); and a kernel fuses with an earlier one it reads across
extern kernels when that makes no cycle and the fused kernel stays under
Inductor's ``max_fusion_size`` (``LoweredGraph.max_fused``): the fused
kernel runs at the earlier one's place, after the extern kernels it needs
(``fused_across_externs``).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

import ckpt_compat as compat
from ..classify import GraphFacts
from .kinds import ALIAS, ALWAYS_WRITTEN, FUSED, INLINE, NONE, REDUCTIONS, _every_overload, _numel, _shape, aten
from .lowering import LoweredGraph, lower


def backward_schedule(facts: GraphFacts, saved: set[fx.Node]) -> list[fx.Node]:
    """Nodes backward runs, in order: recomputed nodes just before their first use."""
    done: set[fx.Node] = set(saved)
    backward_outputs = set(facts.backward_outputs)
    order: list[fx.Node] = []
    for node in facts.nodes:  # graph order
        if node in facts.backward or node in backward_outputs:
            _schedule(node, done, order)
    return order


def _schedule(root: fx.Node, done: set, order: list, within=None) -> None:
    """Append ``root`` to ``order`` after its inputs not ``done`` yet (only
    those ``within``, when given), depth first."""
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
        stack.extend((arg, False) for arg in reversed(node.all_input_nodes)
                     if arg not in done and (within is None or arg in within))


def mm_at_its_add(order: list[fx.Node]) -> list[fx.Node]:
    """``order`` with each matmul that Inductor folds into the add reading it
    (``add(mm(a, b), c)`` becomes ``addmm(c, a, b)``, torch/_inductor/
    fx_passes/post_grad.py ``addmm``) moved to that add: the matmul runs
    there, and ``a`` and ``b`` stay alive until then. A tied weight's
    gradient is one: the output projection's gradient waits for the
    embedding's, holding the logits' gradient through the whole backward."""
    folded = {add: _folded_matmul(add) for add in order if add.op == "call_function" and add.target in _ADDS}
    folded = {add: matmul for add, matmul in folded.items() if matmul is not None}
    if not folded:
        return order
    moved = set(folded.values())
    result = []
    for node in order:
        if node in folded:
            result.append(folded[node])
        if node not in moved:
            result.append(node)
    return result


_ADDS = _every_overload(aten.add)


def _folded_matmul(add: fx.Node) -> fx.Node | None:
    """The mm Inductor folds into ``add`` (it tries ``add(c, mm)`` first), if any."""
    if len(add.args) < 2 or add.kwargs.get("alpha", 1) != 1:
        return None
    for matmul, other in ((add.args[1], add.args[0]), (add.args[0], add.args[1])):
        if not (isinstance(matmul, fx.Node) and matmul.target is aten.mm.default
                and len(matmul.users) == 1 and isinstance(other, fx.Node)):
            continue
        result, bias = matmul.meta.get("val"), other.meta.get("val")
        if not (isinstance(result, torch.Tensor) and isinstance(bias, torch.Tensor)):
            continue
        if bias.dtype != result.dtype or not compat.is_expandable_to(bias.shape, result.shape):
            continue
        # On GPUs Inductor keeps them apart when every reader of the sum is pointwise.
        if result.device.type != "cpu" and all(compat.is_pointwise_use(u) for u in add.users):
            continue
        return matmul
    return None


def kernel_order(facts: GraphFacts, order: list[fx.Node], *, lowered: LoweredGraph | None = None) -> list[fx.Node]:
    """``order`` as Inductor's kernels run: a run of pointwise and reduction
    kernels fuses into few kernels, so an extern kernel (a matmul) runs after
    the run that follows it unless the run reads it, and what it reads stays
    alive through the run (seen in Inductor's generated code: a weight
    gradient's matmul after the fused gelu and LayerNorm backward). Extern
    kernels keep their order among themselves."""
    lowered = lowered or lower(facts)
    kinds = lowered.kinds
    result, pending, waiting = [], [], set()
    for node in order:
        kind = kinds[node]
        if node in lowered.externs:  # extern kernels keep their order
            result.extend(pending)
            pending, waiting = [node], {node}
            continue
        if any(arg in waiting for arg in node.all_input_nodes):
            if kind in (ALIAS, NONE) and node.op != "placeholder":  # a view of a waiting value waits too
                pending.append(node)
                waiting.add(node)
                continue
            needed = _waiting_ancestors(node, waiting)
            result.extend(n for n in pending if n in needed)
            pending = [n for n in pending if n not in needed]
            waiting -= needed
        result.append(node)
    return result + pending


def _waiting_ancestors(node: fx.Node, waiting: set[fx.Node]) -> set[fx.Node]:
    """The waiting nodes ``node`` reads, directly or through other waiting nodes."""
    needed, stack = set(), [a for a in node.all_input_nodes if a in waiting]
    while stack:
        arg = stack.pop()
        if arg not in needed:
            needed.add(arg)
            stack.extend(a for a in arg.all_input_nodes if a in waiting)
    return needed


def _run_ends(order: list[fx.Node], lowered: LoweredGraph) -> list[int]:
    """Per step, the last step of its run of fused kernels (an extern kernel
    is a run of its own)."""
    extern = [node in lowered.externs for node in order]
    ends, end = [0] * len(order), len(order) - 1
    for step in reversed(range(len(order))):
        if extern[step]:
            ends[step], end = step, step - 1
        else:
            ends[step] = end
    return ends


def fused_across_externs(facts: GraphFacts, order: list[fx.Node], buffers: set[fx.Node],
                         reads: dict, *, lowered: LoweredGraph | None = None,
                         rank: dict | None = None) -> list[fx.Node]:
    """``order`` as Inductor's scheduler runs it after fusing a kernel with an
    earlier one it reads across extern kernels (vertical fusion has no
    distance limit): the fused kernel runs where the earlier one was, and
    the extern kernels the later one needs run before it. Legal when
    nothing between them that the later kernel needs reads the earlier one
    (a cycle). Seen in Inductor's code for a GPT with dropout at budget 0.0:
    the recomputed dropout draws, the dropout, and its backward and the
    softmax backward are one kernel, run after the ``grad @ v.T`` matmul and
    before the recomputed ``attn @ v``; and on the MoE, a recomputed
    LayerNorm fuses with its backward. ``rank`` is the order Inductor
    lowered the nodes in (``order`` itself when not given). Returns
    ``order`` itself when nothing fuses."""
    lowered = lowered or lower(facts)
    kinds = lowered.kinds
    position = {node: step for step, node in enumerate(order)}
    externs_before, count = [], 0
    for node in order:
        externs_before.append(count)
        count += node in lowered.externs
    group: dict[fx.Node, int] = {}  # fused node -> its group (the group's first step)
    teams: dict[int, list[fx.Node]] = {}
    crossed = False
    for later in order:
        if not _fusable(later, buffers, kinds, facts, lowered):
            continue
        size = _loop_numel(later, facts, kinds)
        candidates = [
            earlier for earlier in reads.get(later, ())
            if earlier in position and _fusable(earlier, buffers, kinds, facts, lowered)
            and _loop_numel(earlier, facts, kinds) == size
        ]
        for earlier in sorted(candidates, key=lambda n: (-facts.nodes[n].nbytes, position[n])):
            first = group.get(earlier, position[earlier])
            members = teams.get(first, [earlier])
            if len(members) >= lowered.max_fused \
                    or _fusion_cycle(later, set(members), first, position, buffers, lowered):
                continue
            if first not in teams:
                teams[first], group[earlier] = members, first
            members.append(later)
            group[later] = first
            crossed |= externs_before[position[later]] != externs_before[first]
            break
    if not crossed:  # fusions inside one run of kernels change nothing here
        return order
    rank = rank or position
    lowering = sorted(order, key=rank.__getitem__)
    apart = {first for first, members in teams.items()
             if not _joins_the_run_before(members[0], lowering, rank, buffers, reads, facts, lowered)}
    return _grouped_order(order, group, teams, position, rank, apart)


def _joins_the_run_before(node: fx.Node, lowering: list[fx.Node], rank: dict, buffers: set[fx.Node],
                          reads: dict, facts: GraphFacts, lowered: LoweredGraph) -> bool:
    """Whether ``node``'s kernel may fuse with a kernel of the run lowered
    before the extern kernels lowered just before it (one it loops as
    many elements as, and reads or shares a full-size read with): then
    it runs before those extern kernels, as ``kernel_order`` has it."""
    kinds, step = lowered.kinds, rank[node] - 1
    while step >= 0 and lowering[step] not in lowered.externs:
        step -= 1  # back over node's own run
    while step >= 0 and (lowering[step] in lowered.externs or kinds[lowering[step]] in (ALIAS, NONE)):
        step -= 1  # over the extern kernels and their views
    size = _loop_numel(node, facts, kinds)
    elements = size[1] if isinstance(size, tuple) else size
    # What it reads in full: a shared small weight (a LayerNorm's) does not make a fusion.
    mine = {b for b in reads.get(node, ()) if (_numel(b) or 0) >= (elements or 0)}
    while step >= 0 and lowering[step] not in lowered.externs:
        earlier = lowering[step]
        if _fusable(earlier, buffers, kinds, facts, lowered) and _loop_numel(earlier, facts, kinds) == size \
                and (earlier in mine or mine & set(reads.get(earlier, ()))):
            return True
        step -= 1
    return False


def _fusable(node: fx.Node, buffers: set[fx.Node], kinds: dict, facts: GraphFacts, lowered: LoweredGraph) -> bool:
    """A scheduler node Inductor may fuse with another: a buffer written by
    a pointwise, random or reduction kernel."""
    if node not in buffers or kinds[node] == ALIAS or node.op != "call_function" or node in lowered.externs:
        return False
    kernel = node.args[0] if node.target is operator.getitem else node
    return facts.nodes[kernel].category in FUSED and kernel.target not in ALWAYS_WRITTEN


def _loop_numel(node: fx.Node, facts: GraphFacts, kinds: dict) -> int | tuple | None:
    """The elements a kernel loops over: a reduction's input, else its
    output. A reduction over leading dimensions (a bias gradient's sum over
    tokens) loops in another order, so it is ``("outer", elements)``: it
    does not fuse with the pointwise kernel it reads. A reduction Inductor
    unrolls (``kinds.unrolled_reduction``, INLINE in ``kinds``) is a
    pointwise kernel over its output."""
    kernel = node.args[0] if node.target is operator.getitem else node
    if facts.nodes[kernel].category not in REDUCTIONS or kinds.get(kernel) == INLINE:
        return _numel(node)
    source = max(kernel.all_input_nodes, key=lambda arg: _numel(arg) or 0, default=None)
    if source is None:
        return None
    inputs, outputs = _shape(source), _shape(kernel)
    while outputs and outputs[-1] == 1:
        outputs.pop()
    elements = _numel(source)
    return elements if inputs[:len(outputs)] == outputs else ("outer", elements)


def _fusion_cycle(later: fx.Node, members: set[fx.Node], first: int, position: dict,
                  buffers: set[fx.Node], lowered: LoweredGraph) -> bool:
    """Whether ``later`` needs, through a kernel outside the group, a value
    that needs the group (``members``, from step ``first`` on)."""
    seen: set[fx.Node] = set()
    stack = [(arg, False) for arg in later.all_input_nodes]
    while stack:
        node, through_kernel = stack.pop()
        if node in members:
            if through_kernel:
                return True
            continue
        if (node, through_kernel) in seen or position.get(node, -1) <= first:
            continue
        seen.add((node, through_kernel))
        kernel = node in buffers or node in lowered.externs
        stack.extend((arg, through_kernel or kernel) for arg in node.all_input_nodes)
    return False


def _grouped_order(order: list[fx.Node], group: dict[fx.Node, int], teams: dict[int, list[fx.Node]],
                   position: dict, rank: dict, apart: set[int]) -> list[fx.Node]:
    """Inductor's topological sort of its fused nodes by first step: a group
    runs at its first member's step, after whatever its members need. Its
    sort key is the step each node was lowered at (``rank``), so an extern
    kernel ``kernel_order`` put after a run of kernels runs before a group
    whose first member was lowered after it, when that member does not
    fuse with the run before the extern kernel (``apart``, by the group's
    first step): the run left for the later kernel it fused with
    (GPT-NeoX's parallel block: the MLP's weight gradient runs before the
    attention backward, not after both LayerNorms' fused backward)."""
    placed: set[fx.Node] = set()
    result: list[fx.Node] = []

    def place(root: fx.Node) -> None:
        _schedule(root, placed, result, within=position)

    for node in order:
        if node in placed:
            continue
        if node in group:
            team = sorted(teams[group[node]], key=position.__getitem__)
            lowered_first = rank[team[0]] if group[node] in apart else -1
            for earlier in sorted((n for n in order if n not in placed and rank[n] < lowered_first),
                                  key=rank.__getitem__):
                place(earlier)  # lowered before the group: it cannot need the group
            for needed in _outside_needs(team, placed, position):
                place(needed)  # first what the group needs from outside it
            for member in team:
                place(member)
        else:
            place(node)
    return result


def _outside_needs(team: list[fx.Node], placed: set[fx.Node], position: dict) -> list[fx.Node]:
    """The unplaced nodes ``team`` needs that do not need ``team`` themselves
    (those are inlined values computed inside the group's kernel), in order."""
    members = set(team)
    ancestors, stack = set(), [arg for member in team for arg in member.all_input_nodes]
    while stack:
        node = stack.pop()
        if node in ancestors or node in members or node in placed or node not in position:
            continue
        ancestors.add(node)
        stack.extend(node.all_input_nodes)
    needs_team: set[fx.Node] = set()
    in_order = sorted(ancestors, key=position.__getitem__)
    for node in in_order:
        if any(arg in members or arg in needs_team for arg in node.all_input_nodes):
            needs_team.add(node)
    return [node for node in in_order if node not in needs_team]
