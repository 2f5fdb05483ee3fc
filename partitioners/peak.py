"""Predicted peak bytes of one training step for a saved set.

The step is two walks over the joint graph, as the compiled graphs run:

- forward: forward nodes in graph order. A buffer lives from the kernel that
  writes it to the last kernel that reads it; values saved for backward and
  forward outputs live to the end of forward.
- backward: ``backward_schedule`` (backward nodes in joint-graph order, each
  recomputed node just before its first reader). Saved values and tangents
  are alive from the start; a saved value is freed after its
  last reader (the compiled backward takes ownership of its inputs);
  gradients stay alive to the end (as after ``optimizer.zero_grad()``, the
  first gradient of a parameter becomes its ``.grad`` without a copy).

Bytes are counted above what is live before the step: parameters, buffers
and inputs are not counted, nor are views (they share their base's buffer).

Which values get a buffer of their own follows Inductor's lowering
(``materialized``): a pointwise value is computed inside the kernel of each
reader unless an extern kernel (matmul, attention, convolution, an op Inductor
cannot fuse) reads it, it leaves the graph (saved, a gradient, an output), or
Inductor realizes it for reuse: read by more than one kernel and either
containing an op that is costly to repeat on CPU (exp, log, tanh...) or
reading more than ``REALIZE_READS`` buffers. Reductions, scatters and
concatenations always write a buffer. An extern kernel reading a view that
Inductor cannot express as strides over its base's layout reads a copy of
its own (``copied_views``). Extern kernels that allocate working
memory of their own (attention backward) add it while they run
(``workspace_bytes``).

The order follows Inductor's scheduler: kernels run as fused runs between
extern kernels (``kernel_order``), and a kernel fuses with an earlier one it
reads across extern kernels when that makes no cycle; the fused kernel runs
at the earlier one's place, after the extern kernels it needs
(``fused_across_externs``). A random draw only its own fused kernel reads
gets no buffer.

Deterministic: a function of the graph and the saved set, no timing, no
allocation, so every rank predicts the same.
"""
from __future__ import annotations

import bisect
import dataclasses
import math
import operator

import torch
import torch.fx as fx

from . import _torch_compat as compat
from .classify import GraphFacts
from .ops import OpCategory

aten = torch.ops.aten


def _every_overload(*packets) -> frozenset:
    """Every overload of these aten ops (node targets are overloads)."""
    return frozenset(getattr(packet, name) for packet in packets for name in packet.overloads())


# Categories Inductor can compute inside a reader's kernel. Seeded random
# values are computed by a fused kernel too, but always into a buffer of
# their own (torch/_inductor/lowering.py inductor_random: result.realize()):
# a float32 buffer of the draws, not the boolean mask a dropout keeps.
INLINABLE = frozenset({OpCategory.POINTWISE, OpCategory.DATA_MOVEMENT, OpCategory.CONSTANT})
FUSED_BUFFER = frozenset({OpCategory.SEEDED_RANDOM})
# Categories Inductor lowers to a reduction kernel with a buffer of its own.
REDUCTIONS = frozenset({OpCategory.REDUCTION, OpCategory.SHRINKING_REDUCTION})

# What runs inside Inductor's fused kernels (the rest are extern kernels).
FUSED = INLINABLE | FUSED_BUFFER | REDUCTIONS

# Data movement Inductor lowers to a kernel writing a buffer (a scatter into
# a fresh buffer, a concatenation), not to an inlinable expression.
ALWAYS_WRITTEN = _every_overload(
    aten.cat, aten.index_put, aten.scatter, aten.scatter_add,
    aten.slice_scatter, aten.select_scatter, aten.embedding_dense_backward
)

# torch/_inductor/config.py realize_reads_threshold: a reused pointwise value
# reading more buffers than this is stored rather than recomputed per reader.
REALIZE_READS = 4
# torch/_inductor/ir.py should_realize_on_reuse: ops Inductor will not repeat
# per reader on CPU.
COSTLY_ON_CPU = frozenset({"exp", "log", "log10", "log1p", "log2", "sigmoid", "tanh"})


@dataclasses.dataclass(frozen=True)
class PeakEstimate:
    """Predicted bytes above what is live before the step."""

    forward_bytes: int
    """Peak while forward runs."""
    backward_bytes: int
    """Peak while backward runs (saved values and gradients included)."""
    held_bytes: int = 0
    """What forward leaves alive for backward: the saved values."""
    output_bytes: int = 0
    """What forward returns, beyond saved values."""
    gradient_bytes: int = 0
    """What backward returns: gradients of parameters and inputs."""
    tangent_bytes: int = 0
    """What backward is handed: gradients of forward's outputs, returned by
    the graphs that ran after this one (counted in ``backward_bytes``)."""
    held_input_bytes: int = 0
    """Batch inputs (not parameters) saved for backward: free within this
    graph, whose caller holds them, but kept for the step when an earlier
    graph produced them (a block's input under per-block compile)."""

    @property
    def step_bytes(self) -> int:
        return max(self.forward_bytes, self.backward_bytes)


