"""Every private torch API ckpt touches, in one module: the bottom layer,
which passes/, partitioners/ and ckpt/ import and which imports none of them.

A torch upgrade should be this file's work only. Each helper names the torch
function it wraps; keep them thin.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Mapping

import torch
import torch._functorch.config
import torch._guards
import torch._inductor.config
import torch.fx as fx
from torch._functorch import partitioners as _torch_partitioners
from torch._functorch._aot_autograd import utils as _aot_utils
from torch._functorch._aot_autograd.graph_compile import is_opaque_node
from torch._functorch._aot_autograd import descriptors as _descriptors
# Dynamo wraps an exception a backend raises in BackendCompilerFailed, whose
# first line is "backend='...' raised:", except for ShortenTraceback and its
# subclasses, which it re-raises as they are. Inductor's own set-up errors
# (TritonMissing) derive from it for the same reason.
from torch._dynamo.exc import ShortenTraceback
from torch._functorch.compile_utils import fx_graph_cse, raise_getitems
from torch._inductor.choices import InductorChoices
from torch._inductor.compile_fx import compile_fx, compile_fx_inner
from torch._inductor.virtualized import V
from torch._inductor.utils import is_pointwise_use  # noqa: F401  re-exported
from torch._prims_common import is_expandable_to  # noqa: F401  re-exported
from torch._inductor.custom_graph_pass import CustomPartitionerFn, get_hash_for_files
from torch.fx.experimental._backward_state import BackwardState
from torch.fx.experimental.proxy_tensor import is_sym_node
from torch.fx.experimental.symbolic_shapes import optimization_hint, statically_known_true
from torch.utils.checkpoint import CheckpointPolicy

import torch._inductor.inductor_prims  # noqa: F401  registers prims.inductor_*

__all__ = [
    "BackwardState",
    "CheckpointPolicy",
    "CustomPartitionerFn",
    "OpOverload",
    "ShortenTraceback",
    "SizeSymbol",
    "after_backward",
    "argument_index",
    "backward_nodes",
    "gradient_of",
    "is_effect_token",
    "InductorChoices",
    "V",
    "compile_fx",
    "compile_fx_inner",
    "disable_compile_caches",
    "cse",
    "current_tracing_context",
    "default_store",
    "example_inputs_of",
    "extract_forward_backward",
    "get_hash_for_files",
    "hint_int",
    "inductor_config_patches",
    "inductor_option_names",
    "inductor_setting",
    "is_bwd_seed_offset",
    "is_fwd_seed_offset",
    "is_opaque_node",
    "is_primal",
    "is_sym_node",
    "is_tangent",
    "is_with_effects",
    "memory_events",
    "memory_peak",
    "start_recording_memory",
    "stop_recording_memory",
    "module_stack",
    "must_be_in_backward",
    "must_be_in_forward",
    "placeholder_source",
    "planning_at",
    "profiler_active",
    "raise_getitems",
    "recompile_in",
    "reorder_to_autograd_engine",
    "size_symbols",
    "same_sizes",
    "thread_graphsafe_rng_from_hops",
    "torch_default_partition",
    "flop_formula",
]

OpOverload = torch._ops.OpOverload

# Placeholder roles: AOTAutograd names joint-graph placeholders by role
# (primals_*, tangents_*, fwd_seed, ...); torch's own helpers read the names.
is_primal = _aot_utils._is_primal
is_tangent = _aot_utils._is_tangent
is_fwd_seed_offset = _aot_utils._is_fwd_seed_offset
is_bwd_seed_offset = _aot_utils._is_bwd_seed_offset
is_with_effects = _aot_utils.is_with_effects

# AOTAutograd describes each joint-graph input and output (meta["desc"]):
# exact where names and order are not (effect tokens come first among the
# primals; a gradient's place in the outputs is its primal's only without them).
def argument_index(node: fx.Node) -> int | None:
    """The index, among the arguments the compiled graph is called with, of
    a primal that is one of them as is; None for other inputs (parameters
    AOTAutograd lifted itself, effect tokens, synthetic bases)."""
    desc = node.meta.get("desc")
    return desc.idx if isinstance(desc, _descriptors.PlainAOTInput) else None


def is_effect_token(node: fx.Node) -> bool:
    return isinstance(node.meta.get("desc"), _descriptors.ForwardTokenAOTInput)


def gradient_of(output_node: fx.Node) -> list | None:
    """Per flat output of a joint graph, the descriptor of the input it is
    the gradient of (None for outputs that are not gradients); None where
    the graph carries no descriptors."""
    descs = output_node.meta.get("desc")
    if not isinstance(descs, (list, tuple)) or any(
            isinstance(d, _descriptors.SubclassGetAttrAOTOutput) for d in descs):
        return None  # a subclass's gradient is several outputs, its input several placeholders
    return [d.grad_of if isinstance(d, _descriptors.GradAOTOutput) else None for d in descs]


# Placement tags AOTAutograd writes into node.meta["partitioner_tag"].
must_be_in_forward = _torch_partitioners._must_be_in_forward
must_be_in_backward = _torch_partitioners._must_be_in_backward


def backward_nodes(graph: fx.Graph) -> set[fx.Node]:
    """A joint graph's backward: tangents, backward RNG seeds, nodes tagged
    must-be-in-backward, and everything downstream of them."""
    closure: set[fx.Node] = set()
    for node in graph.nodes:  # topological order: inputs come first
        if node.op == "output":
            continue
        if (
            is_tangent(node)
            or is_bwd_seed_offset(node)
            or must_be_in_backward(node)
            or any(arg in closure for arg in node.all_input_nodes)
        ):
            closure.add(node)
    return closure


# Inductor fuses a device's seed (and eager-offset) draws into one node that
# feeds every random op of the graph (fx_passes/replace_random.py). From
# torch 2.14 that node copies the first draw's meta, nn_module_stack included,
# so it would be named after the first dropout's module; 2.13 leaves it
# without a module stack.
_FUSED_RNG_STATE_OPS = frozenset({
    torch.ops.prims.inductor_seeds.default,
    torch.ops.prims.inductor_rand_eager_offsets.default,
})


def module_stack(node: fx.Node) -> dict | None:
    """The node's ``nn_module_stack`` (Dynamo's module paths, outermost
    first), or None: unknown, or a graph-wide node such as Inductor's fused
    seeds, which belongs to no one module on any torch version."""
    if node.target in _FUSED_RNG_STATE_OPS:
        return None
    return node.meta.get("nn_module_stack")


_planned_sizes: contextvars.ContextVar[dict | None] = contextvars.ContextVar("ckpt_planned_sizes", default=None)


def region_budget_of(node: fx.Node) -> float | None:
    """The budget ``torch.autograd.graph.region_activation_memory_budget(b)``
    left on ``node`` (None: outside any region, or a torch without the API)."""
    reader = getattr(torch.fx.traceback, "_get_memory_budget_annotation", None)
    return None if reader is None else reader(node)


def placeholder_source(node: fx.Node) -> str | None:
    """Where Dynamo found a graph input (``L['self']._modules['up']._parameters['weight']``),
    from the placeholder's ``grapharg``; None if unknown."""
    grapharg = node.meta.get("grapharg")
    source = getattr(grapharg, "source", None)
    return None if source is None else source.name


