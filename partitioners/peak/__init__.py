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
reading more than Inductor's ``realize_reads_threshold`` buffers. Reductions,
scatters and concatenations always write a buffer. An extern kernel reading a
view that Inductor cannot express as strides over its base's layout reads a
copy of its own (``copied_views``). Extern kernels that allocate working
memory of their own (attention backward) add it while they run
(``workspace_bytes``).

The order follows Inductor's scheduler: kernels run as fused runs between
extern kernels (``kernel_order``), and a kernel fuses with an earlier one it
reads across extern kernels when that makes no cycle; the fused kernel runs
at the earlier one's place, after the extern kernels it needs
(``fused_across_externs``). A random draw only its own fused kernel reads
gets no buffer.

Deterministic: a function of the graph, the saved set and Inductor's active
config (``realize_reads_threshold``, ``max_fusion_size``), no timing, no
allocation, so every rank predicts the same.

One module per job, each importing only those before it:

- ``kinds``: Inductor's vocabulary (which ops it fuses, how it treats a
  value) and the size and stride readings the others share;
- ``workspace``: per-op working memory (attention backward, convolutions);
- ``lowering``: the per-graph state, ``LoweredGraph``, built once per graph
  (and per Inductor setting) by ``lower`` and kept on the graph's
  ``GraphFacts``;
- ``layouts``: values Inductor lays out otherwise than eager, and the views
  it must copy for extern kernels;
- ``schedule``: the order kernels run in (backward's schedule, runs between
  extern kernels, fusion across them);
- ``buffers``: which values get a buffer, and what each kernel reads;
- ``memory_plan``: Inductor's own estimate, its reuse pool, in-place writes;
- ``liveness``: the liveness walk (``walk``) and ``estimate_step_peak``.
"""
from .buffers import buffer_reads, materialized
from .kinds import value_kind
from .layouts import copied_views, copy_steps, relaid_contiguous
from .lowering import LoweredGraph, lower, owner
from .memory_plan import inductor_estimate, reuse_pool
from .schedule import backward_schedule, fused_across_externs, kernel_order, mm_at_its_add
from .liveness import PeakEstimate, estimate_step_peak, walk
from .workspace import workspace_bytes

__all__ = [
    "LoweredGraph",
    "PeakEstimate",
    "backward_schedule",
    "buffer_reads",
    "copied_views",
    "copy_steps",
    "estimate_step_peak",
    "fused_across_externs",
    "inductor_estimate",
    "kernel_order",
    "lower",
    "materialized",
    "mm_at_its_add",
    "owner",
    "relaid_contiguous",
    "reuse_pool",
    "value_kind",
    "walk",
    "workspace_bytes",
]