def estimate_step_peak(facts: GraphFacts, saved, backward_trace: list | None = None) -> PeakEstimate:
    """The predicted forward and backward peaks of one step that saves
    ``saved``; ``backward_trace`` collects the backward walk's steps (``walk``)."""
    saved = set(saved)
    held = facts.saved_storages(saved)
    outputs = _outputs(facts)
    forward = [n for n in facts.nodes if n in facts.forward]
    forward_peak = walk(facts, forward, kept=held | outputs)
    order = backward_schedule(facts, saved)
    tangents = {n for n in order if n.op == "placeholder" and n not in facts.inputs}
    gradients = {owner(n, facts) for n in facts.backward_outputs}
    backward_peak = walk(facts, order, kept=gradients, start=held | tangents, trace=backward_trace)
    return PeakEstimate(
        forward_peak, backward_peak,
        held_bytes=sum(facts.nodes[n].nbytes for n in held),
        output_bytes=sum(facts.nodes[n].nbytes for n in outputs - held),
        gradient_bytes=sum(facts.nodes[n].nbytes for n in gradients - facts.free_inputs),
        tangent_bytes=sum(facts.nodes[n].nbytes for n in tangents),
        held_input_bytes=sum(facts.nodes[n].nbytes for n in _saved_batch_inputs(facts, saved)),
    )


def _saved_batch_inputs(facts: GraphFacts, saved: set[fx.Node]) -> set[fx.Node]:
    roots = {facts.nodes[node].storage_root for node in saved}
    return roots & (facts.free_inputs - facts.static_inputs)


def _outputs(facts: GraphFacts) -> set[fx.Node]:
    """What forward returns (not inputs). Alive at the end of forward; not
    counted in backward, where a loss is a scalar and logits handed to a
    later graph are that graph's to hold."""
    return {owner(n, facts) for n in facts.forward_outputs} - facts.inputs


def walk(facts: GraphFacts, order: list[fx.Node], kept: set[fx.Node],
         start: set[fx.Node] = frozenset(), trace: list | None = None) -> int:
    """Peak bytes of running ``order`` with ``start`` buffers alive at the
    beginning and ``kept`` ones never freed. ``trace`` collects
    ``(node, live bytes, alive buffers, Inductor's estimate)`` per step,
    for calibration."""
    order = kernel_order(facts, mm_at_its_add(order))
    buffers, reads, copies, kernel_local = _lowered_walk(facts, order, kept)
    fused = fused_across_externs(facts, order, buffers, reads)
    if fused is not order:  # kernels fused across extern kernels: lower again
        order = fused
        buffers, reads, copies, kernel_local = _lowered_walk(facts, order, kept)
    copied = {copy for written in copies.values() for copy in written}
    relaid = relaid_contiguous(facts, order, kept)
    last_read: dict[fx.Node, int] = {}
    for step, node in enumerate(order):
        for buffer in reads.get(node, ()) if node not in copied else ():
            last_read[buffer] = step
        for copy in copies.get(step, ()):  # a copy reads its base where it is written
            for buffer in reads[copy]:
                last_read[buffer] = max(last_read.get(buffer, step), step)
    frees: dict[int, list[fx.Node]] = {}
    for buffer, step in last_read.items():
        if buffer not in kept:
            frees.setdefault(step, []).append(buffer)
    alive = set(start) - facts.free_inputs
    live = start_bytes = sum(facts.nodes[b].nbytes for b in alive)
    curve, donations, workspace, written, freed, alive_at = [], [], [], [], [], []
    workspaces = _lowered(facts)[3]
    for step, node in enumerate(order):
        new: list[fx.Node] = []
        donated = 0
        for copy in reads.get(node, set()) & facts.relaid_inputs - alive:
            alive.add(copy)  # Inductor's channels-last copy of an input
            live += facts.nodes[copy].nbytes
        if node in buffers and node not in alive and node not in copied:
            donor = _in_place_donor(node, reads.get(node, ()), step, last_read, alive, kept, relaid, facts)
            if donor is not None:  # the kernel writes into a buffer it reads for the last time
                alive.discard(donor)
                live -= facts.nodes[donor].nbytes
                donated += facts.nodes[donor].nbytes
            else:
                new.append(node)
            alive.add(node)
            live += facts.nodes[node].nbytes
        for output in _tuple_outputs(node, buffers) - alive:  # a kernel with several outputs
            alive.add(output)  # writes them all at once
            live += facts.nodes[output].nbytes
        for copy in copies.get(step, ()):  # a copied view, written by the step's kernel
            if copy not in alive:
                new.append(copy)
                alive.add(copy)
                live += facts.nodes[copy].nbytes
        curve.append(live)
        donations.append(donated)
        workspace.append(workspaces.get(node, 0))
        written.append(new)
        if trace is not None:
            alive_at.append(frozenset(alive))
        gone = [b for b in frees.get(step, ()) if b in alive]
        for buffer in gone:
            alive.discard(buffer)
            live -= facts.nodes[buffer].nbytes
        freed.append(gone)
    run_end = _run_ends(facts, order)
    estimate = inductor_estimate(facts, order, curve, donations, freed, kernel_local, start, run_end)
    held = reuse_pool(facts, estimate, written, freed, run_end)
    for buffer, first, last in held:
        for step in range(first, last):
            curve[step] += facts.nodes[buffer].nbytes
            if trace is not None:
                alive_at[step] |= {buffer}
    running = [c + w for c, w in zip(curve, workspace)]
    if trace is not None:
        trace.extend(zip(order, running, alive_at, estimate))
    return max([start_bytes, *running])


def _lowered_walk(facts: GraphFacts, order: list[fx.Node], kept: set[fx.Node]) -> tuple:
    """What ``walk`` needs of ``order``: its buffers, what each kernel reads,
    where copied views are written, and the kernel-local values."""
    kernel_local: dict[fx.Node, tuple[int, int]] = {}
    buffers = materialized(facts, order, kept, kernel_local)
    reads = buffer_reads(facts, order, buffers)
    return buffers, reads, copy_steps(facts, order, buffers), kernel_local