def functorch_memory_budget() -> float:
    """``torch._functorch.config.activation_memory_budget`` (1.0: PyTorch's default, none)."""
    return float(torch._functorch.config.activation_memory_budget)


def hint_int(value: int | torch.SymInt) -> int:
    """A concrete int for a possibly symbolic size: the traced example's
    value, or inside ``planning_at`` the size planned for."""
    sizes = _planned_sizes.get()
    if sizes and isinstance(value, torch.SymInt):
        expr = value.node.expr
        hints = _hints(value.node.shape_env)
        mapping = {s: sizes.get(str(s), hints.get(s, 4096)) for s in expr.free_symbols}
        return int(expr.xreplace(mapping))
    # 4096 is torch's own fallback for unbacked sizes (partitioners._size_of).
    return int(optimization_hint(value, fallback=4096))


def _hints(shape_env) -> dict:
    """The ShapeEnv's example value of each backed symbol (2.13 renamed the map)."""
    return getattr(shape_env, "backed_var_to_val", None) or shape_env.var_to_val


@contextlib.contextmanager
def planning_at(sizes: dict[str, int] | None):
    """Inside the block, ``hint_int`` reads the symbols named in ``sizes``
    (``{"s0": 512}``) at those values: a dynamic graph planned for its
    largest size, not the first example's."""
    token = _planned_sizes.set(dict(sizes) if sizes else None)
    try:
        yield
    finally:
        _planned_sizes.reset(token)


