"""The peak model on tiny graphs (no Inductor codegen but in the one test
named for it): which values get a buffer, and the predicted forward and
backward peaks, byte for byte."""
import dataclasses
from types import SimpleNamespace

import pytest
import torch
from conftest import aot_partition

from bench.measure import peak_cpu_bytes
from ckpt.backend import make_backend
from partitioners.config import Config, MemoryBudget
from partitioners.ops import OpCategory
from partitioners.peak import liveness as peak_liveness
from partitioners.peak import (
    backward_schedule, buffer_reads, copied_views, estimate_step_peak, fused_across_externs, inductor_estimate,
    kernel_order, lower, materialized, mm_at_its_add,
    reuse_pool, walk, workspace_bytes,
)

N = 64 * 64 * 4  # bytes of one 64x64 float32 value


def leaf(*shape):
    return torch.randn(*shape, requires_grad=True)


def _forward_buffers(result):
    facts = result.facts
    saved = {n for n in facts.nodes if n.name in set(result.plan.saved)}
    order = [n for n in facts.nodes if n in facts.forward]
    return facts, saved, sorted(n.name for n in materialized(facts, order, facts.saved_storages(saved)))


def test_pointwise_chain_is_one_kernel_and_a_matmul_input_is_written():
    def f(x, w):
        return (x.sin().cos() @ w).sum()

    result, _ = aot_partition(f, leaf(64, 64), leaf(64, 64))
    facts, saved, buffers = _forward_buffers(result)
    # sin is computed inside cos's kernel; cos is written because mm reads it.
    assert buffers == ["cos", "mm", "sum_1"]


def test_reused_value_is_written_only_when_costly_to_repeat():
    def f(x):
        e = x.exp()          # exp read twice: Inductor stores it on CPU...
        m = x * 2            # a multiply read twice: recomputed in each reader
        return (e.sum(-1, keepdim=True) * e + m.sin() * m.cos()).sum()

    result, _ = aot_partition(f, leaf(64, 64))
    facts, saved, buffers = _forward_buffers(result)
    assert "exp" in buffers and "mul" not in buffers


def test_reused_value_read_only_in_its_own_kernel_gets_no_buffer():
    def f(x):
        e = x.exp()  # ...but when only pointwise ops of its size read it, they
        return (e.sin() + e.cos()).sum()  # fuse with it and the buffer is dropped

    result, _ = aot_partition(f, leaf(64, 64))
    facts = result.facts
    order = [n for n in facts.nodes if n in facts.forward]
    assert "exp" not in {n.name for n in materialized(facts, order, kept=set())}


def _many_reads(a, b, c, w):
    s = a * b + c * w  # reads four buffers; two reductions read it, backward does not
    return s.sum(-1).square().sum() + s.mean()


def _many_reads_args():
    return [torch.randn(64, 64) for _ in range(3)] + [leaf(64)]


@pytest.mark.parametrize("threshold, written", [(4, False), (3, True), (1, True)])
def test_a_reused_value_is_written_past_the_realize_reads_threshold_in_force(threshold, written):
    # Inductor stores a reused value that reads more buffers than
    # realize_reads_threshold (4 by default): the model reads the setting
    # in force, as the compile it predicts does.
    with torch._inductor.config.patch(realize_reads_threshold=threshold):
        result, _ = aot_partition(_many_reads, *_many_reads_args())
        facts = result.facts
        order = [n for n in facts.nodes if n in facts.forward]
        assert lower(facts).realize_reads == threshold
        assert ("add" in {n.name for n in materialized(facts, order, kept=set())}) is written
        assert "add" not in result.plan.saved
        # Written, the 64x64 float32 value is forward's peak; else only the
        # reductions' and w's gradient's bytes are (at most 516).
        assert (result.plan.estimated_peak_bytes > N) is written
    # The graph's state is kept per setting: back under the default, the
    # model is the default's again.
    assert lower(facts).realize_reads == 4
    assert "add" not in {n.name for n in materialized(facts, order, kept=set())}


def test_torch_compile_options_reach_the_peak_model_through_inductor():
    # options= are Inductor config patches around the compile, and the
    # partitioner plans inside them: its predicted peak is the one the
    # model gives under the same setting.
    predicted = {}
    for threshold in (4, 3):
        backend = make_backend(Config())
        torch._dynamo.reset()
        torch.compile(_many_reads, backend=backend, options={"realize_reads_threshold": threshold})(
            *_many_reads_args())
        (plan,) = backend.plans
        with torch._inductor.config.patch(realize_reads_threshold=threshold):
            result, _ = aot_partition(_many_reads, *_many_reads_args())
        assert plan.estimated_peak_bytes == result.plan.estimated_peak_bytes
        predicted[threshold] = plan.estimated_peak_bytes
    torch._dynamo.reset()
    assert predicted[3] > N > predicted[4]