def inductor_estimate(facts: GraphFacts, order: list[fx.Node], curve: list[int], donations: list[int],
                      freed: list[list[fx.Node]], kernel_local: dict, start: set[fx.Node],
                      run_end: list[int] | None = None) -> list[int]:
    """Live bytes per step as Inductor's own estimate sees them
    (torch/_inductor/memory.py ``estimate_peak_memory``), by which its reuse
    pool decides. It runs on fused kernels before in-place and kernel-local
    decisions, so, unlike ``curve``: a run of fused steps allocates all its
    outputs before it frees any input; an in-place output counts on top of
    the buffer it overwrites (``donations``); a kernel-local value counts
    through its run. It does not see the graph's inputs (tangents, primals:
    utils.is_nonfreeable_buffers). GPT-2 at 0.0: the GELU backward kernel
    writes three 0.5 MiB buffers at once, one of them a kernel-local tanh;
    Inductor's estimate peaks there and lets the fc's buffer wait in the
    pool through the attention backward. ``run_end``: ``_run_ends`` of
    ``order``, when the caller has it."""
    run_end = run_end or _run_ends(facts, order)
    unseen = sum(facts.nodes[b].nbytes for b in start - facts.free_inputs if b.op == "placeholder")
    estimate, deferred = [], 0
    for step, live in enumerate(curve):
        deferred += donations[step]  # the donor counts to the end of its run too
        estimate.append(live + deferred - unseen)
        for buffer in freed[step]:
            if buffer.op == "placeholder" and buffer in start:
                unseen -= facts.nodes[buffer].nbytes  # gone from both
            else:
                deferred += facts.nodes[buffer].nbytes
        if run_end[step] == step:
            deferred = 0
    for node, (first, last) in kernel_local.items():
        for step in range(first, run_end[last] + 1):
            estimate[step] += facts.nodes[node].nbytes
    return estimate


def _run_ends(facts: GraphFacts, order: list[fx.Node]) -> list[int]:
    """Per step, the last step of its run of fused kernels (an extern kernel
    is a run of its own)."""
    extern = [_is_extern(node, facts) for node in order]
    ends, end = [0] * len(order), len(order) - 1
    for step in reversed(range(len(order))):
        if extern[step]:
            ends[step], end = step, step - 1
        else:
            ends[step] = end
    return ends


# Extern kernels Inductor calls with an ``out=`` buffer it allocates itself
# (and so may take from its pool of freed buffers); other extern kernels
# allocate their outputs inside.
MATMULS = _every_overload(aten.mm, aten.addmm, aten.bmm, aten.baddbmm)


def reuse_pool(facts: GraphFacts, estimate: list[int], written: list[list[fx.Node]],
               freed: list[list[fx.Node]], run_end: list[int] | None = None) -> list[tuple[fx.Node, int, int]]:
    """Freed buffers Inductor keeps for a later buffer of the same size and
    dtype, as ``(buffer, first step, end step)`` spans they stay alive over.

    Inductor's wrapper (codegen/wrapper.py, ``AllocateLine.plan``) does not
    free a buffer after its last reader: it pools it, and a later allocation
    of the same key takes the most recently pooled one, holding it alive in
    between, when its own peak estimate over that span plus the buffer stays
    under the graph's estimated peak. Buffers no allocation takes are freed
    where they were last read. ``estimate`` is Inductor's estimate per step
    (``inductor_estimate``; without workspaces, which Inductor does not
    see), and its maximum Inductor's estimated peak. Measured on GPT-2 at
    budget 0.0: Inductor's estimate peaks where the fused MLP backward writes
    in place, and the MLP's buffers freed before the attention backward are
    held for the next layer's.
    """
    ceiling = max(estimate, default=0)
    run_end = run_end or list(range(len(estimate)))
    run_start, start = [], 0
    for step in range(len(estimate)):
        if step and run_end[step - 1] == step - 1:
            start = step
        run_start.append(start)
    extra = [0] * len(estimate)
    pool: dict[tuple, list[tuple[fx.Node, int]]] = {}
    spans = []
    for step, new in enumerate(written):
        for buffer in new:
            if not _allocated_by_inductor(buffer, facts):
                continue
            waiting = pool.get(_reuse_key(buffer, facts))
            if not waiting:
                continue
            donor, freed_at = waiting.pop()
            size = facts.nodes[buffer].nbytes
            # Inductor's check spans the kernels strictly between the one that
            # last reads the donor and the one that writes the buffer.
            between = range(run_end[freed_at] + 1, run_start[step])
            if between and max(estimate[k] + extra[k] for k in between) + size > ceiling:
                waiting.append((donor, freed_at))
                continue
            for k in between:
                extra[k] += size
            spans.append((donor, freed_at + 1, step))
        for buffer in freed[step]:
            if buffer.op != "placeholder":  # tangents and inputs are not Inductor's to reuse
                pool.setdefault(_reuse_key(buffer, facts), []).append((buffer, step))
    return spans


def _allocated_by_inductor(node: fx.Node, facts: GraphFacts) -> bool:
    copy = _kinds_and_owners(facts)[0][node] == ALIAS  # a view's copy (copied_views)
    return copy or facts.nodes[node].category in FUSED or node.target in MATMULS