@dataclasses.dataclass(frozen=True)
class SizeSymbol:
    """A dynamic size of a Dynamo graph: where its runtime value is read
    (placeholder index, and tensor dimension or None for a SymInt input),
    its example value and its declared upper bound (None: unbounded)."""

    name: str
    placeholder: int
    dim: int | None
    hint: int
    upper: int | None


def size_symbols(gm: fx.GraphModule) -> list[SizeSymbol]:
    """The plain symbols among a Dynamo graph's input sizes, each once, with
    where to read it from the call's arguments."""
    import sympy

    found: dict[str, SizeSymbol] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for index, node in enumerate(placeholders):
        value = node.meta.get("example_value", node.meta.get("val"))
        if isinstance(value, torch.SymInt):
            places = [(None, value)]
        elif isinstance(value, torch.Tensor):
            places = list(enumerate(value.shape))
        else:
            continue
        for dim, size in places:
            if not isinstance(size, torch.SymInt) or not isinstance(size.node.expr, sympy.Symbol):
                continue
            symbol = size.node.expr
            if str(symbol) in found:
                continue
            shape_env = size.node.shape_env
            value_range = shape_env.var_to_range.get(symbol)
            found[str(symbol)] = SizeSymbol(
                str(symbol), index, dim, int(_hints(shape_env).get(symbol, 0)),
                _finite_bound(value_range.upper) if value_range is not None else None,
            )
    return list(found.values())


def _finite_bound(upper) -> int | None:
    """A declared upper bound as an int; None for none (Dynamo's int_oo, or
    the sys.maxsize it uses for sizes it knows nothing of)."""
    import sympy

    if not isinstance(upper, (int, sympy.Integer)):  # int_oo says it is finite
        return None
    bound = int(upper)
    return bound if bound < 2**62 else None


def same_sizes(a: torch.Size, b: torch.Size) -> bool:
    """Whether two shapes are equal for every value of their size symbols,
    decided without adding a guard (a partitioner must not specialize)."""
    return len(a) == len(b) and all(statically_known_true(x == y) for x, y in zip(a, b))


def current_tracing_context():
    """Dynamo's tracing context of the graph being compiled (None outside)."""
    return torch._guards.TracingContext.try_get()


def recompile_in(tracing_context, compile_graph):
    """Run ``compile_graph()`` inside Dynamo's tracing context of the
    original compile, as Dynamo itself recompiles a graph for a
    specialization at run time (output_graph.py, specialized_dispatch)."""
    if tracing_context is None:
        return compile_graph()
    with torch._guards.tracing(tracing_context):
        compiled = compile_graph()
        ddp = getattr(tracing_context, "ddp_optimizer_ctx", None)
        if ddp is not None:
            # Under DDP's graph optimizer one tracing context serves every
            # bucket's graph: each forward compile pushes its metadata and
            # the lazy backward compile pops it, last bucket first (Note
            # [DDPOptimizer and fw_metadata]). Push as it does, on top of
            # what the earlier backward compiles left.
            del ddp.metadata_per_bucket[ddp.curr_bucket + 1:]
            ddp.curr_bucket += 1
            ddp.metadata_per_bucket.append(tracing_context.fw_metadata)
        return compiled


