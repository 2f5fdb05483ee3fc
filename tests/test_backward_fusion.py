"""ckpt's rule for Inductor's horizontal fusion in backward graphs: kernels
that only share inputs fuse when near, or when the later one is a reduction."""
from types import SimpleNamespace

import torch
from torch._inductor.choices import InductorChoices

from ckpt import make_backend
from partitioners import fusion_policy
from bench.harness import fresh_inductor_cache


def kernel(order, writes=(), reads=()):
    """A stand-in for an Inductor scheduler node: its place in the original
    order and the byte sizes of what it writes and reads."""
    deps = lambda sizes: [SimpleNamespace(name=f"buf{i}", numbytes_hint=lambda n=n: n) for i, n in enumerate(sizes)]
    return SimpleNamespace(min_order=order, max_order=order,
                           read_writes=SimpleNamespace(writes=deps(writes), reads=deps(reads)))


def test_far_kernels_fuse_only_when_the_later_one_is_a_reduction(monkeypatch):
    monkeypatch.setattr(InductorChoices, "can_fuse_horizontal", staticmethod(lambda *args: True))
    choices, far = fusion_policy.NearHorizontalFusion(), fusion_policy.NEAR_FUSION_DISTANCE + 1
    early = kernel(0, writes=[4096], reads=[4096])
    # near: fused as Inductor would
    assert choices.can_fuse_horizontal(None, early, kernel(fusion_policy.NEAR_FUSION_DISTANCE, [4096], [4096]), 1)
    # far, and the later kernel writes a tensor as large as it reads: moving
    # it up would hold that tensor alive early
    assert not choices.can_fuse_horizontal(None, early, kernel(far, [4096], [4096]), 1)
    # far, and the later kernel reduces to a small result: fused
    assert choices.can_fuse_horizontal(None, early, kernel(far, [64], [4096 * 64]), 1)
    # the order of the arguments does not matter
    assert not choices.can_fuse_horizontal(None, kernel(far, [4096], [4096]), early, 1)


def test_ckpt_compiles_backward_graphs_with_the_rule_and_forward_graphs_without(monkeypatch):
    asked = []
    rule = fusion_policy.NearHorizontalFusion.can_fuse_horizontal

    def spy(self, scheduler, node1, node2, score):
        asked.append((node1, node2))
        return rule(self, scheduler, node1, node2, score)

    monkeypatch.setattr(fusion_policy.NearHorizontalFusion, "can_fuse_horizontal", spy)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16), torch.nn.GELU(),
                                torch.nn.Linear(16, 16), torch.nn.LayerNorm(16))
    x = torch.randn(8, 16)
    torch._dynamo.reset()
    with fresh_inductor_cache():
        loss = torch.compile(model, backend=make_backend())(x).sum()
        assert asked == []  # the forward graph: Inductor's own heuristics
        loss.backward()
    assert asked  # the backward graph asked ckpt's rule (two LayerNorm weight gradients share reads)
    torch._dynamo.reset()
