"""The peak model on tiny graphs (no Inductor): which values get a buffer,
and the predicted forward and backward peaks, byte for byte."""
import torch
from conftest import aot_partition

from partitioners.peak import backward_schedule, estimate_step_peak, materialized, workspace_bytes

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
        e = x.exp()          # exp read twice: Inductor stores it on CPU
        m = x * 2            # a multiply read twice: recomputed in each reader
        return (e.sin() + e.cos() + m.sin() * m.cos()).sum()

    result, _ = aot_partition(f, leaf(64, 64))
    facts, saved, buffers = _forward_buffers(result)
    assert "exp" in buffers and "mul" not in buffers


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


def test_seeded_random_draws_get_a_float_buffer_and_the_mask_is_inlined():
    # Inductor's lowering of inductor_random always realizes the draws
    # (float32), so the boolean mask computed from them is inlined.
    def f(x, w, seeds):
        draws = torch.ops.prims.inductor_random([64, 64], seeds, "rand")
        dropped = x * (draws > 0.1) * (1 / 0.9)
        return (dropped.sin() @ w).sum()

    seeds = torch.ops.prims.inductor_seeds(1, torch.device("cpu"))[0]
    result, _ = aot_partition(f, leaf(64, 64), leaf(64, 64), seeds)
    facts, saved, buffers = _forward_buffers(result)
    random = [n.name for n in facts.nodes if n.target is torch.ops.prims.inductor_random.default]
    assert random and set(random) <= set(buffers)
    assert not any(name.startswith("gt") for name in buffers)


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
