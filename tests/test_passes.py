"""Graph rewrites around the partition (passes/), each on a tiny hand-built graph."""
import operator

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from passes import joint, partitioned, run_passes

aten = torch.ops.aten


def _ops(gm: fx.GraphModule) -> list[str]:
    return [n.name for n in gm.graph.nodes if n.op == "call_function"]


def _aten_graph(fn, *args) -> fx.GraphModule:
    return make_fx(fn)(*args)


def _call(graph: fx.Graph, name: str, target, *args, **kwargs) -> fx.Node:
    return graph.create_node("call_function", target, args, kwargs, name=name)


def test_dead_code_goes_and_mutations_stay():
    def fn(x, buf):
        x.cos()  # read by nothing
        buf.add_(1)  # read by nothing, but it mutates an input
        return x.sin()

    x, buf = torch.randn(4), torch.zeros(4)
    gm = _aten_graph(fn, x, buf)
    assert joint.eliminate_dead_code(gm) is gm  # in place
    assert _ops(gm) == ["add_", "sin"]
    torch.testing.assert_close(gm(x, torch.zeros(4)), x.sin())


def test_common_subexpressions_merge_and_random_draws_do_not():
    def fn(x):
        return x.sin() + x.sin() + torch.rand_like(x) + torch.rand_like(x)

    gm = _aten_graph(fn, torch.randn(4))
    assert joint.eliminate_common_subexpressions(gm) is gm
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert ops.count(aten.sin.default) == 1
    assert ops.count(aten.rand_like.default) == 2
    assert "sin_1" not in gm.code  # the module's code follows its graph


def _backward_with_early_recompute() -> fx.GraphModule:
    """A backward as extraction leaves it: the recomputed ``sin`` first,
    although only the last gradient op reads it."""
    graph = fx.Graph()
    primal = graph.placeholder("primals_1")
    tangent = graph.placeholder("tangents_1")
    recomputed = _call(graph, "sin", aten.sin.default, primal)
    grad = _call(graph, "mul", aten.mul.Tensor, tangent, 2.0)
    grad = _call(graph, "mul_1", aten.mul.Tensor, grad, 3.0)
    grad = _call(graph, "mul_2", aten.mul.Tensor, grad, recomputed)
    graph.output((grad,))
    return fx.GraphModule(torch.nn.Module(), graph)


def test_recomputed_node_moves_to_its_first_use():
    bwd = partitioned.reorder_recomputed_to_first_use(_backward_with_early_recompute())
    assert _ops(bwd) == ["mul", "mul_1", "sin", "mul_2"]
    x, g = torch.randn(4), torch.randn(4)
    torch.testing.assert_close(bwd(x, g)[0], g * 6 * x.sin())


def test_getitems_move_next_to_their_tuple():
    graph = fx.Graph()
    x = graph.placeholder("x")
    var_mean = _call(graph, "var_mean", aten.var_mean.correction, x, correction=0)
    other = _call(graph, "cos", aten.cos.default, x)
    var = _call(graph, "getitem", operator.getitem, var_mean, 0)
    graph.output((_call(graph, "add", aten.add.Tensor, var, other),))
    gm = partitioned.raise_getitems(fx.GraphModule(torch.nn.Module(), graph))
    assert _ops(gm) == ["var_mean", "getitem", "cos", "add"]


def test_rng_threading_leaves_a_graph_without_subgraphs_alone():
    bwd = _backward_with_early_recompute()
    code = bwd.code
    assert partitioned.thread_backward_rng_state(bwd).code == code
    assert partitioned.thread_forward_rng_state(bwd).code == code


def test_run_passes_applies_them_in_order():
    seen = []

    def first(gm):
        seen.append("first")
        return gm

    def second(gm):
        seen.append("second")
        return gm

    gm = _backward_with_early_recompute()
    assert run_passes((first, second), gm) is gm and seen == ["first", "second"]


def _weight_gradient_graph(*, heavy_between: bool, from_inputs: bool = False) -> fx.GraphModule:
    """A tied weight's gradient as backward leaves it: ``mm`` (one use) plus
    another gradient ``c``, itself computed by an mm before or after it."""
    graph = fx.Graph()
    grad_out, hidden, other = (graph.placeholder(name) for name in ("tangents_1", "hidden", "other"))
    operand = grad_out if from_inputs else _call(graph, "mul", aten.mul.Tensor, grad_out, 2.0)
    if not heavy_between:
        c = _call(graph, "mm_1", aten.mm.default, other, hidden)
    matmul = _call(graph, "mm", aten.mm.default, operand, hidden)
    if heavy_between:
        c = _call(graph, "mm_1", aten.mm.default, other, hidden)
    graph.output((_call(graph, "add", aten.add.Tensor, matmul, c),))
    return fx.GraphModule(torch.nn.Module(), graph)