def test_step_peak_of_a_two_layer_mlp_by_hand():
    def f(x, w1, w2):
        return (torch.relu(x @ w1) @ w2).sum()

    x, w1, w2 = leaf(64, 64), leaf(64, 64), leaf(64, 64)
    result, _ = aot_partition(f, x, w1, w2)
    facts = result.facts
    saved = {n for n in facts.nodes if n.name in set(result.plan.saved)}
    peak = estimate_step_peak(facts, saved)
    # Forward: relu is written for the second mm and saved; mm is freed once
    # relu is written; then mm_1 (N) and its scalar sum: 2 N + 4 at most.
    assert peak.forward_bytes == 2 * N + 4
    # Forward leaves relu for backward and returns the loss; backward adds
    # the gradients of x, w1 and w2, kept to its end: at the last one, relu
    # (read by it) is alive too, the loss's tangent already freed.
    assert (peak.held_bytes, peak.output_bytes) == (N, 4)
    assert peak.gradient_bytes == 3 * N
    assert peak.backward_bytes == 4 * N
    assert peak.step_bytes == max(peak.forward_bytes, peak.backward_bytes)
    assert result.plan.estimated_peak_bytes == peak.step_bytes


def test_a_saved_set_is_walked_once_per_graph_and_setting(monkeypatch):
    # The budget search's cuts often repeat a saved set; its estimate is kept.
    def f(x, w1, w2):
        return (torch.relu(x @ w1) @ w2).sum()

    result, _ = aot_partition(f, leaf(64, 64), leaf(64, 64), leaf(64, 64))
    facts = result.facts
    saved = [n for n in facts.nodes if n.name in set(result.plan.saved)]
    lower(facts).peaks.clear()
    walks = []
    real_walk = peak_liveness.walk
    monkeypatch.setattr(peak_liveness, "walk", lambda *args, **kwargs: walks.append(1) or real_walk(*args, **kwargs))
    first = estimate_step_peak(facts, saved)
    assert len(walks) == 2  # forward and backward
    assert estimate_step_peak(facts, saved[::-1]) is first and len(walks) == 2
    trace = []
    assert estimate_step_peak(facts, saved, backward_trace=trace) == first and len(walks) == 4 and trace
    with torch._inductor.config.patch(realize_reads_threshold=1):  # another lowering: walked again
        estimate_step_peak(facts, saved)
    assert len(walks) == 6


def test_recomputed_values_are_scheduled_just_before_their_first_reader():
    def f(x, w):
        return (torch.relu(x @ w).sin() @ w).sum()

    result, _ = aot_partition(f, leaf(64, 64), leaf(64, 64))
    facts = result.facts
    saved = {n for n in facts.nodes if n.name in set(result.plan.saved)}
    order = backward_schedule(facts, saved)
    position = {n: i for i, n in enumerate(order)}
    for node in order:
        if node in facts.forward:
            assert position[node] < min(position[u] for u in node.users if u in position)


def test_seeded_random_draws_read_only_by_their_kernel_get_no_buffer():
    # Inductor realizes the draws (float32) but the scheduler drops them
    # when the only kernel reading them is the one drawing them (seen in its
    # code for a GPT with dropout: the softmax-and-dropout kernel takes the
    # seeds and writes only the dropout's output). The mask is inlined.
    def f(x, w, seeds):
        draws = torch.ops.prims.inductor_random([64, 64], seeds, "rand")
        dropped = x * (draws > 0.1) * (1 / 0.9)
        return (dropped.sin() @ w).sum()

    seeds = torch.ops.prims.inductor_seeds(1, torch.device("cpu"))[0]
    result, _ = aot_partition(f, leaf(64, 64), leaf(64, 64), seeds)
    facts = result.facts
    saved = {n for n in facts.nodes if n.name in set(result.plan.saved)}
    order = [n for n in facts.nodes if n in facts.forward]
    kernel_local = {}
    buffers = materialized(facts, order, facts.saved_storages(saved), kernel_local)
    random = [n for n in facts.nodes if n.target is torch.ops.prims.inductor_random.default]
    assert random and not set(random) & buffers
    assert set(random) <= set(kernel_local)  # Inductor's estimate still counts them
    assert not any(n.name.startswith("gt") for n in buffers)
    # Read by an extern kernel too, the draws are written.
    def g(x, w, seeds):
        draws = torch.ops.prims.inductor_random([64, 64], seeds, "rand")
        return ((x * (draws > 0.1)).sin() @ w + draws @ w).sum()

    result, _ = aot_partition(g, leaf(64, 64), leaf(64, 64), seeds)
    facts, _, names = _forward_buffers(result)
    assert any(n.name in names for n in facts.nodes if n.target is torch.ops.prims.inductor_random.default)