def _reuse_key(node: fx.Node, facts: GraphFacts) -> tuple:
    value = node.meta.get("val")
    return facts.nodes[node].nbytes, getattr(value, "dtype", None), getattr(value, "device", None)


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


def _tuple_outputs(node: fx.Node, buffers: set[fx.Node]) -> set[fx.Node]:
    if not isinstance(node.meta.get("val"), (tuple, list)):
        return set()
    return {user for user in node.users if user.target is operator.getitem and user in buffers}


def _in_place_donor(node, reads, step, last_read, alive, kept, relaid, facts) -> fx.Node | None:
    """A buffer a pointwise kernel may overwrite with its output: read for the
    last time by this kernel, not kept, of the same size (Inductor's in-place
    buffer reuse; in backward, saved values are donated buffers), and laid
    out as the output: Inductor overwrites a buffer only where the kernel
    reads it at the index it writes (scheduler.py ``SchedulerNode.can_inplace``:
    ``read_dep.index == write_dep.index``), which fails when one of the two
    is written contiguous where eager's strides were not (``relaid``, from
    ``relaid_contiguous``)."""
    if _kinds_and_owners(facts)[0][node] != INLINE:
        return None
    size = facts.nodes[node].nbytes
    candidates = [
        buffer for buffer in reads
        if buffer in alive and buffer not in kept and last_read.get(buffer) == step
        and facts.nodes[buffer].nbytes == size and buffer not in facts.inputs
        and (buffer in relaid) == (node in relaid)
    ]
    if len(candidates) < 2:
        return candidates[0] if candidates else None
    return _first_loaded(node, set(candidates), facts)


def _first_loaded(node: fx.Node, candidates: set[fx.Node], facts: GraphFacts) -> fx.Node:
    """Of ``candidates``, the buffer ``node``'s kernel loads first: Inductor
    tries its reads in the order its loop body loads them, operands left to
    right through inlined values (GPT-2's GELU backward overwrites the
    gradient it multiplies, not the recomputed input)."""
    owners = _kinds_and_owners(facts)[1]
    stack, seen = list(reversed(node.all_input_nodes)), set()
    while stack:
        arg = stack.pop()
        if arg in seen:
            continue
        seen.add(arg)
        if owners.get(arg, arg) in candidates:
            return owners.get(arg, arg)
        stack.extend(reversed(arg.all_input_nodes))
    return min(candidates, key=lambda b: b.name)


def kernel_order(facts: GraphFacts, order: list[fx.Node]) -> list[fx.Node]:
    """``order`` as Inductor's kernels run: a run of pointwise and reduction
    kernels fuses into few kernels, so an extern kernel (a matmul) runs after
    the run that follows it unless the run reads it, and what it reads stays
    alive through the run (seen in Inductor's generated code: a weight
    gradient's matmul after the fused gelu and LayerNorm backward). Extern
    kernels keep their order among themselves."""
    kinds = _kinds_and_owners(facts)[0]
    result, pending, waiting = [], [], set()
    for node in order:
        kind = kinds[node]
        if _is_extern(node, facts):  # extern kernels keep their order
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


def fused_across_externs(facts: GraphFacts, order: list[fx.Node], buffers: set[fx.Node],
                         reads: dict) -> list[fx.Node]:
    """``order`` as Inductor's scheduler runs it after fusing a kernel with an
    earlier one it reads across extern kernels (vertical fusion has no
    distance limit): the fused kernel runs where the earlier one was, and
    the extern kernels the later one needs run before it. Legal when
    nothing between them that the later kernel needs reads the earlier one
    (a cycle). Seen in Inductor's code for a GPT with dropout at budget 0.0:
    the recomputed dropout draws, the dropout, and its backward and the
    softmax backward are one kernel, run after the ``grad @ v.T`` matmul and
    before the recomputed ``attn @ v``; and on the MoE, a recomputed
    LayerNorm fuses with its backward. Returns ``order`` itself when nothing
    fuses."""
    kinds = _kinds_and_owners(facts)[0]
    position = {node: step for step, node in enumerate(order)}
    externs_before, count = [], 0
    for node in order:
        externs_before.append(count)
        count += _is_extern(node, facts)
    group: dict[fx.Node, int] = {}  # fused node -> its group (the group's first step)
    teams: dict[int, list[fx.Node]] = {}
    crossed = False
    for later in order:
        if not _fusable(later, buffers, kinds, facts):
            continue
        size = _loop_numel(later, facts)
        candidates = [
            earlier for earlier in reads.get(later, ())
            if earlier in position and _fusable(earlier, buffers, kinds, facts)
            and _loop_numel(earlier, facts) == size
        ]
        for earlier in sorted(candidates, key=lambda n: (-facts.nodes[n].nbytes, position[n])):
            first = group.get(earlier, position[earlier])
            members = teams.get(first, [earlier])
            if len(members) >= MAX_FUSED or _fusion_cycle(later, set(members), first, position, buffers, facts):
                continue
            if first not in teams:
                teams[first], group[earlier] = members, first
            members.append(later)
            group[later] = first
            crossed |= externs_before[position[later]] != externs_before[first]
            break
    if not crossed:  # fusions inside one run of kernels change nothing here
        return order
    return _grouped_order(order, group, teams, position)


# torch/_inductor/config.py max_fusion_size: nodes in one fused kernel.
MAX_FUSED = 64


