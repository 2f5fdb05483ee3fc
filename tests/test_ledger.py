"""The memory ledger attributes a step's peak exactly, on steps whose
allocations are known."""
import torch

from bench.ledger import measure_ledger, optimizer_state_bytes, storage_bytes
from bench.measure import peak_cpu_bytes

MiB = 2**20
SAVED, TEMPORARY = 3 * MiB, 2 * MiB
SMALL = 64
"""Bytes of the scalars a step also allocates (the loss, its gradient)."""


class SavesAndSpends(torch.autograd.Function):
    """Forward saves SAVED bytes; backward allocates TEMPORARY bytes, then the
    weight's gradient while the temporary is alive: that is the peak."""

    @staticmethod
    def forward(ctx, weight):
        ctx.save_for_backward(torch.zeros(SAVED, dtype=torch.uint8))
        return weight.sum()

    @staticmethod
    def backward(ctx, grad):
        (saved,) = ctx.saved_tensors
        temporary = torch.ones(TEMPORARY, dtype=torch.uint8)
        weight_grad = grad.expand(WEIGHT_SHAPE) + temporary[:1].float()
        return weight_grad


WEIGHT_SHAPE = (MiB // 4,)  # 1 MiB of float32


def test_ledger_attributes_the_peak_to_saved_gradient_and_temporary():
    weight = torch.nn.Parameter(torch.zeros(WEIGHT_SHAPE))
    model = torch.nn.Module()
    model.weight = weight
    ledger = measure_ledger(model, lambda: SavesAndSpends.apply(weight))
    assert ledger.parameters_bytes == ledger.gradients_bytes == MiB
    assert ledger.optimizer_state_bytes is None  # no optimizer in this step
    assert ledger.saved_activations_bytes == SAVED
    assert ledger.peak_phase == "backward"
    assert (ledger.saved_at_peak, ledger.gradients_at_peak) == (SAVED, MiB)
    assert TEMPORARY <= ledger.temporaries_at_peak <= TEMPORARY + SMALL
    assert ledger.peak_bytes == ledger.saved_at_peak + ledger.gradients_at_peak + ledger.temporaries_at_peak
    assert ledger.total_at_peak == MiB + ledger.peak_bytes


def test_ledger_peak_is_the_peak_meter_s_and_the_optimizer_state_is_counted():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 64))
    x = torch.randn(128, 64)
    optimizer = torch.optim.AdamW(model.parameters())
    assert optimizer_state_bytes(optimizer) == 0  # AdamW makes its state at the first step

    def step():
        model(x).square().mean().backward()
        optimizer.step()

    step()
    params = storage_bytes(model.parameters())
    optimizer.zero_grad(set_to_none=True)
    ledger = measure_ledger(model, lambda: model(x).square().mean(), optimizer, inputs=[x])
    optimizer.zero_grad(set_to_none=True)
    # exp_avg and exp_avg_sq per parameter, and a float32 step count per tensor
    assert ledger.optimizer_state_bytes == 2 * params + 4 * len(list(model.parameters()))
    assert ledger.gradients_bytes == ledger.parameters_bytes == params
    # Tanh saves its output, the second Linear reads the same storage; square saves its input.
    assert ledger.saved_activations_bytes == (128 * 256 + 128 * 64) * 4
    assert ledger.peak_bytes == peak_cpu_bytes(step)  # the same step, measured on its own


def test_storage_bytes_counts_each_storage_once():
    base = torch.zeros(100)
    assert storage_bytes([base, base[:10], base.view(10, 10), torch.zeros(5)]) == 400 + 20