def test_cpu_convolutions_hold_a_weight_sized_buffer_per_weight_layout_they_write():
    def f(x, w):
        return torch.nn.functional.conv2d(x, w, padding=1).relu().sum()

    x, w = torch.randn(2, 8, 16, 16, requires_grad=True), leaf(16, 8, 3, 3)
    result, _ = aot_partition(f, x, w)
    facts = result.facts
    weight_bytes = 16 * 8 * 3 * 3 * 4
    by_target = {n.target.overloadpacket: n for n in facts.nodes if hasattr(n.target, "overloadpacket")}
    assert workspace_bytes(by_target[torch.ops.aten.convolution], facts) == weight_bytes
    # the input's gradient (reordered weight) and the weight's gradient
    assert workspace_bytes(by_target[torch.ops.aten.convolution_backward], facts) == 2 * weight_bytes


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="Inductor lays out CPU convolutions channels-last only with oneDNN")
def test_a_backward_that_recomputes_a_convolution_runs_its_convolutions_channels_last():
    """On CPU, Inductor lays a graph's convolutions out channels-last when
    the graph holds a forward convolution: a backward that recomputes one.
    oneDNN's channels-last backward of a depthwise 7x7 convolution holds
    far more scratch than the NCHW one (ConvNeXt: 12.25 MiB at 256
    channels, against 0.19): measured once at batch 1, it is what the op
    holds at the graph's batch, and the walk counts it only where the
    backward recomputes a convolution."""
    from bench.measure import peak_cpu_bytes
    from partitioners.peak.lowering import workspace_at
    from partitioners.peak.workspace import runs_channels_last

    channels = 64

    def f(x, w):
        return torch.nn.functional.conv2d(x, w, padding=3, groups=channels).relu().sum()

    x, w = torch.randn(4, channels, 8, 8, requires_grad=True), leaf(channels, 1, 7, 7)
    result, _ = aot_partition(f, x, w)
    facts = result.facts
    lowered = lower(facts)
    (backward,) = [n for n in facts.nodes if n.target is torch.ops.aten.convolution_backward.default]
    keeps = backward_schedule(facts, {n for n in facts.nodes if n.target is torch.ops.aten.convolution.default})
    recomputes = backward_schedule(facts, set())
    assert not runs_channels_last(keeps) and runs_channels_last(recomputes)
    assert workspace_at(backward, False, lowered) == workspace_bytes(backward, facts) == 2 * w.numel() * 4

    # The op itself at the graph's batch, channels-last, measured here.
    args = [t.detach().contiguous(memory_format=torch.channels_last) for t in (torch.randn(4, channels, 8, 8), x)]
    box = {}

    def run():
        box["out"] = torch.ops.aten.convolution_backward.default(
            *args, w.detach().contiguous(memory_format=torch.channels_last),
            [channels], [1, 1], [3, 3], [1, 1], False, [0, 0], channels, [True, True, True])

    scratch = peak_cpu_bytes(run) - sum(t.numel() * t.element_size() for t in box["out"])
    assert workspace_at(backward, True, lowered) == pytest.approx(scratch, rel=0.05)


def test_a_convolution_backward_of_symbolic_sizes_is_not_measured():
    """Channels and images of symbolic size are no one shape to measure:
    the table's count stands (a SymInt in the cache key raised out of the
    partitioner)."""
    import ckpt_compat as compat
    from torch.fx.experimental.proxy_tensor import make_fx

    def backward(grad, x, w):
        return torch.ops.aten.convolution_backward.default(
            grad, x, w, [w.shape[0]], [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, True, False])

    gm = make_fx(backward, tracing_mode="symbolic")(torch.randn(2, 8, 6, 6), torch.randn(2, 4, 6, 6), torch.randn(8, 4, 3, 3))
    (node,) = [n for n in gm.graph.nodes if n.target is torch.ops.aten.convolution_backward.default]
    assert any(isinstance(size, torch.SymInt) for size in node.args[2].meta["val"].shape)
    assert compat.channels_last_convolution_backward_scratch(node) is None


def test_a_dense_convolutions_backward_keeps_the_tables_scratch_channels_last():
    """Measured at batch 1, a dense convolution's backward takes another
    oneDNN path (ResNet's 512-channel 3x3: 0.03 weights of scratch, 2 at
    batch 8): the table's two weights stay the floor."""
    from partitioners.peak.lowering import workspace_at

    def f(x, w):
        return torch.nn.functional.conv2d(x, w, padding=1).relu().sum()

    x, w = torch.randn(8, 32, 4, 4, requires_grad=True), leaf(32, 32, 3, 3)
    result, _ = aot_partition(f, x, w)
    facts = result.facts
    (backward,) = [n for n in facts.nodes if n.target is torch.ops.aten.convolution_backward.default]
    assert workspace_at(backward, True, lower(facts)) >= workspace_bytes(backward, facts) == 2 * w.numel() * 4


def _backward_order(result):
    facts = result.facts
    saved = {n for n in facts.nodes if n.name in set(result.plan.saved)}
    return facts, backward_schedule(facts, saved)


def test_input_of_an_extern_kernel_with_several_outputs_is_written():
    # convolution_backward returns a tuple; its gradient input (the mul) is
    # an expression of the tangent that must be in memory before it runs.
    def f(x, w):
        return (torch.nn.functional.conv2d(x, w, padding=1) * 3).sum()

    x, w = torch.randn(2, 8, 16, 16, requires_grad=True), leaf(16, 8, 3, 3)
    result, _ = aot_partition(f, x, w)
    facts, order = _backward_order(result)
    (conv_backward,) = [n for n in order if n.target is torch.ops.aten.convolution_backward.default]
    grad_output = conv_backward.args[0]
    assert grad_output.target is torch.ops.aten.mul.Tensor
    assert grad_output in materialized(facts, order, kept=set())


