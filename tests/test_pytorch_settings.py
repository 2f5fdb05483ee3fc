"""PyTorch's own budget settings under ckpt (partitioners/pytorch_settings.py):
``region_activation_memory_budget`` and functorch's
``activation_memory_budget`` are honored, never dropped without a word.
Saved bytes are measured with saved-tensor hooks (bench.measure), Inductor
on CPU; the 4-block MLP of the issue, d=256, at batch 128."""
import warnings

import pytest
import torch
import torch._dynamo
import torch.nn as nn

from bench.measure import count_saved_bytes
from ckpt import make_backend

region = torch.autograd.graph.region_activation_memory_budget


class _Blocks(nn.Module):
    """Four Linear-LayerNorm-GELU blocks and a mean, the forward inside a
    region of ``budget`` (None: no region); ``loss_outside``: the mean after it."""

    def __init__(self, budget=None, loss_outside=False):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.Sequential(*(nn.Sequential(nn.Linear(256, 256), nn.LayerNorm(256), nn.GELU()) for _ in range(4)))
        self.budget, self.loss_outside = budget, loss_outside

    def forward(self, x):
        if self.budget is None:
            return self.blocks(x).mean()
        with region(self.budget):
            y = self.blocks(x)
            if not self.loss_outside:
                return y.mean()
        return y.mean()


def _saved_bytes(model, backend, functorch_budget=None):
    """Bytes the compiled model saves for backward (parameters and input excluded)."""
    torch._dynamo.reset()
    x = torch.randn(128, 256)
    patch = {} if functorch_budget is None else {"activation_memory_budget": functorch_budget}
    with torch._functorch.config.patch(**patch), torch.compiler.config.patch(force_disable_caches=True):
        compiled = torch.compile(model, backend=backend)
        with count_saved_bytes(exclude=[*model.parameters(), x]) as saved:
            loss = compiled(x)
        loss.backward()
    return saved["bytes"]


@pytest.fixture(scope="module")
def default_saved():
    return _saved_bytes(_Blocks(), make_backend(strict=True))


def test_a_region_at_zero_saves_no_more_than_pytorchs_own_compile(default_saved):
    pytorch = _saved_bytes(_Blocks(0.0), "inductor")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="ckpt")  # honored, not substituted by a warning
        ckpt = _saved_bytes(_Blocks(0.0), make_backend(strict=True))
    assert ckpt <= pytorch < default_saved, (ckpt, pytorch, default_saved)


def test_a_region_at_one_is_the_runtime_optimal_plan(default_saved):
    assert _saved_bytes(_Blocks(1.0), make_backend(strict=True)) == default_saved


def test_functorchs_budget_is_honored_when_ckpt_has_none(default_saved):
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="ckpt")
        saved = _saved_bytes(_Blocks(), make_backend(strict=True), functorch_budget=0.0)
    assert saved < default_saved


def test_ckpts_budget_wins_over_functorchs_and_says_so():
    alone = _saved_bytes(_Blocks(), make_backend(strict=True, memory_budget="64KiB"))
    with pytest.warns(UserWarning, match=r"memory_budget=65536 bytes is used; torch\._functorch\.config\."
                                         r"activation_memory_budget=0\.5 is not"):
        both = _saved_bytes(_Blocks(), make_backend(strict=True, memory_budget="64KiB"), functorch_budget=0.5)
    assert both == alone


def test_a_region_that_leaves_ops_outside_is_applied_to_the_graph_with_a_warning(default_saved):
    """PyTorch rejects it; ckpt plans the whole graph at the region's budget and says so."""
    with pytest.warns(UserWarning, match=r"op\(s\) outside any region; ckpt plans one budget per graph "
                                         r"for now and applies the tightest, 0, to all of it"):
        saved = _saved_bytes(_Blocks(0.0, loss_outside=True), make_backend(strict=True))
    assert saved < default_saved
