"""Exact saved sets on tiny joint graphs, partitioned without Inductor codegen."""
import operator

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy

from conftest import aot_plan, node_named
from partitioners.ops import OpCategory


def leaf(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype).requires_grad_()


def test_linear_gelu_linear_saves_matmul_output_and_recomputes_gelu():
    x, w1, w2 = leaf(4, 8), leaf(8, 16), leaf(16, 2)
    plan, _ = aot_plan(lambda x, w1, w2: F.gelu(x @ w1) @ w2, x, w1, w2)
    # backward needs x (grad of w1), w1 and w2 (grads of inputs), the
    # pre-activation mm (gelu's backward) and gelu's output (grad of w2);
    # gelu's output is recomputed from mm instead of saved.
    assert plan.saved == ("primals_1", "primals_2", "primals_3", "mm")
    assert plan.recomputed == ("gelu",)
    assert plan.reason("mm") == "saved: compute-heavy op, never recomputed"
    assert plan.reason("gelu") == "recomputed: pointwise, cheaper than saving"
    assert plan.saved_activation_bytes == 4 * 16 * 4


def test_pointwise_chain_saves_only_its_input():
    x = leaf(32)
    plan, _ = aot_plan(lambda x: torch.cos(torch.sin(x) * 2), x)
    assert plan.saved == ("primals_1",)
    assert set(plan.recomputed) == {"sin", "mul"}


def test_min_cut_saves_the_smaller_of_two_equivalent_values():
    # sin's backward needs its float32 input; the bfloat16 original holds the
    # same information in half the bytes, so it is saved and the cast recomputed.
    x = leaf(64, 64, dtype=torch.bfloat16)
    plan, _ = aot_plan(lambda x: torch.sin(x.float()), x)
    assert plan.saved == ("primals_1",)
    assert plan.recomputed == ("_to_copy",)


def test_saves_a_value_instead_of_recomputing_when_bytes_tie():
    # exp's output is what exp's backward needs: saving it or x costs the
    # same, and saving it recomputes nothing.
    x = leaf(64, 64)
    plan, _ = aot_plan(lambda x: torch.exp(x) * 3, x)
    assert plan.saved == ("exp",)
    assert plan.recomputed == ()


def test_shrinking_reduction_is_saved_not_recomputed():
    # mean over a large dim shrinks 64x: recomputing it is a full pass, saving it is tiny.
    x = leaf(8, 64)
    plan, _ = aot_plan(lambda x: x * x.mean(1, keepdim=True), x)
    assert plan.saved == ("primals_1", "mean")
    assert plan.reason("mean") == "saved: reduction with a much smaller output, never recomputed"


def test_random_op_output_is_saved_never_recomputed():
    x = leaf(16, 16)
    plan, _ = aot_plan(lambda x: F.dropout(torch.sin(x), p=0.5, training=True) * 3, x)
    random_saved = [d for d in plan.decisions if d.reason.startswith("saved: random op")]
    random_recomputed = [d for d in plan.decisions if "random" in d.reason and d.decision == "recomputed"]
    assert random_saved and not random_recomputed


def test_user_must_save_tag_keeps_a_cheap_value():
    x, w1, w2 = leaf(4, 8), leaf(8, 16), leaf(16, 2)

    def tag(gm):
        node_named(gm, "gelu").meta["recompute"] = CheckpointPolicy.MUST_SAVE

    plan, _ = aot_plan(lambda x, w1, w2: F.gelu(x @ w1) @ w2, x, w1, w2, tag=tag)
    assert "gelu" in plan.saved
    assert plan.reason("gelu") == "saved: checkpoint policy MUST_SAVE"