def test_a_matmul_inductor_folds_into_an_add_runs_at_the_add():
    # A weight used twice: its gradient is add(mm, mm), which Inductor turns
    # into addmm(mm, ...) at the add: the second mm's inputs live until then.
    def f(x, y, w):
        return (x @ w).sin().sum() + ((y @ w).cos() @ w).sum()

    result, _ = aot_partition(f, leaf(64, 64), leaf(64, 64), leaf(64, 64))
    facts, order = _backward_order(result)
    moved = mm_at_its_add(order)
    assert sorted(moved, key=str) == sorted(order, key=str)  # same nodes
    folded = [n for n in moved if n.target is torch.ops.aten.mm.default
              and moved.index(n) + 1 < len(moved) and moved[moved.index(n) + 1] in n.users
              and moved[moved.index(n) + 1].target is torch.ops.aten.add.Tensor]
    assert folded, "no mm was placed just before the add that reads it"
    for matmul in folded:
        (add,) = matmul.users
        assert order.index(add) - order.index(matmul) > 1  # it was moved


def _pool_graph():
    """Buffers a..d in a graph of their own, with stand-in facts: a and d
    of one size (10 bytes), b and c of another (5)."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    nodes = [graph.call_function(torch.ops.aten.sin.default, (x,), name=name) for name in "abcd"]
    for node in nodes:
        node.meta["val"] = torch.empty(4)
    sizes = dict(zip(nodes, (10, 5, 5, 10)))
    facts = SimpleNamespace(nodes={n: SimpleNamespace(nbytes=sizes[n], category=OpCategory.POINTWISE) for n in nodes},
                            derived={})
    return facts, nodes


def test_a_freed_buffer_waits_in_inductors_pool_for_one_of_its_size():
    facts, (a, b, c, d) = _pool_graph()
    steps = dict(written=[[a], [b], [c], [d]], freed=[[a], [], [], []])
    # a is freed after step 0 and d of the same size is written at step 3:
    # Inductor hands a's memory to d, holding it over steps 1 and 2, when
    # that stays under its estimate of the graph's peak (30).
    assert reuse_pool(facts, [10, 10, 10, 30], **steps) == [(a, 1, 3)]
    # Not when holding it would raise that peak (20 + 10 > 20).
    assert reuse_pool(facts, [10, 20, 10, 20], **steps) == []
    # b's size is not d's; c takes b, the most recently freed of its size.
    spans = reuse_pool(facts, [10, 10, 10, 40], written=[[a], [b], [c], [d]], freed=[[a], [b], [], []])
    assert spans == [(b, 2, 2), (a, 1, 3)]
    # Inductor checks only the kernels strictly between the one reading a
    # last and the one writing d: when steps 0 and 1 are one fused kernel,
    # its peak at step 1 (20) is not between, so d takes a.
    assert reuse_pool(facts, [10, 20, 10, 20], **steps, run_end=[1, 1, 2, 3]) == [(a, 1, 3)]


@pytest.mark.parametrize("seq, heads, grad_layout", [(64, 4, "blhd"), (200, 2, "blhd"), (64, 4, "bhld")])
def test_cpu_attention_backward_workspace_is_what_the_kernel_allocates(seq, heads, grad_layout):
    """The model's workspace for the CPU flash-attention backward against the
    kernel's own allocations (profiler), beyond its three gradients; a
    gradient of the output in (batch, heads, seq, dim) layout is copied."""
    aten = torch.ops.aten
    batch, dim = 2, 32

    def blhd():
        return torch.randn(batch, seq, heads, dim).transpose(1, 2)

    q, k, v = blhd(), blhd(), blhd()
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, scale=0.2)[:2]
    grad = blhd() if grad_layout == "blhd" else torch.randn(batch, heads, seq, dim)
    grads = []
    measured = peak_cpu_bytes(lambda: grads.extend(
        aten._scaled_dot_product_flash_attention_for_cpu_backward(grad, q, k, v, out, lse, 0.0, False, scale=0.2)))
    beyond_gradients = measured - sum(g.numel() * g.element_size() for g in grads)

    graph = torch.fx.Graph()
    args = [graph.placeholder(name) for name in ("grad", "q", "k", "v", "out", "lse")]
    for arg, value in zip(args, (grad, q, k, v, out, lse)):
        arg.meta["val"] = value
    node = graph.call_function(
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default, (*args, 0.0, False))
    predicted = workspace_bytes(node, facts=None)
    # the kernel also keeps a few float32 row sums per thread (under 2 KiB)
    assert 0 <= beyond_gradients - predicted < 2048


def _run_graph():
    """x (an input, 8 bytes) -> pointwise a, b, c (10 bytes each) -> mm m (20)."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    a = graph.call_function(torch.ops.aten.sin.default, (x,), name="a")
    b = graph.call_function(torch.ops.aten.cos.default, (a,), name="b")
    c = graph.call_function(torch.ops.aten.sin.default, (b,), name="c")
    m = graph.call_function(torch.ops.aten.mm.default, (c, c), name="m")
    for node in (x, a, b, c, m):
        node.meta["val"] = torch.empty(4)
    sizes = {x: 8, a: 10, b: 10, c: 10, m: 20}
    categories = {x: OpCategory.INPUT, m: OpCategory.COMPUTE}
    facts = SimpleNamespace(
        nodes={n: SimpleNamespace(nbytes=sizes[n], category=categories.get(n, OpCategory.POINTWISE))
               for n in sizes},
        free_inputs=set(),
        derived={},
    )
    return facts, (x, a, b, c, m)


