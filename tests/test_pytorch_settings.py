"""PyTorch's own budget settings under ckpt (partitioners/pytorch_settings.py):
``region_activation_memory_budget`` and functorch's
``activation_memory_budget`` are honored, never dropped without a word.
Saved bytes are measured as bench.pytorch_settings does (saved-tensor
hooks), Inductor on CPU; the 4-block MLP of the issue, d=256, at batch 128."""
import warnings

import pytest

from bench.pytorch_settings import RegionBlocks as _Blocks, saved_bytes
from ckpt import make_backend


def _saved_bytes(model, backend, functorch_budget=None):
    return saved_bytes(model, backend, batch=128, functorch_budget=functorch_budget)


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


def test_a_region_that_leaves_ops_outside_keeps_its_budget_without_a_warning():
    """PyTorch rejects it; ckpt plans the region at its budget, the rest runtime-optimal."""
    pytorch = _saved_bytes(_Blocks(0.0), "inductor")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="ckpt")
        saved = _saved_bytes(_Blocks(0.0, loss_outside=True), make_backend(strict=True))
    assert saved <= pytorch, (saved, pytorch)