def has_fake_tensors(values) -> bool:
    """Whether any of ``values`` is a fake tensor (a call during compilation)."""
    from torch._subclasses.fake_tensor import is_fake

    return any(isinstance(v, torch.Tensor) and is_fake(v) for v in values)


def example_inputs_of(gm: fx.GraphModule) -> list:
    """A Dynamo graph's fake example inputs (its placeholders' example
    values, symbolic sizes included), to compile it again without holding
    the real tensors of its first call."""
    values = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            values.append(node.meta.get("example_value", node.meta.get("val")))
    return values


def after_backward(callback) -> None:
    """Run ``callback()`` when the autograd engine finishes the backward
    pass that is running now (call from a backward hook)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def profiler_active() -> bool:
    """Whether a torch profiler is recording (its memory events must not be
    taken from under it)."""
    # The Python flag misses a profiler started another way (legacy, ITT,
    # from C++); the C++ one sees them all.
    return bool(torch.autograd.profiler._is_profiler_enabled) or torch._C._autograd._profiler_enabled()


def memory_events(prof, device_type: str = "cpu", index: int | None = None) -> list[tuple[int, int, int]]:
    """``(time_ns, address, bytes)`` of a finished profile's ``[memory]``
    events on one device type (and device ``index``, if given), in time
    order (ties keep the profiler's order; bytes are negative for frees).
    ``prof`` is a ``torch.profiler`` profile or what ``stop_recording_memory``
    returned. Reads the profiler's private event tree, which gives each
    event its address."""
    results = prof.profiler.kineto_results if hasattr(prof, "profiler") else prof
    events, stack = [], list(reversed(results.experimental_event_tree()))
    while stack:  # depth first, in the tree's order
        node = stack.pop()
        stack.extend(reversed(node.children))
        fields = node.extra_fields
        if (node.name == "[memory]" and fields.device.type == device_type
                and (index is None or fields.device.index == index)):
            events.append((node.start_time_ns, fields.ptr, fields.alloc_size))
    return sorted(events, key=lambda e: e[0])


def memory_peak(prof, until_ns: int | None = None, device: torch.device | None = None) -> int:
    """The running maximum of a finished profile's live bytes on ``device``
    (default: the CPU), above what was alive when it started, over its
    events up to ``until_ns``."""
    live = peak = 0
    kind, index = ("cpu", None) if device is None else (device.type, device.index)
    for time_ns, _, nbytes in memory_events(prof, kind, index):
        if until_ns is not None and time_ns > until_ns:
            break
        live += nbytes
        peak = max(peak, live)
    return peak


# No record function's scope is this one in a training step, so a recorder
# that listens only to it gets no record-function callbacks.
_UNUSED_SCOPE = "LITE_INTERPRETER"


def start_recording_memory() -> None:
    """Start the profiler with its memory events and nothing else: no
    record-function callbacks, so no operator events.

    Why not ``torch.profiler.profile``: a profiler that is stopped while a
    record function it saw begin is still open, and followed by another
    before that function ends, corrupts the heap (the function's end writes
    into the first profiler's freed event; valgrind shows the write in
    ``onFunctionExit``). The step view starts its recorder in one graph call
    and stops it in a later one, inside Dynamo's and autograd's record
    functions, so it must not give them any. Also cheaper: no per-operator
    events."""
    from torch._C._profiler import RecordScope, _ExperimentalConfig
    from torch.autograd import ProfilerActivity, ProfilerConfig, ProfilerState, _enable_profiler, _prepare_profiler

    config = ProfilerConfig(ProfilerState.KINETO, False, True, False, False, False, _ExperimentalConfig(), "")
    activities = {ProfilerActivity.CPU}
    _prepare_profiler(config, activities)
    _enable_profiler(config, activities, {getattr(RecordScope, _UNUSED_SCOPE)})


def stop_recording_memory():
    """Stop what ``start_recording_memory`` started; its events, for
    ``memory_events`` and ``memory_peak``. None where a profiler of the
    user's started meanwhile (it replaces the recorder): that one is left
    running, and the recording is lost."""
    from torch.autograd import _disable_profiler

    if torch.autograd.profiler._is_profiler_enabled or not torch._C._autograd._profiler_enabled():
        return None
    return _disable_profiler()


def cse(gm: fx.GraphModule) -> None:
    """Common-subexpression elimination on a joint graph, in place."""
    gm.graph = fx_graph_cse(gm.graph)
    gm.recompile()


def extract_forward_backward(
    joint_gm: fx.GraphModule,
    saved_values: list[fx.Node],
    saved_sym_nodes: list[fx.Node],
    saved_opaque_nodes: list[fx.Node],
    *,
    num_fwd_outputs: int,
    static_lifetime_input_nodes: set[fx.Node],
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Build the forward and backward modules for a chosen saved set, with
    torch's extraction (``_extract_fwd_bwd_modules``, which keeps AOTAutograd's
    output conventions). Nodes keep their joint-graph order: the passes in
    passes/partitioned.py reorder them."""
    from torch.utils._ordered_set import OrderedSet

    return _torch_partitioners._extract_fwd_bwd_modules(
        joint_gm,
        saved_values,
        saved_sym_nodes=saved_sym_nodes,
        saved_opaque_nodes=saved_opaque_nodes,
        num_fwd_outputs=num_fwd_outputs,
        static_lifetime_input_nodes=OrderedSet(static_lifetime_input_nodes),
    )


# Graph rewrites torch's partitioner applies to the graphs it extracts;
# passes/partitioned.py applies them to ckpt's.
reorder_to_autograd_engine = _torch_partitioners.reordering_to_mimic_autograd_engine
thread_graphsafe_rng_from_hops = _torch_partitioners.thread_graphsafe_rng_from_hops


def default_store():
    """The c10d key-value store of the default process group (or None)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.distributed_c10d._get_default_store()


def torch_default_partition(
    joint_gm: fx.GraphModule, joint_inputs, **kwargs
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """PyTorch's own min-cut partitioner, as Inductor would call it."""
    kwargs.pop("compiler", None)
    return _torch_partitioners.min_cut_rematerialization_partition(
        joint_gm, joint_inputs, compiler="inductor", **kwargs
    )


def flop_formula(target):
    """torch.utils.flop_counter's FLOP formula for an op (None if it has none).

    The formula takes the op's (fake) arguments plus ``out_val=`` its output.
    """
    from torch.utils.flop_counter import flop_registry

    packet = getattr(target, "overloadpacket", target)
    return flop_registry.get(packet)


def inductor_relayouts_convolutions(gm: fx.GraphModule) -> bool:
    """Whether Inductor's layout optimization will run this graph's
    convolutions channels-last (copying NCHW inputs and weights to do so)."""
    from torch._inductor.graph import GraphLowering

    try:
        return bool(GraphLowering.decide_layout_opt(gm, is_inference=False))
    except Exception:  # a heuristic's internals changed: assume no copies
        return False


def inductor_runs_cpu_convolutions_channels_last(has_convolution: bool) -> bool:
    """Whether Inductor lays out a CPU graph's convolutions channels-last
    (``GraphLowering.decide_layout_opt``): where forced, else where the graph
    holds a forward convolution and oneDNN is enabled and available; a graph
    without one keeps the strides eager gave its values."""
    config = torch._inductor.config
    if not config.layout_optimization:
        return False
    return bool(config.force_layout_optimization or (
        has_convolution and torch.backends.mkldnn.enabled and torch.backends.mkldnn.is_available()
    ))


_CONVOLUTION_SCRATCH: dict[tuple, int] = {}


def channels_last_convolution_backward_scratch(node: fx.Node) -> int | None:
    """Working memory beyond its outputs of ``node``, an
    ``aten.convolution_backward`` of a 2-d CPU convolution, run
    channels-last (weight too, as Inductor passes it): measured once per
    process and shape (profiler memory events), on zeros of batch 1. A
    depthwise backward's scratch depends on the weight and kernel, not on
    the batch or the image (a 7x7 one holds 257 weight-sized buffers on
    AVX-512 CPUs, 65 on AVX2, a 3x3 one two); a dense one takes another
    path at batch 1 (callers keep a floor for it). None where it cannot be
    measured: another profiler is recording, a size other than the batch
    is symbolic, or the op fails here."""
    grad, value, weight = (arg.meta.get("val") if isinstance(arg, fx.Node) else None for arg in node.args[:3])
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 and t.device.type == "cpu" for t in (grad, value, weight)):
        return None
    rest = tuple(tuple(a) if isinstance(a, (list, tuple)) else a for a in node.args[3:])
    sizes = (*grad.shape[1:], *value.shape[1:], *weight.shape,
             *(a for arg in rest for a in (arg if isinstance(arg, tuple) else (arg,))))
    if any(isinstance(size, torch.SymInt) for size in sizes):
        return None  # a dynamic image or channel count: not one shape to measure
    shapes = (tuple(grad.shape[1:]), tuple(value.shape[1:]), tuple(weight.shape))
    key = (shapes, value.dtype, rest, torch.get_num_threads())
    if key in _CONVOLUTION_SCRATCH:
        return _CONVOLUTION_SCRATCH[key]
    if profiler_active():
        return None
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    def zeros(shape):
        return torch.zeros(shape, dtype=value.dtype, device="cpu").contiguous(memory_format=torch.channels_last)

    try:
        # The partitioner runs under the compile's fake mode: real tensors here.
        with unset_fake_temporarily(), torch.no_grad():
            operands = (zeros((1, *shapes[0])), zeros((1, *shapes[1])), zeros(shapes[2]))
            start_recording_memory()
            try:
                outputs = torch.ops.aten.convolution_backward.default(*operands, *node.args[3:])
            finally:
                recorded = stop_recording_memory()
        if recorded is None:
            return None
        peak = memory_peak(recorded)
    except Exception:  # an op or a profiler this torch does not have: not measured
        return None
    returned = sum(t.numel() * t.element_size() for t in outputs if isinstance(t, torch.Tensor))
    _CONVOLUTION_SCRATCH[key] = max(peak - returned, 0)
    return _CONVOLUTION_SCRATCH[key]


