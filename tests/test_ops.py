"""The op policy table on hand-built nodes."""
import operator

import pytest
import torch
import torch.fx as fx

from partitioners.ops import OpCategory, Recompute, categorize

aten = torch.ops.aten


def _node(target, *args):
    graph = fx.Graph()
    inputs = [graph.placeholder(f"x{i}") for i in range(len(args))]
    for placeholder, value in zip(inputs, args):
        placeholder.meta["val"] = value
    node = graph.call_function(target, tuple(inputs))
    return node


def _bytes(node):
    value = node.meta.get("val")
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


@pytest.mark.parametrize(
    "target, category",
    [
        (aten.mm.default, OpCategory.COMPUTE),
        (aten.convolution.default, OpCategory.COMPUTE),
        (aten._scaled_dot_product_flash_attention_for_cpu.default, OpCategory.COMPUTE),
        (aten.gelu.default, OpCategory.POINTWISE),
        (aten.permute.default, OpCategory.VIEW),
        (aten.cat.default, OpCategory.DATA_MOVEMENT),
        (aten.rand.default, OpCategory.RANDOM),
        (torch.ops.prims.inductor_seeds.default, OpCategory.RANDOM),
        (torch.ops.prims.inductor_random.default, OpCategory.SEEDED_RANDOM),
        (aten.native_dropout.default, OpCategory.RANDOM),
        (aten.multinomial.default, OpCategory.RANDOM),
        (aten.poisson.default, OpCategory.RANDOM),
        (aten.bernoulli.p, OpCategory.RANDOM),
        (torch.ops._c10d_functional.all_reduce.default, OpCategory.COLLECTIVE),
        (torch.ops._c10d_functional.wait_tensor.default, OpCategory.COLLECTIVE),
        (aten.copy_.default, OpCategory.SIDE_EFFECT),
        (aten.add_.Tensor, OpCategory.SIDE_EFFECT),
        (aten.linalg_eigh.default, OpCategory.UNKNOWN),
    ],
)
def test_category_of_op(target, category):
    assert categorize(_node(target), _bytes) is category


def test_reduction_is_cheap_unless_it_shrinks_its_input():
    x = torch.empty(8, 64)
    normalizing = _node(aten._softmax.default, x)
    normalizing.meta["val"] = torch.empty(8, 64)
    shrinking = _node(aten.sum.dim_IntList, x)
    shrinking.meta["val"] = torch.empty(8)
    assert categorize(normalizing, _bytes) is OpCategory.REDUCTION
    assert categorize(shrinking, _bytes) is OpCategory.SHRINKING_REDUCTION


def test_tuple_element_of_a_random_op_is_random():
    dropout = _node(aten.native_dropout.default, torch.empty(4))
    element = dropout.graph.call_function(operator.getitem, (dropout, 1))
    assert categorize(element, _bytes) is OpCategory.RANDOM


def test_every_category_has_one_policy():
    assert {c.policy for c in OpCategory} == set(Recompute)
