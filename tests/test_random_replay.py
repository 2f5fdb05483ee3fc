"""Random ops: masks replayed bit for bit from saved seeds, never stored.

Inductor draws dropout masks with ``inductor_random`` from a seed tensor; ckpt
recomputes them in backward from that saved seed. These tests check that the
replayed masks are the forward's masks, through real Inductor kernels.
"""
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from bench.models import GPT, GPTConfig, gpt_batch
from ckpt import make_backend

DROPOUT_GPT = GPTConfig(depth=1, width=32, heads=2, seq=32, vocab=64, dropout=0.1)
TOLERANCE = dict(rtol=1e-4, atol=1e-5)


class Dropout(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.p = p

    def forward(self, x):
        return F.dropout(torch.sin(x), p=self.p, training=True)


def test_backward_replays_the_forward_mask():
    p = 0.3
    backend = make_backend(strict=True)
    compiled = torch.compile(Dropout(p), backend=backend)
    masks = []
    for _ in range(2):
        x = torch.randn(256, 256, requires_grad=True)
        out = compiled(x)
        out.sum().backward()
        kept = out != 0
        # d out / d x = mask * cos(x) / (1 - p): zero exactly where the
        # forward dropped, so backward used the very same mask.
        assert torch.equal(x.grad != 0, kept)
        torch.testing.assert_close(x.grad[kept], torch.cos(x)[kept] / (1 - p))
        masks.append(kept)
    assert not torch.equal(masks[0], masks[1]), "consecutive steps must draw new masks"
    # Kept fraction within 6 standard deviations of 1 - p (n = 65536 draws).
    n = masks[0].numel()
    bound = 6 * (p * (1 - p) / n) ** 0.5
    assert abs(masks[0].float().mean().item() - (1 - p)) < bound

    (plan, *_) = backend.plans
    replayed = [d for d in plan.decisions if d.op == "inductor_random.default"]
    assert replayed and all(d.decision == "recomputed" for d in replayed)
    assert not [d for d in plan.decisions if d.decision == "saved" and d.op == "gt.Scalar"]
    # backward keeps the 8-byte seed and one float32 256x256 value for cos(x)
    # (x itself or its equal-sized image); no 65536-byte boolean mask.
    assert plan.saved_activation_bytes == 8 + 256 * 256 * 4


def _train(model, backend, steps=3, seed=123):
    """Losses and final gradients of ``steps`` steps from a fixed RNG seed."""
    torch._dynamo.reset()
    model = copy.deepcopy(model)
    fn = model if backend is None else torch.compile(model, backend=backend)
    torch.manual_seed(seed)
    losses = []
    for _ in range(steps):
        model.zero_grad()
        loss = fn(*gpt_batch(DROPOUT_GPT, 2))
        loss.backward()
        losses.append(loss.detach())
    return torch.stack(losses), [p.grad.clone() for p in model.parameters()]


def _assert_same_training(a, b):
    (losses_a, grads_a), (losses_b, grads_b) = a, b
    torch.testing.assert_close(losses_a, losses_b, **TOLERANCE)
    for got, want in zip(grads_a, grads_b, strict=True):
        torch.testing.assert_close(got, want, **TOLERANCE)


# That ckpt draws torch.compile's default masks from the same seed, and
# reproduces them, is tested on a whole training run (AdamW steps, at budgets
# None and 0.0, bit for bit, and resumed in a new process) in test_train.py.


def test_fallback_random_matches_eager():
    model = GPT(DROPOUT_GPT)
    backend = make_backend(strict=True)
    with torch._inductor.config.patch(fallback_random=True):
        compiled = _train(model, backend, steps=2)
    _assert_same_training(compiled, _train(model, None, steps=2))
    # Eager-style dropout draws from the generator: its masks are saved.
    (plan,) = backend.plans
    assert any(d.reason == "saved: random op, must not be replayed" for d in plan.decisions)
    assert not any("random" in d.reason for d in plan.decisions if d.decision == "recomputed")


def test_bf16_autocast_uses_real_dtype_bytes_and_matches_eager():
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 8))
    x = torch.randn(32, 64)
    backend = make_backend(strict=True)
    compiled_model = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = torch.compile(compiled_model, backend=backend)(x).float().square().mean()
        eager_loss = model(x).float().square().mean()
    loss.backward()
    eager_loss.backward()
    (plan,) = backend.plans
    # The first matmul's output is bf16: 32 x 128 x 2 bytes.
    assert [d.nbytes for d in plan.decisions if d.op == "addmm.default"] == [32 * 128 * 2]
    # bf16 has 8 bits of mantissa: compare at bf16 resolution.
    torch.testing.assert_close(loss, eager_loss, rtol=2e-2, atol=1e-3)
    for got, want in zip(compiled_model.parameters(), model.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=3e-2, atol=3e-2)