def test_inductors_estimate_frees_a_fused_runs_inputs_at_its_end_and_skips_inputs():
    facts, (x, a, b, c, m) = _run_graph()
    order = [a, b, c, m]
    # What the walk counts: x alive until a reads it; each value freed by its reader.
    curve = [8 + 10, 10 + 10, 10 + 10, 10 + 20]
    freed = [[x], [a], [b], [c]]
    estimate = inductor_estimate(facts, order, curve, [0] * 4, freed, {}, start={x})
    # Inductor: x is not counted; a, b, c fuse into one kernel that frees
    # a and b only when it ends (step 2); the mm is a kernel of its own.
    assert estimate == [10, 20, 30, 30]
    # An in-place output counts on top of its donor, which Inductor frees at
    # the end of the run, as the inputs it reads; a kernel-local value
    # counts through the end of its run.
    estimate = inductor_estimate(facts, order, curve, [0, 10, 0, 0], freed, {b: (1, 1)}, start={x})
    assert estimate == [10, 40, 50, 30]


def _relaid_einsum_graph():
    """``silu``-like ``g`` of a matmul's output seen as (b, e, t, h): eager
    keeps the matmul's (b, t, e, h) memory order, so merging b and t after
    moving e first is a view; Inductor writes ``g`` contiguous, where it is not."""
    b, t, e, h = 4, 8, 2, 16

    def f(x, w_in, w_out):
        u = (x @ w_in).view(b, t, e, h).permute(0, 2, 1, 3)
        g = torch.sigmoid(u) * u
        return torch.bmm(g.permute(1, 0, 2, 3).reshape(e, b * t, h), w_out).sum()

    result, _ = aot_partition(f, leaf(b * t, 8), leaf(8, e * h), leaf(e, h, 8))
    facts = result.facts
    order = [n for n in facts.nodes if n in facts.forward]
    by_name = {n.name: n for n in order}
    (matmul_input,) = [n.args[0] for n in order if n.target is torch.ops.aten.bmm.default]
    return facts, order, by_name, matmul_input


def test_a_view_inductor_cannot_reinterpret_is_copied_for_a_matmul():
    facts, order, by_name, view = _relaid_einsum_graph()
    g = by_name["mul"]
    assert view.target is torch.ops.aten.view.default
    # Written contiguous, g cannot be viewed so: the bmm reads a copy.
    assert copied_views(facts, order, kept=set()) == {view}
    assert view in materialized(facts, order, kept=set())
    # A value the graph returns keeps eager's strides: no copy.
    assert copied_views(facts, order, kept={g}) == set()


def test_a_copied_view_is_written_with_its_base_which_cannot_overwrite_the_matmul():
    facts, order, by_name, view = _relaid_einsum_graph()
    size = 4 * 8 * 2 * 16 * 4  # mm, g and g's copy: one size
    # g reads mm in eager's order but writes its own: not in place. The
    # kernel writing g writes the copy too, while mm is still alive.
    assert walk(facts, order, kept=set()) == 3 * size


def test_a_view_two_matmuls_read_is_copied_for_each():
    b, t, e, h = 4, 8, 2, 16

    def f(x, w_in, w_out, w_other):
        u = (x @ w_in).view(b, t, e, h).permute(0, 2, 1, 3)
        g = (torch.sigmoid(u) * u).permute(1, 0, 2, 3).reshape(e, b * t, h)
        return (torch.bmm(g, w_out).sum() + torch.bmm(g, w_other).sum()).reshape(1)

    result, _ = aot_partition(f, leaf(b * t, 8), leaf(8, e * h), leaf(e, h, 8), leaf(e, h, 8))
    facts = result.facts
    order = [n for n in facts.nodes if n in facts.forward]
    size = b * t * e * h * 4
    # Inductor's realize_input copies the view once per matmul reading it,
    # and writes both copies with g: mm, g and two copies alive at once.
    assert walk(facts, order, kept=set()) == 4 * size


def _two_matmuls_of_a_copied_view(b=4, t=8, e=2, h=16):
    def f(x, w_in, w_out, w_other):
        u = (x @ w_in).view(b, t, e, h).permute(0, 2, 1, 3)
        g = (torch.sigmoid(u) * u).permute(1, 0, 2, 3).reshape(e, b * t, h)
        return (torch.bmm(g, w_out).sum() + torch.bmm(g, w_other).sum()).reshape(1)

    # The second operands need no gradient: backward reads no copy, so the
    # forward's copies make the step's peak.
    return f, (leaf(b * t, 8), leaf(8, e * h), torch.randn(e, h, 8), torch.randn(e, h, 8))


def test_one_copy_for_the_matmuls_of_a_view_inductor_would_copy():
    from passes import joint

    f, args = _two_matmuls_of_a_copied_view()
    result, _ = aot_partition(f, *args)
    facts = result.facts
    order = [n for n in facts.nodes if n in facts.forward]
    (view,) = copied_views(facts, order, kept=set())
    gm = view.graph.owning_module
    code = gm.code
    joint.share_matmul_copies(gm, {view})
    (copy,) = joint.shared_copies(gm)
    assert {u.target for u in copy.users} == {torch.ops.aten.bmm.default} and len(copy.users) == 2
    # strides other than the view's, or Inductor drops the copy as a no-op
    assert copy.meta["val"].stride() == (512, 1, 32) != view.meta["val"].stride()
    joint.unshare_matmul_copies(gm)
    assert gm.code == code and not joint.shared_copies(gm)


