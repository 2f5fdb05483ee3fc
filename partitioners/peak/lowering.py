"""The per-graph state of the peak model: how Inductor lowers one joint
graph, whatever the saved set (``LoweredGraph``).

Kinds, owners, extern kernels, workspaces and eager-strided values depend on
the graph alone, not on the saved set, and the budget search asks for many
saved sets of one graph: ``lower`` builds them once and keeps them on the
graph's ``GraphFacts`` (``derived``), so they live as long as the graph, and
the walk passes them down explicitly.

Inductor's settings that change its lowering and fusion
(``realize_reads_threshold``, ``max_fusion_size``) are read from its active
config when a ``LoweredGraph`` is built, and one is kept per setting. The
partitioner runs inside ``compile_fx``, under the config patches ckpt's
backend makes of torch.compile's ``mode`` and ``options``
(ckpt/backend.py ``inductor_patches``), also when the step view plans a
graph again: the model sees the values the compile does. Outside a compile
(tests, bench.calibrate) it reads the global config.
"""
from __future__ import annotations

import dataclasses

import torch.fx as fx

import ckpt_compat as compat
from ..classify import GraphFacts, graph_device
from .kinds import _eager_strided, _owner, _runs_extern, value_kind
from .workspace import channels_last_workspace, workspace_bytes


@dataclasses.dataclass(frozen=True)
class LoweredGraph:
    """One graph as Inductor lowers it, under one setting of Inductor's config."""

    kinds: dict[fx.Node, str]
    """Per node, ``kinds.value_kind``: NONE, ALIAS, INLINE or BUFFER."""
    owners: dict[fx.Node, fx.Node]
    """Per node, the node whose buffer holds its value (a view's base)."""
    externs: frozenset[fx.Node]
    """The nodes that run as extern kernels (matmuls, attention, fallbacks)."""
    workspaces: dict[fx.Node, int]
    """Per extern kernel that has some, its working memory (``workspace_bytes``)."""
    channels_last_workspaces: dict[fx.Node, int | None]
    """Per convolution backward, its working memory run channels-last
    (``channels_last_workspace``; filled on demand, None: not measured)."""
    strided: frozenset[fx.Node]
    """Values a fused kernel writes whose eager strides are neither
    contiguous nor channels-last (``kinds._eager_strided``)."""
    reinterpretable: dict[fx.Node, bool]
    """Per view an extern kernel reads, whether it stays a view over its base
    laid out contiguous (``layouts._reinterpretable``; filled on demand)."""
    realize_reads: int
    """torch._inductor.config.realize_reads_threshold: a reused pointwise
    value reading more buffers than this is stored rather than recomputed
    per reader."""
    max_fused: int
    """torch._inductor.config.max_fusion_size: nodes in one fused kernel."""
    one_call_per_run: bool = False
    """A CPU graph: Inductor's C++ backend writes the fused kernels between
    two extern kernels as one function, called once, and frees what they
    read after that call (codegen/cpp.py ``kernel_group``, flushed at the
    next extern kernel; the scheduler frees at ``flush``). On GPU each
    kernel frees its inputs as it ends."""
    peaks: dict = dataclasses.field(default_factory=dict, compare=False)
    """``liveness.estimate_step_peak``'s estimates by saved set (a frozenset):
    the budget search's cuts often save the same values (about a third of
    them on Swin, T5 and Mamba2), and a walk is the search's costliest step."""


def lower(facts: GraphFacts) -> LoweredGraph:
    """``facts``' graph as Inductor lowers it under its active config: built
    on the first call for a graph and setting, then kept on ``facts``."""
    realize_reads = compat.inductor_setting("realize_reads_threshold")
    max_fused = compat.inductor_setting("max_fusion_size")
    unroll = compat.inductor_setting("unroll_reductions_threshold")
    key = (LoweredGraph, realize_reads, max_fused, unroll)
    lowered = facts.derived.get(key)
    if lowered is None:
        lowered = facts.derived[key] = _build(facts, realize_reads, max_fused, unroll)
    return lowered


def _build(facts: GraphFacts, realize_reads: int, max_fused: int, unroll: int) -> LoweredGraph:
    kinds = {node: value_kind(node, facts, unroll) for node in facts.nodes}
    owners = {node: _owner(node, facts, kinds) for node in facts.nodes}
    externs = frozenset(node for node in facts.nodes if _runs_extern(node, facts, kinds[node]))
    workspaces = {node: workspace_bytes(node, facts) for node in externs}
    device = graph_device(facts.nodes)
    return LoweredGraph(
        kinds=kinds,
        owners=owners,
        externs=externs,
        workspaces={node: nbytes for node, nbytes in workspaces.items() if nbytes},
        channels_last_workspaces={},
        strided=frozenset(node for node in facts.nodes if _eager_strided(node, facts)),
        reinterpretable={},
        realize_reads=realize_reads,
        max_fused=max_fused,
        one_call_per_run=device is not None and device.type == "cpu",
    )


def workspace_at(node: fx.Node, channels_last: bool, lowered: LoweredGraph) -> int:
    """``node``'s working memory where its graph runs convolutions
    channels-last or not (``runs_channels_last``). Channels-last, the
    larger of the measured scratch and the table's: the measurement is at
    batch 1, where oneDNN runs a dense convolution's backward another way
    (0.03 weights of scratch, against 2 at batch 8; a depthwise one's is
    the same at both)."""
    table = lowered.workspaces.get(node, 0)
    if channels_last and node in lowered.workspaces:
        if node not in lowered.channels_last_workspaces:
            lowered.channels_last_workspaces[node] = channels_last_workspace(node)
        measured = lowered.channels_last_workspaces[node]
        if measured is not None:
            return max(measured, table)
    return table


def owner(node: fx.Node, facts: GraphFacts, lowered: LoweredGraph | None = None) -> fx.Node:
    """The node whose buffer holds ``node``'s value (a view's base)."""
    owners = (lowered or lower(facts)).owners
    return owners[node] if node in owners else node
