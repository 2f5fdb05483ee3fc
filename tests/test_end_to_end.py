"""The model zoo through torch.compile + Inductor: gradients match eager.

Tolerances: float32 on CPU, Inductor reorders reductions and fuses ops, so
results differ from eager by rounding only: rtol 1e-4, atol 1e-5.
"""
import copy
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from bench.measure import count_saved_bytes
from bench.models import GPT, MLP, ConvNet, GPTConfig, MoE, MoEConfig, gpt_batch, moe_batch
from ckpt import make_backend

TOLERANCE = dict(rtol=1e-4, atol=1e-5)
SMALL_GPT = GPTConfig(depth=2, width=32, heads=2, seq=32, vocab=64)


def assert_same_training_step(model, *args, backend=None, steps=1, per_block=False):
    """Train a compiled copy and an eager copy side by side with SGD; compare
    losses and gradients each step, and parameters and buffers at the end.
    ``per_block``: compile each of ``model.blocks`` on its own
    (``block.compile``), not the whole model. Returns the backend."""
    backend = backend or make_backend(strict=True)
    eager = copy.deepcopy(model)
    compiled_model = copy.deepcopy(model)
    if per_block:
        for block in compiled_model.blocks:
            block.compile(backend=backend)
        compiled = compiled_model
    else:
        compiled = torch.compile(compiled_model, backend=backend)
    runs = [
        (eager, eager, torch.optim.SGD(eager.parameters(), lr=0.1)),
        (compiled_model, compiled, torch.optim.SGD(compiled_model.parameters(), lr=0.1)),
    ]
    for _ in range(steps):
        (eager_loss, eager_grads), (loss, grads) = [_sgd_step(*run, args) for run in runs]
        torch.testing.assert_close(loss, eager_loss, **TOLERANCE)
        for got, want in zip(grads, eager_grads, strict=True):
            torch.testing.assert_close(got, want, **TOLERANCE)
    for got, want in zip(compiled_model.state_dict().values(), eager.state_dict().values(), strict=True):
        torch.testing.assert_close(got, want, **TOLERANCE)
    return backend


def _sgd_step(module, fn, optimizer, args):
    optimizer.zero_grad()
    loss = _loss(fn(*args))
    loss.backward()
    grads = [p.grad.clone() for p in module.parameters()]
    optimizer.step()
    return loss.detach(), grads


def _loss(output):
    if isinstance(output, tuple):
        return sum(o.float().square().mean() for o in output)
    return output


def test_mlp_with_gelu_and_layernorm():
    backend = assert_same_training_step(MLP(depth=3, width=32), torch.randn(16, 32))
    (plan,) = backend.plans
    assert plan.fallback is None and plan.recomputed


def test_gpt_decoder_with_causal_attention():
    backend = assert_same_training_step(GPT(SMALL_GPT), *gpt_batch(SMALL_GPT, 2), steps=2)
    (plan,) = backend.plans
    assert plan.fallback is None
    # Matmuls (and attention's batched matmuls) are saved, never recomputed.
    heavy = [d for d in plan.decisions if "compute-heavy" in d.reason]
    assert any(d.op.startswith("_scaled_dot_product") for d in heavy)
    assert all(d.decision == "saved" for d in heavy)


def test_convnet_batchnorm_running_stats_update_once_per_step():
    model = ConvNet(channels=8, stages=2)
    images, labels = torch.randn(4, 3, 8, 8), torch.randint(10, (4,))
    # state_dict comparison after 2 steps covers running_mean/var and
    # num_batches_tracked: a replayed update would double-count them.
    backend = assert_same_training_step(model, images, labels, steps=2)
    assert all(p.fallback is None for p in backend.plans)


class InPlaceTwoOutputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)  # an input mutation: must happen once per call
        h = self.lin(x)
        h.relu_()
        a = h * 2
        a.add_(1.0)
        return a, h.sigmoid()


def test_in_place_ops_and_multiple_outputs():
    model = InPlaceTwoOutputs()
    assert_same_training_step(model, torch.randn(8, 16), steps=2)


class WithGraphBreak(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 1)

    def forward(self, x):
        h = F.gelu(self.a(x))
        torch._dynamo.graph_break()
        return self.b(torch.tanh(h)).mean()


def test_gpt_with_each_block_compiled_on_its_own():
    """torchtitan's and transformers' way: ``block.compile(backend=...)`` per
    decoder block, the embeddings and the loss eager. Gradients match eager
    (TOLERANCE) with no budget and at budget 0.0; the blocks share one graph,
    so one Plan, and at 0.0 that Plan saves less."""
    saved = {}
    for budget in (None, 0.0):
        torch._dynamo.reset()
        backend = make_backend(strict=True, memory_budget=budget)
        assert_same_training_step(GPT(SMALL_GPT), *gpt_batch(SMALL_GPT, 2), backend=backend, steps=2,
                                  per_block=True)
        (plan,) = backend.plans  # both blocks ran the one graph
        assert plan.fallback is None
        saved[budget] = plan.saved_activation_bytes
    assert saved[0.0] < saved[None]