def test_under_a_budget_matmuls_share_a_copy_lowering_the_measured_peak(monkeypatch):
    import partitioners.partition as partition_module

    f, args = _two_matmuls_of_a_copied_view()
    expected = torch.autograd.grad(f(*args), args[:2])

    def step(share: bool):
        if not share:
            monkeypatch.setattr(partition_module, "_shared_copies_where_lower",
                                lambda joint_gm, solve: partition_module._solve_quietly(solve))
        torch._dynamo.reset()
        compiled = torch.compile(f, backend=make_backend(memory_budget=0.0))
        got = torch.autograd.grad(compiled(*args), args[:2])  # compiles
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
        return peak_cpu_bytes(lambda: compiled(*args))  # the forward, where the copies are

    # What the peak model predicts for the two forwards.
    plain, _ = aot_partition(f, *args)
    budgeted, _ = aot_partition(f, *args, config=Config(memory_budget=MemoryBudget.parse("0.0")))
    predicted = [walk(r.facts, [n for n in r.facts.nodes if n in r.facts.forward], kept=set())
                 for r in (budgeted, plain)]
    shared, unshared = step(True), step(False)
    # Inductor's: mm, g and two copies of g, 4096 bytes each. Shared: one
    # copy computing g inside it, written over mm's freed buffer, then a
    # matmul's output (2048) and its sum.
    assert [shared, unshared] == predicted == [4096 + 2048 + 4, 4 * 4096]


def _late_write_graph():
    """A fused run after a matmul: a sum reads the matmul's output m for the
    last time, then sin(x * s) is written for a second, narrow matmul."""
    def f(x, w, v):
        m = x @ w
        s = m.sum(1, keepdim=True)
        return (torch.sin(x * s) @ v).sum().reshape(1)

    result, _ = aot_partition(f, leaf(64, 64), leaf(64, 64), leaf(64, 1))
    facts = result.facts
    return facts, [n for n in facts.nodes if n in facts.forward]


def test_on_cpu_a_fused_run_frees_what_it_reads_when_it_ends():
    facts, order = _late_write_graph()
    lowered = lower(facts)
    # Inductor's C++ backend calls the run (the sum and sin's kernel) as one
    # function and frees m after it: m and sin's output are alive together.
    assert lowered.one_call_per_run
    assert walk(facts, order, kept=set(), lowered=lowered) == 2 * N + 64 * 4
    # Kernel by kernel (GPU), m is freed by the sum, before sin is written.
    per_kernel = dataclasses.replace(lowered, one_call_per_run=False)
    assert walk(facts, order, kept=set(), lowered=per_kernel) == N + 64 * 4


def _fusion_case(extern_reads_first: bool):
    """sin(x) is written (a matmul reads it); mul reads it and the output
    of a second matmul, which reads sin(x) only when asked."""
    def f(x, w1, w2):
        first = x.sin()
        second = (first if extern_reads_first else x).cos() @ w2
        return ((first @ w1).sum() + (first * second).sum()).reshape(1)

    result, _ = aot_partition(f, leaf(64, 64), leaf(64, 64), leaf(64, 64))
    facts = result.facts
    order = [n for n in facts.nodes if n in facts.forward]
    kept = facts.saved_storages({n for n in facts.nodes if n.name in set(result.plan.saved)})
    buffers = materialized(facts, order, kept)
    fused = fused_across_externs(facts, order, buffers, buffer_reads(facts, order, buffers))
    by_name = {n.name: n for n in order}
    return fused, order, by_name


def test_a_kernel_fuses_with_an_earlier_one_it_reads_across_extern_kernels():
    # Inductor fuses mul into sin's kernel (vertical fusion has no distance
    # limit); the fused kernel runs where sin was, after the matmul that
    # mul also needs, and before the matmul that reads sin.
    fused, order, n = _fusion_case(extern_reads_first=False)
    assert sorted(fused, key=str) == sorted(order, key=str)
    position = {node: step for step, node in enumerate(fused)}
    assert all(position[arg] < position[node] for node in fused for arg in node.all_input_nodes if arg in position)
    # mm: cos(x) @ w2, which mul needs; mm_1: sin(x) @ w1
    assert position[n["mm"]] < position[n["sin"]] < position[n["mul"]] < position[n["mm_1"]]
    between = fused[position[n["sin"]]:position[n["mul"]]]
    assert not any(node.target is torch.ops.aten.mm.default for node in between)


def test_no_fusion_when_the_matmul_between_reads_the_earlier_kernel():
    fused, order, _ = _fusion_case(extern_reads_first=True)
    assert fused is order  # fusing would make a cycle through the matmul