def inductor_config_patches(mode: str | None, options: dict | None) -> dict:
    """The Inductor config changes that torch.compile(mode=..., options=...)
    makes for backend="inductor": its preset table for ``mode``, its checks of
    option names and types (RuntimeError, as Inductor raises it).

    torch.compile builds ``torch._TorchCompileInductorWrapper`` for Inductor;
    a custom backend gets the raw arguments, so ckpt builds the same wrapper.
    """
    return dict(torch._TorchCompileInductorWrapper(mode, options, dynamic=None).config)


def inductor_option_names() -> list[str]:
    """Every name torch.compile(options=...) accepts (``torch._inductor.list_options``)."""
    import torch._inductor

    return torch._inductor.list_options()


def inductor_settings_patched(settings: Mapping):
    """A context in which ``torch._inductor.config`` has ``settings``."""
    return torch._inductor.config.patch(dict(settings))


def inductor_setting(name: str):
    """The value of ``torch._inductor.config.<name>`` in force now, patches
    included: ``compile_fx`` applies torch.compile's ``options`` as a config
    patch around the partitioner."""
    return getattr(torch._inductor.config, name)


@contextlib.contextmanager
def disable_compile_caches(config_patches: dict):
    """Neither Inductor's FX graph cache nor AOTAutograd's serves or keeps a
    graph compiled inside; yields ``config_patches`` with Inductor's off."""
    with torch._functorch.config.patch(enable_autograd_cache=False, enable_remote_autograd_cache=False):
        yield {**config_patches, "fx_graph_cache": False, "fx_graph_remote_cache": False}