def test_user_must_recompute_tag_recomputes_a_matmul():
    x, w1, w2 = leaf(4, 8), leaf(8, 16), leaf(16, 2)

    def tag(gm):
        for name in ("mm", "gelu"):
            node_named(gm, name).meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE

    plan, _ = aot_plan(lambda x, w1, w2: F.gelu(x @ w1) @ w2, x, w1, w2, tag=tag)
    assert plan.saved == ("primals_1", "primals_2", "primals_3")
    assert plan.recomputed == ("mm", "gelu")
    assert plan.reason("mm") == "recomputed: checkpoint policy MUST_RECOMPUTE"


def test_user_recompute_tag_cannot_replay_a_random_op():
    x = leaf(16, 16)

    def tag(gm):
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.meta.get("partitioner_tag") != "is_backward":
                node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE

    plan, _ = aot_plan(lambda x: F.dropout(x, p=0.5, training=True) * 3, x, tag=tag)
    assert any(d.reason == "saved: random op, must not be replayed" for d in plan.decisions)


def test_gradients_match_eager_on_a_tiny_graph():
    x, w1, w2 = leaf(4, 8), leaf(8, 16), leaf(16, 2)
    fn = lambda x, w1, w2: F.layer_norm(F.gelu(x @ w1), (16,)) @ w2  # noqa: E731
    aot_plan(fn, x, w1, w2)
    compiled_grads = [t.grad.clone() for t in (x, w1, w2)]
    for t in (x, w1, w2):
        t.grad = None
    fn(x, w1, w2).sum().backward()
    for got, want in zip(compiled_grads, (x.grad, w1.grad, w2.grad)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_seeded_random_is_replayed_from_its_seed():
    # Inductor's form of dropout: a seeds tensor, one seed looked up, random
    # values drawn from it. Only the 8-byte seed is saved; the mask is
    # recomputed. (Exactness needs Inductor's kernels: test_random_replay.py.)
    prims = torch.ops.prims

    def fn(x):
        seed = prims.inductor_lookup_seed(prims.inductor_seeds(1, x.device), 0)
        keep = prims.inductor_random(list(x.shape), seed, "rand") > 0.5
        return x * keep * 2

    plan, _ = aot_plan(fn, leaf(16, 16))
    assert plan.saved == ("inductor_lookup_seed",)
    assert plan.recomputed == ("inductor_random", "gt")
    assert plan.saved_activation_bytes == 8


def test_chunks_of_an_input_are_the_inputs_storage_not_activations():
    # split/chunk/unbind return a tuple of views; each element (a getitem)
    # aliases the op's input. Counted as activations of their own, the
    # halves of x were 32 KiB in the plan while autograd kept nothing new.
    from bench.measure import count_saved_bytes

    x, w = leaf(64, 128), leaf(64, 32)

    def f(x, w):
        a, b = x.chunk(2, dim=-1)
        return (a.sin() * b.cos()) @ w

    with count_saved_bytes([x, w]) as saved:
        plan, _ = aot_plan(f, x, w)
    assert plan.saved == ("primals_1", "primals_2")
    assert plan.saved_activation_bytes == saved["bytes"] == 0


def test_elements_of_a_split_parameter_are_rooted_at_the_parameter():
    from conftest import aot_partition

    w, x = leaf(4, 8, 6), leaf(3, 8)

    def f(w, x):
        w_gate, w_up = w.chunk(2, dim=-1)
        experts = w.unbind(0)
        return torch.einsum("td,edh->eth", x, w_gate) * torch.einsum("td,edh->eth", x, w_up) + experts[0].sum()

    result, _ = aot_partition(f, w, x)
    facts, weight = result.facts, node_named(result.forward, "primals_1")
    elements = [n for n in facts.nodes if n.target is operator.getitem]
    assert len(elements) == 3  # both halves, and the one expert used
    for node in elements:
        assert facts.nodes[node].storage_root.name == weight.name
    # A view of an element (einsum permutes the weight halves) too.
    views = [n for n in facts.nodes if n.args and n.args[0] in elements
             and facts.nodes[n].category is OpCategory.VIEW]
    assert views and all(facts.nodes[n].storage_root.name == weight.name for n in views)