def _fusable(node: fx.Node, buffers: set[fx.Node], kinds: dict, facts: GraphFacts) -> bool:
    """A scheduler node Inductor may fuse with another: a buffer written by
    a pointwise, random or reduction kernel."""
    if node not in buffers or kinds[node] == ALIAS or node.op != "call_function" or _is_extern(node, facts):
        return False
    kernel = node.args[0] if node.target is operator.getitem else node
    return facts.nodes[kernel].category in FUSED and kernel.target not in ALWAYS_WRITTEN


def _loop_numel(node: fx.Node, facts: GraphFacts) -> int | tuple | None:
    """The elements a kernel loops over: a reduction's input, else its
    output. A reduction over leading dimensions (a bias gradient's sum over
    tokens) loops in another order, so it is ``("outer", elements)``: it
    does not fuse with the pointwise kernel it reads."""
    kernel = node.args[0] if node.target is operator.getitem else node
    if facts.nodes[kernel].category not in REDUCTIONS:
        return _numel(node)
    source = max(kernel.all_input_nodes, key=lambda arg: _numel(arg) or 0, default=None)
    if source is None:
        return None
    inputs, outputs = _shape(source), _shape(kernel)
    while outputs and outputs[-1] == 1:
        outputs.pop()
    elements = _numel(source)
    return elements if inputs[:len(outputs)] == outputs else ("outer", elements)


def _shape(node: fx.Node) -> list[int]:
    value = node.meta.get("val")
    if isinstance(value, (tuple, list)):
        value = value[0]
    return _hinted(value.shape) if isinstance(value, torch.Tensor) else []


def _hinted(sizes) -> list[int]:
    """Sizes or strides as ints, read through size hints: comparing symbolic
    ones would add shape guards."""
    return [compat.hint_int(size) for size in sizes]


def _fusion_cycle(later: fx.Node, members: set[fx.Node], first: int, position: dict,
                  buffers: set[fx.Node], facts: GraphFacts) -> bool:
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
        kernel = node in buffers or _is_extern(node, facts)
        stack.extend((arg, through_kernel or kernel) for arg in node.all_input_nodes)
    return False


def _grouped_order(order: list[fx.Node], group: dict[fx.Node, int], teams: dict[int, list[fx.Node]],
                   position: dict) -> list[fx.Node]:
    """Inductor's topological sort of its fused nodes by first step: a group
    runs at its first member's step, after whatever its members need."""
    placed: set[fx.Node] = set()
    result: list[fx.Node] = []

    def place(root: fx.Node) -> None:
        _schedule(root, placed, result, within=position)

    for node in order:
        if node in placed:
            continue
        if node in group:
            team = sorted(teams[group[node]], key=position.__getitem__)
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


def _waiting_ancestors(node: fx.Node, waiting: set[fx.Node]) -> set[fx.Node]:
    """The waiting nodes ``node`` reads, directly or through other waiting nodes."""
    needed, stack = set(), [a for a in node.all_input_nodes if a in waiting]
    while stack:
        arg = stack.pop()
        if arg not in needed:
            needed.add(arg)
            stack.extend(a for a in arg.all_input_nodes if a in waiting)
    return needed


def _is_extern(node: fx.Node, facts: GraphFacts) -> bool:
    """Whether ``node`` runs as an extern kernel (looked up: ``_lowered``)."""
    return node in _lowered(facts)[2]


def _runs_extern(node: fx.Node, facts: GraphFacts, kind: str) -> bool:
    category = facts.nodes[node].category
    if node.target is operator.getitem:
        category = facts.nodes[node.args[0]].category
    if kind == NONE and node.op != "placeholder" and isinstance(node.meta.get("val"), (tuple, list)):
        return category not in FUSED and category is not OpCategory.VIEW
    return kind == BUFFER and category not in FUSED


# How Inductor treats a node's value.
NONE, ALIAS, INLINE, BUFFER = "none", "alias", "inline", "buffer"


def value_kind(node: fx.Node, facts: GraphFacts) -> str:
    """NONE (no tensor of its own: inputs, tuples, sizes), ALIAS (a view of
    another value), INLINE (an expression Inductor may compute inside its
    readers' kernels) or BUFFER (always written to memory)."""
    node_facts = facts.nodes[node]
    if node.op == "placeholder" or node_facts.nbytes == 0 or node_facts.category is OpCategory.SYMBOLIC:
        return NONE
    if isinstance(node.meta.get("val"), (tuple, list)):
        return NONE  # its elements (getitem nodes) are the buffers
    if node_facts.category is OpCategory.VIEW:
        return ALIAS
    category = node_facts.category
    if node.target is operator.getitem:
        parent = facts.nodes[node.args[0]].category
        if parent is OpCategory.VIEW:
            return ALIAS
        category = parent
    if category in INLINABLE and node.target not in ALWAYS_WRITTEN:
        return INLINE
    return BUFFER


def owner(node: fx.Node, facts: GraphFacts) -> fx.Node:
    """The node whose buffer holds ``node``'s value (a view's base)."""
    owners = _kinds_and_owners(facts)[1]
    return owners[node] if node in owners else node


def _owner(node: fx.Node, facts: GraphFacts, kinds: dict) -> fx.Node:
    while kinds[node] == ALIAS:
        node = node.args[0]
        if node.target is operator.getitem and kinds[node] == ALIAS:
            node = node.args[0]  # an element of a split: a view of the split's input
    return node


# Kinds, owners, extern kernels and workspaces depend on the graph alone,
# not on the saved set: the budget search asks for many saved sets of one
# graph, so the last graph's are kept (one slot, compared by identity).
_last_graph: list = [None, None]