def test_graph_break_partitions_each_graph():
    backend = assert_same_training_step(WithGraphBreak(), torch.randn(8, 16))
    assert len(backend.plans) == 2
    assert all(p.fallback is None for p in backend.plans)


def test_dynamic_shapes_two_sequence_lengths():
    cfg = GPTConfig(depth=1, width=32, heads=2, seq=64, vocab=64)
    model = GPT(cfg)
    backend = make_backend(strict=True)
    compiled_model = copy.deepcopy(model)
    compiled = torch.compile(compiled_model, backend=backend, dynamic=True)
    for seq in (24, 40):
        tokens, targets = gpt_batch(cfg, 2, seq=seq)
        model.zero_grad()
        compiled_model.zero_grad()
        torch.testing.assert_close(compiled(tokens, targets), model(tokens, targets), **TOLERANCE)
        compiled(tokens, targets).backward()
        model(tokens, targets).backward()
        for got, want in zip(compiled_model.parameters(), model.parameters()):
            torch.testing.assert_close(got.grad, want.grad, **TOLERANCE)
    assert len(backend.plans) == 1  # one symbolic-shape graph served both lengths


def test_registered_backend_name():
    model = MLP(depth=1, width=8)
    x = torch.randn(4, 8)
    loss = torch.compile(model, backend="ckpt")(x)
    torch.testing.assert_close(loss, model(x), **TOLERANCE)


@pytest.mark.parametrize(
    "model, args",
    [
        (MLP(depth=3, width=64), (torch.randn(64, 64),)),
        (GPT(SMALL_GPT), gpt_batch(SMALL_GPT, 2)),
    ],
    ids=["mlp", "gpt"],
)
def test_saved_bytes_no_more_than_torch_compile(model, args):
    measured = {}
    backend = make_backend(strict=True)
    for name, chosen in (("ckpt", backend), ("inductor", "inductor")):
        torch._dynamo.reset()
        copy_ = copy.deepcopy(model)
        compiled = torch.compile(copy_, backend=chosen)
        with count_saved_bytes(list(copy_.parameters()) + list(args)) as saved:
            loss = compiled(*args)
        loss.backward()
        measured[name] = saved["bytes"]
    assert 0 < measured["ckpt"] <= measured["inductor"]
    # The plan's own account of saved bytes is what autograd really holds.
    (plan,) = backend.plans
    assert plan.saved_activation_bytes == measured["ckpt"]


SMALL_MOE = MoEConfig(depth=2, width=16, hidden=32, experts=4, seq=8)


@pytest.mark.parametrize("budget", [0.5])  # one point: each compile costs ~15 s
def test_moe_plan_saved_bytes_are_what_autograd_keeps(budget):
    """A top-2 MoE whose einsum experts read views of a split parameter: the
    plan's saved bytes equal the bytes autograd keeps (parameters and inputs
    excluded) at a middle budget, and the gradients are eager's."""
    model, args = MoE(SMALL_MOE), moe_batch(SMALL_MOE, 2)
    eager = copy.deepcopy(model)
    eager(*args).backward()
    backend = make_backend(strict=True, memory_budget=budget)
    compiled = torch.compile(model, backend=backend)
    compiled(*args)  # compile outside the measurement
    model.zero_grad(set_to_none=True)
    with count_saved_bytes([*model.parameters(), *args]) as saved:
        loss = compiled(*args)
    loss.backward()
    (plan,) = backend.plans
    assert plan.fallback is None
    assert saved["bytes"] > 0 and plan.saved_activation_bytes == saved["bytes"]
    for got, want in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, **TOLERANCE)


class CheckpointedBlocks(nn.Module):
    """Two blocks wrapped in torch.utils.checkpoint, optionally with a
    selective-checkpoint policy."""

    def __init__(self, policy=None):
        super().__init__()
        self.a = nn.Linear(16, 64)
        self.b = nn.Linear(64, 16)
        self.policy = policy

    def block(self, x):
        return self.b(F.gelu(self.a(x)))

    def forward(self, x):
        kwargs = {}
        if self.policy is not None:
            kwargs["context_fn"] = functools.partial(
                create_selective_checkpoint_contexts, self.policy
            )
        h = checkpoint(self.block, x, use_reentrant=False, **kwargs)
        return checkpoint(self.block, h, use_reentrant=False, **kwargs).sum()