@pytest.mark.parametrize("shares_x, runs_first", [(False, True), (True, False)])
def test_a_matmul_lowered_before_a_group_fused_across_externs_runs_before_it(shares_x, runs_first):
    # GPT-NeoX's parallel block, small: a weight gradient's matmul (mm)
    # whose output no kernel of the run after it reads, then a reduction
    # (sum) that fuses with a later one (sum_1) across another matmul.
    # kernel_order runs mm after the run that follows it; Inductor sorts
    # fused kernels by the step they were first lowered at, so mm, lowered
    # before the group, runs before it, not after both reductions. Unless
    # sum may fuse with the kernel before mm (cos, when it reads x too and
    # loops over as many elements): then the group runs there, before mm.
    def f(x, z, w1, w2):
        e = (x if shares_x else z).cos() @ w1
        p1 = (x.sin() * x).sum(-1, keepdim=True)
        p2 = ((x.tanh() @ w2) * p1).sum(-1)
        return (e.sum() + p2.sum()).reshape(1)

    result, _ = aot_partition(f, leaf(64, 64), leaf(64, 64), leaf(64, 64), leaf(64, 64))
    facts = result.facts
    lowering = [n for n in facts.nodes if n in facts.forward]
    rank = {node: step for step, node in enumerate(lowering)}
    order = kernel_order(facts, lowering)
    kept = facts.saved_storages({n for n in facts.nodes if n.name in set(result.plan.saved)})
    buffers = materialized(facts, order, kept)
    reads = buffer_reads(facts, order, buffers)
    n = {node.name: node for node in lowering}
    assert order.index(n["mm"]) > order.index(n["sum_1"])  # deferred past the run after it
    fused = fused_across_externs(facts, order, buffers, reads, rank=rank)
    position = {node: step for step, node in enumerate(fused)}
    assert position[n["mm_1"]] < position[n["sum_1"]] < position[n["sum_2"]]
    assert (position[n["mm"]] < position[n["sum_1"]]) == runs_first
    # Without the lowering order, the group's first step decides: mm after it.
    unranked = fused_across_externs(facts, order, buffers, reads)
    assert unranked.index(n["mm"]) > unranked.index(n["sum_1"])


def test_a_slice_scattered_into_zeros_is_computed_inside_its_reader():
    # Inductor lowers slice_scatter to a pointwise where() over its base:
    # neither the zeros nor the scatter gets a buffer (partial rotary's
    # backward); the cos that a matmul reads is written.
    def f(x, w):
        scattered = torch.zeros(64, 64).slice_scatter(x[:, :32].sin(), dim=1, start=32)
        return (scattered.cos() @ w).sum()

    result, _ = aot_partition(f, leaf(64, 64), leaf(64, 64))
    facts, saved, buffers = _forward_buffers(result)
    scatter = [n.name for n in facts.nodes if n.target is torch.ops.aten.slice_scatter.default]
    zeros = [n.name for n in facts.nodes if n.target in (torch.ops.aten.full.default, torch.ops.aten.zeros.default)]
    assert scatter and zeros and not set(scatter + zeros) & set(buffers)
    assert "cos" in buffers


def test_no_kernel_overwrites_a_buffer_another_kernel_fused_with_it_reads():
    # y * 2 and cos(y) are two kernels fused into one, both reading y for
    # the last time: Inductor counts each as a remaining use of y and
    # writes neither in place (3 buffers of y's size at once; Inductor
    # measured the same, 3 x 256 KiB, with peak_cpu_bytes).
    def f(x, w, v):
        y = x @ w
        a, b = y * 2, y.cos()
        return (a @ v).sum() + (b @ v).sum()

    result, _ = aot_partition(f, leaf(64, 64), leaf(64, 64), leaf(64, 8))
    facts = result.facts
    order = [n for n in facts.nodes if n in facts.forward]
    assert walk(facts, order, kept=set()) == 3 * N


def test_a_pointwise_kernel_overwrites_the_buffer_it_loads_first():
    # Both matmul outputs are read for the last time by the kernel writing
    # r, and are its size: Inductor overwrites the first its loop body
    # loads, operands left to right (here cos(q)'s q, though it sorts later
    # by name).
    def f(a, b, w):
        p, q = a @ w, b @ w
        return ((q.cos() * p) @ w).sum()

    result, _ = aot_partition(f, leaf(64, 64), leaf(64, 64), leaf(64, 64))
    facts = result.facts
    order = [n for n in facts.nodes if n in facts.forward]
    kept = facts.saved_storages({n for n in facts.nodes if n.name in set(result.plan.saved)})
    trace = []
    walk(facts, order, kept - {n for n in kept if n.name in ("mm", "mm_1")}, trace=trace)
    (alive,) = [alive for node, _, alive, _ in trace if node.name == "mul"]
    assert {n.name for n in alive} >= {"mm", "mul"} and "mm_1" not in {n.name for n in alive}


def _reduction_over(facts, dim):
    (node,) = [n for n in facts.nodes if n.target is torch.ops.aten.sum.dim_IntList and n.args[1] == [dim]]
    return node


@pytest.mark.parametrize("threshold, unrolled", [(8, True), (4, False)])
def test_a_reduction_over_few_elements_is_unrolled_into_its_readers(threshold, unrolled):
    # Inductor lowers a reduction over fewer than unroll_reductions_threshold
    # (8) elements per output element as a pointwise expression
    # (torch/_inductor/ir.py Reduction.create): no buffer, computed inside
    # its readers' kernels. T5's position bias gradient sums each layer's
    # score gradient over the batch (4).
    def f(x):
        y = x.sin()
        return y.sum(0).cos().sum() + y.sum(-1).cos().sum()

    with torch._inductor.config.patch(unroll_reductions_threshold=threshold):
        result, _ = aot_partition(f, leaf(4, 64, 64))
        facts = result.facts
        order = [n for n in facts.nodes if n in facts.forward]
        buffers = materialized(facts, order, kept=set())
        assert (_reduction_over(facts, 0) not in buffers) is unrolled
        assert _reduction_over(facts, -1) in buffers  # 64 elements: a reduction kernel