def _lowered(facts: GraphFacts) -> tuple[dict, dict, frozenset, dict]:
    """Per node of the graph: its kind, its owner; the extern kernels; the
    workspace bytes of those that have some."""
    if _last_graph[0] is not facts:
        kinds = {node: value_kind(node, facts) for node in facts.nodes}
        owners = {node: _owner(node, facts, kinds) for node in facts.nodes}
        externs = frozenset(node for node in facts.nodes if _runs_extern(node, facts, kinds[node]))
        workspaces = {node: workspace_bytes(node, facts) for node in externs}
        workspaces = {node: nbytes for node, nbytes in workspaces.items() if nbytes}
        _last_graph[:] = [facts, (kinds, owners, externs, workspaces)]
    return _last_graph[1]


def _kinds_and_owners(facts: GraphFacts) -> tuple[dict, dict]:
    return _lowered(facts)[:2]


def materialized(facts: GraphFacts, order: list[fx.Node], kept: set[fx.Node],
                 kernel_local: dict | None = None) -> set[fx.Node]:
    """The nodes of ``order`` that write a buffer of their own, by Inductor's
    rules. ``kernel_local`` collects the values realized inside one kernel
    and dropped (``_kernel_local``), each with its span of steps."""
    in_order = set(order)
    kinds = _kinds_and_owners(facts)[0]
    position = {node: step for step, node in enumerate(order)}
    externs = [step for step, node in enumerate(order) if _is_extern(node, facts)]
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
        realized = len(users) > 1 and (costly[node] or len(reads) > REALIZE_READS)
        local = realized and _kernel_local(node, users, kinds, position, externs)
        if (
            node in kept
            or node in facts.backward_outputs
            or any(_written_reader(u, facts, kinds[u]) for u in users)
            or (realized and not local)
        ):
            buffers.add(node)
        elif local and kernel_local is not None:
            kernel_local[node] = (position[node], max(position[u] for u in users))
        if node in buffers or realized:  # readers load it as one value
            inline_reads[node], costly[node] = frozenset({node}), False
        else:
            inline_reads[node] = reads
    for draw in [n for n in buffers if facts.nodes[n].category in FUSED_BUFFER]:
        last = _dropped_draw(draw, facts, kept, buffers, kinds, position, externs)
        if last is not None:
            buffers.discard(draw)
            if kernel_local is not None:
                kernel_local[draw] = (position[draw], last)
    return buffers | copied_views(facts, order, kept)


def _dropped_draw(draw: fx.Node, facts: GraphFacts, kept: set[fx.Node], buffers: set[fx.Node],
                  kinds: dict, position: dict, externs: list) -> int | None:
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
        if user in buffers or _is_extern(user, facts):
            readers.append(user)
        elif kinds[user] in (INLINE, ALIAS):
            stack.extend(user.users)
    size = _loop_numel(draw, facts)
    if not readers or any(_is_extern(r, facts) or _loop_numel(r, facts) != size for r in readers):
        return None
    last = max(position[r] for r in readers)
    if bisect.bisect_right(externs, position[draw]) != bisect.bisect_left(externs, last):
        return None  # an extern kernel runs between: it is written
    return last


def copied_views(facts: GraphFacts, order: list[fx.Node], kept: set[fx.Node]) -> set[fx.Node]:
    """Views an extern kernel of ``order`` reads that Inductor copies into a
    buffer of their own (the view node stands for the copy, alive until the
    extern kernels reading it have run).

    An extern kernel's inputs go through ``ExternKernel.realize_input``
    (torch/_inductor/ir.py; ``mm_args`` calls it for matmuls, ``process_kernel``
    for fallback kernels): a view's base is realized and the view becomes a
    ``ReinterpretView`` if ``convert_to_reinterpret_view`` can write it as
    strides over the base's layout, else ``copy_input`` writes it to a new
    buffer. A base Inductor computes in this graph and does not return gets
    a flexible layout, frozen contiguous (``freeze_layout``), not the strides
    eager gave it, so a view that merges dimensions a permute had separated
    is no longer a reinterpretation. Seen on the bench's MoE: ``silu(gate) *
    up`` has the einsum's (b, t, e, h) memory order in eager, Inductor writes
    it (b, e, t, h), and the down projection's bmm reads a second, copied
    buffer of it. Returned values keep eager's strides (GraphLowering.run_node
    requires them of outputs), and so do inputs and extern kernels' outputs.
    """
    kinds = _kinds_and_owners(facts)[0]
    relaid = relaid_contiguous(facts, order, kept)
    copies = set()
    if not relaid:
        return copies
    for reader in order:
        if not _is_extern(reader, facts):
            continue
        for arg in reader.all_input_nodes:
            if kinds[arg] == ALIAS and arg not in copies and _view_chain(arg, facts)[-1] in relaid \
                    and not _reinterpretable(arg, facts):
                copies.add(arg)
    return copies


