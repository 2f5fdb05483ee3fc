"""bench/families.py: every family builds, trains a step, and checkpoints
per layer where it says it can (tiny sizes, eager, no Inductor)."""
import pytest
import torch

from bench import families

pytest.importorskip("transformers")


@pytest.mark.parametrize("name", sorted(families.FAMILIES))
def test_family_trains_a_step_and_checkpoints_per_layer(name):
    family = families.FAMILIES[name]
    side = min(family.size[2], 64)  # Swin needs 64: its last stage is one 4x4 window
    model = families.build(name, 2, 32, side)
    (inputs,) = families.batches(name, 1, 2, side)
    loss = family.loss(model, inputs)
    assert loss.isfinite()
    loss.backward()
    assert families.checkpointed_layers(model), "no repeated layers found"
    if family.per_layer_checkpointing:
        model.zero_grad()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        torch.testing.assert_close(family.loss(model, inputs), loss)


def test_step_budget_sizes_default_to_the_familys():
    from bench.step_budget import Settings, sized

    settings = Settings(layers=3)
    t5 = sized(settings, "t5")
    assert (t5.layers, t5.width, t5.seq, t5.batch) == (3, *families.FAMILIES["t5"].size[1:])
    assert settings.width is None  # the given settings are not changed