@pytest.mark.parametrize("reduction_first", [True, False])
def test_a_reader_lowered_before_the_matmul_that_writes_a_value_computes_it(reduction_first):
    # A pointwise value written only because a matmul reads it is realized
    # when Inductor lowers the matmul; a kernel lowered before that computes
    # the value inside itself, from the value's inputs, which stay alive
    # until it runs. T5 at budget 0.0: the position bias gradient (sums over
    # the batch, added across layers: one kernel after the last layer's)
    # reads every layer's softmax output and its gradient, not the score
    # gradient the matmuls read: predicted 22.9 MiB without this, 47.2
    # with it, measured 51.2 (Inductor reorders it; 66.7 in graph order).
    def f(a, b, w):
        g = a * b
        if reduction_first:
            return g.sum(0).sum() + (g @ w).sum()
        return (g @ w).sum() + g.sum(0).sum()

    result, _ = aot_partition(f, leaf(4, 64, 64), leaf(4, 64, 64), leaf(64, 64))
    facts = result.facts
    order = [n for n in facts.nodes if n in facts.forward]
    late = {}
    buffers = materialized(facts, order, kept=set(), late=late)
    (g,) = [n for n in order if n.target is torch.ops.aten.mul.Tensor]
    assert g in buffers and g in late  # the matmul reads it
    total = next(u for u in _reduction_over(facts, 0).users if u in buffers)  # the full sum
    a, b = g.args
    reads = buffer_reads(facts, order, buffers, late=late)
    assert reads[total] == ({a, b} if reduction_first else {g})
    assert buffer_reads(facts, order, buffers)[total] == {g}  # without ``late``: read as written


@pytest.mark.parametrize("effect_token", [False, True])
def test_an_activation_inputs_gradient_and_saved_input_are_told_apart_from_parameters(effect_token):
    # Dynamo marks the Linear's weight and bias static: their gradients stay
    # in .grad, while x's goes back to whoever made x. x is saved (for the
    # weight's gradient) as the batch input at its position among the inputs.
    # An effectful op puts a token before the primals: AOTAutograd's static
    # indices and the arguments Dynamo passes do not count it.
    layer = torch.nn.Linear(64, 32)
    x = torch.randn(16, 64, requires_grad=True)

    def f(x):
        if effect_token:
            torch.ops.aten._print("effect")
        return torch.relu(layer(x))

    backend = make_backend(Config())
    torch._dynamo.reset()
    torch.compile(f, backend=backend)(x).sum().backward()
    torch._dynamo.reset()
    (plan,) = backend.plans
    peak = plan.peak_estimate
    assert peak.input_gradient_bytes == x.numel() * 4
    assert peak.gradient_bytes == (x.numel() + layer.weight.numel() + layer.bias.numel()) * 4
    assert peak.input_count == 3
    # Positions are those of the arguments Dynamo calls the graph with.
    ((position, nbytes),) = peak.held_inputs
    assert nbytes == x.numel() * 4
    assert peak.input_gradients == ((position, x.numel() * 4),)


def _described_joint(output_descs):
    """A joint graph whose two gradients are returned in the other order
    than their primals, described by AOTAutograd's descriptors."""
    from torch._functorch._aot_autograd import descriptors as d

    graph = torch.fx.Graph()
    p1, p2, tangent = (graph.placeholder(name) for name in ("primals_1", "primals_2", "tangents_1"))
    p1.meta["desc"], p2.meta["desc"] = d.PlainAOTInput(0), d.PlainAOTInput(1)
    out = graph.call_function(torch.ops.aten.mul.Tensor, (p1, p2))
    grad_2 = graph.call_function(torch.ops.aten.mul.Tensor, (tangent, p1))
    grad_1 = graph.call_function(torch.ops.aten.mul.Tensor, (tangent, p2))
    output = graph.output([out, grad_2, grad_1])
    output.meta["desc"] = output_descs(d)
    for node in graph.nodes:
        if node.op != "output":
            node.meta["val"] = torch.empty(4)
    return torch.fx.GraphModule(torch.nn.Module(), graph), grad_1, grad_2


def test_input_gradients_are_paired_by_descriptor_and_by_order_where_a_subclass_splits_them():
    from partitioners.classify import classify

    gm, grad_1, grad_2 = _described_joint(lambda d: [
        d.PlainAOTOutput(0), d.GradAOTOutput(d.PlainAOTInput(1)), d.GradAOTOutput(d.PlainAOTInput(0))])
    facts = classify(gm, num_fwd_outputs=1, static_lifetime_input_indices=[])
    assert sorted(facts.input_gradient_positions, key=lambda pair: pair[0]) == [(0, grad_1), (1, grad_2)]
    gm, grad_1, grad_2 = _described_joint(lambda d: [
        d.PlainAOTOutput(0), *(d.SubclassGetAttrAOTOutput(d.GradAOTOutput(d.PlainAOTInput(i)), "a") for i in (1, 0))])
    facts = classify(gm, num_fwd_outputs=1, static_lifetime_input_indices=[])
    # A subclass gradient spans several outputs: the descriptors are not read, the order is.
    assert facts.input_gradient_positions == ((0, grad_2), (1, grad_1))