def copy_steps(facts: GraphFacts, order: list[fx.Node], buffers: set[fx.Node]) -> dict[int, list[fx.Node]]:
    """The steps of ``order`` that write the copied views among ``buffers``.

    A copy is a pointwise node the scheduler fuses into the last fused
    kernel before the extern kernel that reads it (when there is one after
    the previous extern kernel): that kernel's inputs are still alive while
    it writes the copy. Seen in Inductor's code for the bench's MoE: in
    forward, the kernel writing ``silu(gate) * up`` writes its copy too,
    while both projections are alive; in backward, the transposed copy the
    down weight's gradient reads is written by the router's softmax
    backward kernel just before that bmm, not with its base."""
    kinds = _kinds_and_owners(facts)[0]
    copies = {n for n in buffers if kinds[n] == ALIAS}
    result: dict[int, list[fx.Node]] = {}
    if not copies:
        return result
    fused_write = None
    for step, node in enumerate(order):
        kind = kinds[node]
        if _is_extern(node, facts):
            for arg in node.all_input_nodes:
                if arg in copies:
                    copies.discard(arg)
                    result.setdefault(step if fused_write is None else fused_write, []).append(arg)
            fused_write = None
        elif node in buffers and kind != ALIAS and facts.nodes[node].category in FUSED:
            fused_write = step
    return result


def relaid_contiguous(facts: GraphFacts, order: list[fx.Node], kept: set[fx.Node]) -> set[fx.Node]:
    """The values of ``order`` Inductor writes contiguous where eager's
    strides were not. A value a fused kernel writes gets a ``FlexibleLayout``,
    which the scheduler orders as the kernel reads its inputs
    (``ComputedBuffer.decide_layout``, ``get_fill_order``: eager's strides,
    near enough), unless it is frozen first: an extern kernel reading a view
    of it freezes it contiguous (``realize_input``, then
    ``convert_to_reinterpret_view``: ``freeze_layout``), or channels-last
    where eager's layout was. Values the graph returns are fixed to eager's
    strides before that (GraphLowering.run_node requires them of outputs:
    ``kept``); inputs, saved values and extern kernels' outputs keep eager's
    strides."""
    kinds = _kinds_and_owners(facts)[0]
    strided = _graph_layouts(facts)[0]
    in_order = set(order)
    relaid = set()
    for reader in order:
        if _is_extern(reader, facts):
            for arg in reader.all_input_nodes:
                if kinds[arg] == ALIAS:
                    base = _view_chain(arg, facts)[-1]
                    if base in strided and base in in_order and base not in kept:
                        relaid.add(base)
    return relaid


def _view_chain(node: fx.Node, facts: GraphFacts) -> list[fx.Node]:
    """``node``, the views it is a view of, and last the value they view
    (a ``split`` and its elements are views too)."""
    kinds = _kinds_and_owners(facts)[0]
    chain = [node]
    while kinds[node] == ALIAS or (node.op == "call_function" and facts.nodes[node].category is OpCategory.VIEW):
        node = node.args[0]
        chain.append(node)
    return chain


def _eager_strided(node: fx.Node, facts: GraphFacts) -> bool:
    """A value a fused kernel writes whose eager strides are neither
    contiguous nor channels-last."""
    value = node.meta.get("val")
    if node.op == "placeholder" or facts.nodes[node].category not in FUSED or not isinstance(value, torch.Tensor):
        return False
    shape, strides = _hinted(value.shape), _hinted(value.stride())
    if math.prod(shape) <= 1 or strides == _contiguous_strides(shape):
        return False
    return len(shape) not in (4, 5) or strides != _channels_last_strides(shape)


def _contiguous_strides(shape: list[int]) -> list[int]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return strides[::-1]


def _channels_last_strides(shape: list[int]) -> list[int]:
    """Strides of (N, C, *spatial) with channels innermost."""
    inner = _contiguous_strides([shape[0], *shape[2:], shape[1]])
    return [inner[0], inner[-1], *inner[1:-1]]

# The nodes _eager_strided holds for, and whether a view stays a view over
# its base laid out contiguous (per view node, filled on demand): both
# depend on the graph alone (one slot, as _last_graph).
_last_layouts: list = [None, None]


def _graph_layouts(facts: GraphFacts) -> tuple[frozenset, dict]:
    if _last_layouts[0] is not facts:
        strided = frozenset(node for node in facts.nodes if _eager_strided(node, facts))
        _last_layouts[:] = [facts, (strided, {})]
    return _last_layouts[1]


def _reinterpretable(view: fx.Node, facts: GraphFacts) -> bool:
    """Whether ``view`` can be written as strides over its base laid out
    contiguous: its chain of view ops replayed on such a meta tensor, where
    ``view`` raises as ``_compute_stride`` (which Inductor's ``View.create``
    uses) finds no strides."""
    cache = _graph_layouts(facts)[1]
    if view not in cache:
        cache[view] = _replay(_view_chain(view, facts))
    return cache[view]


def _replay(chain: list[fx.Node]) -> bool:
    base = chain[-1].meta["val"]
    shape = _hinted(base.shape)
    current = torch.empty_strided(shape, _contiguous_strides(shape), dtype=base.dtype, device="meta")
    for node in reversed(chain[:-1]):
        args = [current if i == 0 else _concrete(a) for i, a in enumerate(node.args)]
        try:
            current = node.target(*args, **{k: _concrete(v) for k, v in node.kwargs.items()})
        except (RuntimeError, ValueError):  # view(): "Cannot view a tensor with shape ... and strides ..."
            return False
    return True


def _concrete(value):
    if isinstance(value, (list, tuple)):
        return type(value)(_concrete(v) for v in value)
    if isinstance(value, torch.SymInt):
        return compat.hint_int(value)
    return value


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


def _numel(node: fx.Node) -> int | None:
    value = node.meta.get("val")
    return compat.hint_int(value.numel()) if isinstance(value, torch.Tensor) else None


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


