"""How ckpt's backward graphs fuse: Inductor's heuristics with one change,
a decision (the peak model and the bench measure against it), built on the
Inductor hooks of ckpt_compat."""
from __future__ import annotations

import torch.fx as fx

import ckpt_compat as compat

# Inductor fuses two kernels that only share inputs (horizontal fusion) when
# they are at most 64 scheduler nodes apart (Scheduler.are_long_distant_nodes,
# written for checkpointed regions). Fusing runs the later kernel with the
# earlier one, and with it every kernel it depends on. With recomputation,
# 64 nodes span a decoder layer: Inductor moved the next layer's recomputed
# RMSNorm, projections and RoPE into the current layer's backward kernels,
# so two layers' recomputed values were alive at once. ckpt's backward
# graphs fuse horizontally within NEAR_FUSION_DISTANCE nodes, and farther
# only when the later kernel is a reduction to a small result (a LayerNorm's
# weight gradient: refusing those raised the bench GPT's peak at budget 0.0
# from 5.35 to 5.91 MiB). Measured with ``python -m bench.calibrate MODEL
# --budget 0.0``: transformers Llama at seq 512 (llama8) 50.8 -> 47.7 MiB
# with the farther fusions judged by bytes written and freed, 42.1 with this
# rule; tiny Llama 3.60 -> 2.85 MiB; bench GPT 5.35 either way.
NEAR_FUSION_DISTANCE = 8
# A kernel whose writes are this many times smaller than its largest read
# is a reduction (a weight gradient's sum over tokens): running it early
# allocates next to nothing.
REDUCTION_RATIO = 64


class NearHorizontalFusion(compat.InductorChoices):
    """Inductor's heuristics, except that a backward graph fuses kernels that
    only share inputs when they are near, or the later one is a reduction."""

    def uuid(self) -> str:
        return f"ckpt-near-horizontal-fusion-{NEAR_FUSION_DISTANCE}-{REDUCTION_RATIO}"

    def can_fuse_horizontal(self, scheduler, node1, node2, shared_data_score) -> bool:
        if not super().can_fuse_horizontal(scheduler, node1, node2, shared_data_score):
            return False
        span = max(node1.max_order, node2.max_order) - min(node1.min_order, node2.min_order)
        if span <= NEAR_FUSION_DISTANCE:
            return True
        late = max(node1, node2, key=lambda n: n.min_order)
        written = sum(dep.numbytes_hint() for dep in late.read_writes.writes)
        largest_read = max((dep.numbytes_hint() for dep in late.read_writes.reads), default=0)
        return written * REDUCTION_RATIO <= largest_read


def compile_fx_near_fusion_in_backward(gm: fx.GraphModule, example_inputs, config_patches: dict,
                                       uncached: bool = False):
    """Inductor's ``compile_fx``, whose backward graphs fuse far-apart kernels
    that only share inputs when the later is a reduction (forward graphs are
    compiled as Inductor would).

    ``uncached``: neither Inductor's nor AOTAutograd's cache serves or
    keeps the graph. The backward graph is compiled lazily, at the first
    backward, outside this call: the rule goes in through ``inner_compile``, which Inductor
    calls for both graphs. The partitioner's uuid covers this file (partition.py), so a
    cached graph never crosses the rule.
    """

    def inner_compile(graph: fx.GraphModule, inputs, **kwargs):
        if not kwargs.get("is_backward", False):
            return compat.compile_fx_inner(graph, inputs, **kwargs)
        with compat.V.set_choices_handler(NearHorizontalFusion()):
            return compat.compile_fx_inner(graph, inputs, **kwargs)

    if not uncached:
        return compat.compile_fx(gm, example_inputs, inner_compile=inner_compile, config_patches=config_patches)
    # Inductor keys its caches by the partitioner's uuid, and a None uuid is
    # a key like any other: a graph whose partition must run (to report it,
    # or for the step view to learn its plan) turns both caches off.
    with compat.disable_compile_caches(config_patches) as patches:
        return compat.compile_fx(gm, example_inputs, inner_compile=inner_compile, config_patches=patches)