def _weight_gradient_inputs():
    return torch.randn(3, 4), torch.randn(4, 5), torch.randn(3, 4)


def test_a_matmul_whose_add_waits_past_another_matmul_is_unfolded_and_refolded():
    gm = _weight_gradient_graph(heavy_between=True)
    inputs, code = _weight_gradient_inputs(), gm.code
    expected = gm(*inputs)[0]
    assert joint.unfold_late_matmul_adds(gm) is gm
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert aten.add.Tensor not in ops and aten.sub.Tensor in ops and aten.neg.default in ops
    assert [n.name for n in joint.unfolded_adds(gm)] == ["add"]
    assert torch.equal(gm(*inputs)[0], expected)  # c - (-m) is c + m, bit for bit
    assert joint.refold_matmul_adds(gm) is gm and gm.code == code and not joint.unfolded_adds(gm)


def test_adjacent_adds_and_adds_of_input_products_stay():
    for gm in (_weight_gradient_graph(heavy_between=False),
               _weight_gradient_graph(heavy_between=True, from_inputs=True)):
        code = gm.code
        assert joint.unfold_late_matmul_adds(gm).code == code


def _summed_gradient_graph() -> fx.GraphModule:
    """A bias every layer reads through a broadcast over the batch, as
    backward leaves its gradient: one sum per layer, added in a chain."""
    graph = fx.Graph()
    grad_out, *scores = (graph.placeholder(name) for name in ("tangents_1", "s1", "s2", "s3"))
    sums = [
        _call(graph, f"sum_{i}", aten.sum.dim_IntList, _call(graph, f"mul_{i}", aten.mul.Tensor, grad_out, s), [0], True)
        for i, s in enumerate(scores)
    ]
    total = _call(graph, "add", aten.add.Tensor, sums[0], sums[1])
    total = _call(graph, "add_1", aten.add.Tensor, total, sums[2])
    broadcast = _call(graph, "add_2", aten.add.Tensor, total, scores[0])  # [1, n] + [b, n]: not a sum of sums
    forward_sum = _call(graph, "sum_f", aten.sum.dim_IntList, scores[0], [0], True)
    forward_total = _call(graph, "add_f", aten.add.Tensor, forward_sum, forward_sum)  # no tangent upstream
    graph.output((total, broadcast, forward_total))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    FakeTensorProp(gm, FakeTensorMode()).propagate(*_summed_gradient_inputs())
    return gm


def _summed_gradient_inputs():
    torch.manual_seed(0)
    return tuple(torch.randn(4, 64) for _ in range(4))


def test_backward_sums_added_in_a_chain_are_accumulated_as_they_come():
    gm = _summed_gradient_graph()
    inputs = _summed_gradient_inputs()
    expected = gm(*inputs)
    assert joint.accumulate_gradient_sums(gm) is gm
    targets = {n.name: n.target for n in gm.graph.nodes}
    assert targets["add"] is targets["add_1"] is torch.ops.ckpt.accumulate.default
    assert targets["add_2"] is targets["add_f"] is aten.add.Tensor
    for got, want in zip(gm(*inputs), expected):
        assert torch.equal(got, want)  # the same adds in the same order


def test_half_precision_sums_are_left_to_inductor():
    # Inductor adds a bfloat16 chain in float32 and rounds once; added one
    # op at a time, each partial total would round.
    gm = _summed_gradient_graph()
    FakeTensorProp(gm, FakeTensorMode()).propagate(*(t.bfloat16() for t in _summed_gradient_inputs()))
    code = gm.code
    assert joint.accumulate_gradient_sums(gm).code == code


def test_accumulate_has_a_gradient():
    joint.define_ops()
    total, term = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    torch.ops.ckpt.accumulate(total, term).sum().backward()
    assert torch.equal(total.grad, torch.ones(3)) and torch.equal(term.grad, torch.ones(3))


def test_sizes_equal_only_at_their_hints_are_not_the_same_and_add_no_guard():
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    import ckpt_compat as compat

    from torch._dynamo.source import ConstantSource

    env = ShapeEnv(duck_shape=False)  # two sizes of 4 get two symbols
    s0, s1 = (env.create_unbacked_symint() for _ in range(2))
    a, b = (env.create_symintnode(env.create_symbol(4, source=ConstantSource(name)), hint=4) for name in "ab")
    assert compat.same_sizes(torch.Size([a, 3]), torch.Size([a, 3]))
    assert not compat.same_sizes(torch.Size([a, 3]), torch.Size([b, 3]))
    assert not compat.same_sizes(torch.Size([s0]), torch.Size([s1]))
    assert not env.guards  # decided without specializing