def _save_matmuls(ctx, op, *args, **kwargs):
    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def test_checkpoint_regions_recompute_their_matmuls():
    backend = assert_same_training_step(CheckpointedBlocks(), torch.randn(8, 16))
    (plan,) = backend.plans
    matmuls = [d for d in plan.decisions if d.op == "addmm.default"]
    # Inside the regions the matmuls are recomputed, as eager checkpointing
    # does; the first region's output feeds the second and is kept.
    assert [(d.decision, d.reason) for d in matmuls] == [
        ("recomputed", "recomputed: checkpoint policy PREFER_RECOMPUTE"),
        ("saved", "saved: checkpoint region output read by a later region"),
        ("recomputed", "recomputed: checkpoint policy PREFER_RECOMPUTE"),
    ]


def test_selective_checkpoint_policy_must_save_is_honored():
    backend = assert_same_training_step(CheckpointedBlocks(_save_matmuls), torch.randn(8, 16))
    (plan,) = backend.plans
    matmuls = [d for d in plan.decisions if d.op == "addmm.default"]
    assert len(matmuls) == 3
    assert all(d.reason == "saved: checkpoint policy MUST_SAVE" for d in matmuls)
    assert "gelu" not in " ".join(plan.saved)


def test_per_block_mode_through_the_bench_harness():
    """The bench's ckpt-per-block mode: one backend for all blocks, whose one
    Plan counts once per block in the step's planned saved bytes."""
    from bench import cases
    from bench.harness import ModeResult, measure_memory, prepare
    from bench.modes import parse_mode

    case = cases.builtin_case("gpt", "quick")
    mode = parse_mode("ckpt-per-block+budget=0.0")
    base = case.build()
    prep = prepare(case, base, mode, case.batch, "cpu")
    result = ModeResult(str(mode), case.batch)
    measure_memory(prep, result, "cpu")
    (plan,) = prep.runner.plans
    blocks = len(base.blocks)
    assert prep.runner.blocks == blocks == 2 and plan.fallback is None
    assert result.plan_saved_bytes == blocks * plan.saved_activation_bytes
    # Autograd also holds what the eager embeddings, head and loss save.
    assert result.saved_bytes > result.plan_saved_bytes
    assert result.predicted_peak_bytes is None  # the eager parts are not predicted


class SharedBias(nn.Module):
    """Layers that all add one learned bias, broadcast over the batch (T5's
    relative position bias): backward sums each layer's gradient over the
    batch and adds the sums up."""

    def __init__(self, layers=4, n=16):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(1, n, n))
        self.weights = nn.ParameterList(nn.Parameter(torch.randn(n, n) / 4) for _ in range(layers))

    def forward(self, x):
        for weight in self.weights:
            x = torch.softmax(x @ weight + self.bias, dim=-1)
        return x.square().mean()


def test_a_shared_bias_gradient_is_accumulated_layer_by_layer(monkeypatch):
    from partitioners import partition as module

    partitions, real = [], module.partition
    monkeypatch.setattr(module, "partition", lambda *a, **k: partitions.append(real(*a, **k)) or partitions[-1])
    torch.manual_seed(0)
    assert_same_training_step(SharedBias(), torch.randn(8, 16, 16), backend=make_backend(memory_budget=0.0))
    backward = partitions[-1].backward  # the plan that runs
    totals = backward.graph.find_nodes(op="call_function", target=torch.ops.ckpt.accumulate.default)
    assert len(totals) == 3  # four layers' sums, added as they come


def test_a_shared_bias_of_dynamic_length_is_accumulated_without_a_guard(monkeypatch):
    # The bias is looked up by relative position for the sequence's length,
    # as T5's: its sums have symbolic sizes, compared without specializing.
    from partitioners import partition as module

    class RelativeBias(nn.Module):
        def __init__(self, layers=4, n=16):
            super().__init__()
            self.table = nn.Parameter(torch.randn(2 * n))
            self.weight = nn.Parameter(torch.randn(n) / 4)

        def forward(self, x):
            n = x.shape[-1]
            positions = torch.arange(n)
            bias = self.table[positions[None, :] - positions[:, None] + n].unsqueeze(0)
            for _ in range(4):
                x = torch.softmax(x * self.weight[:n] + bias, dim=-1)
            return x.square().mean()

    partitions, real = [], module.partition
    monkeypatch.setattr(module, "partition", lambda *a, **k: partitions.append(real(*a, **k)) or partitions[-1])
    torch.manual_seed(0)
    model, eager = RelativeBias(), RelativeBias()
    eager.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend=make_backend(memory_budget=0.0), dynamic=True)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    for n in (12, 14):
        x = torch.randn(8, n, n)
        for module in (compiled, eager):
            module(x).backward()
        for got, want in zip(model.parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(got.grad, want.grad, **TOLERANCE)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # no recompile for the second length
    totals = partitions[-1].backward.graph.find_nodes(op="call_function", target=torch.ops.ckpt.accumulate.default)
    assert len(totals) == 3