def _written_reader(reader: fx.Node, facts: GraphFacts, kind: str) -> bool:
    """A reader that needs its input in memory: an extern kernel (also one
    with several outputs, such as convolution_backward) or a buffer-writing
    kernel other than a reduction, which computes inlined inputs inside its
    own loop."""
    if _is_extern(reader, facts):
        return True
    return kind == BUFFER and facts.nodes[reader].category not in REDUCTIONS


def buffer_reads(facts: GraphFacts, order: list[fx.Node], buffers: set[fx.Node]) -> dict[fx.Node, set[fx.Node]]:
    """Per buffer-writing node of ``order``, the buffers its kernel reads
    (through inlined values and views). Values from outside ``order`` (saved
    values, inputs) are read as themselves."""
    kinds, owners = _kinds_and_owners(facts)
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
        if copies and not copies.isdisjoint(args) and _is_extern(node, facts):
            arg_sources = frozenset().union(*(frozenset({a}) if a in copies else source(a) for a in args))
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


# Attention backward kernels accumulate the query's gradient in float32 in a
# buffer of their own (FlashAttention-2's dq accumulator on CUDA). The CPU
# kernel is modelled on its own (``_cpu_attention_workspace``).
ATTENTION_BACKWARD = _every_overload(
    aten._scaled_dot_product_flash_attention_backward,
    aten._scaled_dot_product_efficient_attention_backward,
    aten._scaled_dot_product_cudnn_attention_backward,
    aten._flash_attention_backward, aten._efficient_attention_backward
)
FLOAT32_BYTES = 4


# oneDNN (mkldnn) convolutions on CPU reorder the weight into a blocked
# layout of their own on every call: a weight-sized buffer while the kernel
# runs. The backward needs it for the input's gradient, and writes the
# weight's gradient in that layout before copying it out: one more.
# Measured on transformers' ResNet-18 (``python -m bench.calibrate resnet``):
# forward 54.6 MiB, predicted 46.3 without the buffer and 55.3 with it;
# backward 73.3 MiB, three 9 MiB buffers alive at layer 4 where the model
# had one.
FORWARD_CONVOLUTIONS = _every_overload(aten.convolution)
CONVOLUTIONS = FORWARD_CONVOLUTIONS | _every_overload(aten.convolution_backward)


def workspace_bytes(node: fx.Node, facts: GraphFacts) -> int:
    """Working memory an extern kernel allocates while it runs, beyond its outputs."""
    if node.target in CPU_ATTENTION_BACKWARD:
        return _cpu_attention_workspace(node)
    if node.target in ATTENTION_BACKWARD:
        query = node.args[1].meta.get("val")
        if isinstance(query, torch.Tensor):
            return compat.hint_int(query.numel()) * FLOAT32_BYTES
    if node.target in CONVOLUTIONS:
        forward = node.target in FORWARD_CONVOLUTIONS
        weight = node.args[1] if forward else node.args[2]
        value = weight.meta.get("val") if isinstance(weight, fx.Node) else None
        if isinstance(value, torch.Tensor) and value.device.type == "cpu":
            # convolution_backward's output_mask: (input, weight, bias) gradients wanted
            copies = 1 if forward else sum(bool(wanted) for wanted in node.args[10][:2])
            return copies * compat.hint_int(value.numel()) * value.element_size()
    return 0


CPU_ATTENTION_BACKWARD = _every_overload(aten._scaled_dot_product_flash_attention_for_cpu_backward)


def _cpu_attention_workspace(node: fx.Node) -> int:
    """Working memory of the CPU flash-attention backward, measured against
    aten/src/ATen/native/cpu/FlashAttentionKernel.cpp: per thread, two
    float32 blocks (attention, its gradient) of query-split x kv-split
    elements, and their reduced-precision copies for half types, which also
    accumulate the query's gradient in float32; plus a copy of the output's
    gradient unless it is laid out (batch, seq, heads, dim), as the views of
    a matmul's output are. GPT-2 (4 x 4 x 64 x 32): 32 KiB, where the
    query's size in float32 (128 KiB) was assumed before."""
    grad_out, query, key = (arg.meta.get("val") for arg in node.args[:3])
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (grad_out, query, key)):
        return 0
    q_len, kv_len = compat.hint_int(query.shape[2]), compat.hint_int(key.shape[2])
    q_split = min(q_len, 256 if q_len >= 768 else 64 if q_len >= 192 else 32)
    kv_split = min(kv_len, 512)
    reduced = query.dtype in (torch.float16, torch.bfloat16)
    per_thread = 2 * q_split * kv_split * (FLOAT32_BYTES + (query.element_size() if reduced else 0))
    # the thread count is the machine's (the same on every rank of a job)
    workspace = torch.get_num_threads() * per_thread
    if reduced:
        workspace += compat.hint_int(query.numel()) * FLOAT32_BYTES
    # is grad_out in (batch, seq, heads, dim) memory order?
    shape, strides = _hinted(grad_out.shape), _hinted(grad_out.stride())
    order = (0, 2, 1, 3)
    blhd = _contiguous_strides([shape[i] for i in order])
    if any(shape[i] > 1 and strides[i] != want for i, want in zip(order, blhd)):
        workspace += math.prod(shape) * grad_out.element_size()
    return workspace


def _op_name(node: fx.Node) -> str:
    packet = getattr(node.target, "overloadpacket", None)
    return getattr(packet, "__name__", "")


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
