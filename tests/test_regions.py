"""Per-region budgets (partitioners/regions.py): per-module fractions from
ckpt's own surface, several PyTorch regions in one graph, per-block compile
with a module prefix, graph breaks, and a peak: cap over the preferences.
Plans are made on Dynamo-captured graphs (the module paths come from Dynamo)
without Inductor codegen; one end-to-end test runs Inductor."""
import re
import warnings

import pytest
import torch
import torch.nn as nn
from functorch.compile import nop
from torch._dynamo.backends.common import aot_autograd

from ckpt import make_backend
from partitioners.budget import PEAK_MODEL_MARGIN
from partitioners.config import Config, ConfigError, MemoryBudget
from partitioners.partition import partition
from partitioners.pytorch_settings import with_pytorch_budgets
from partitioners.regions import frame_place, parameter_names

WIDTH = 64


class Block(nn.Module):
    """A transformer's MLP sublayer: its runtime-optimal plan saves the wide
    hidden values, a tight budget only the residual stream."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Tower(nn.Module):
    """Two stacks of blocks, ``vision`` then ``text``; ``regions``: PyTorch
    region budgets around each stack; ``graph_break``: one between them."""

    def __init__(self, regions=(None, None), graph_break=False):
        super().__init__()
        torch.manual_seed(0)
        self.vision = nn.Sequential(Block(), Block())
        self.text = nn.Sequential(Block(), Block())
        self.regions, self.graph_break = regions, graph_break

    def forward(self, x):
        x = _within(self.regions[0], self.vision, x)
        if self.graph_break:
            torch._dynamo.graph_break()
        return _within(self.regions[1], self.text, x).mean()


def _within(budget, stack, x):
    if budget is None:
        return stack(x)
    with torch.autograd.graph.region_activation_memory_budget(budget):
        return stack(x)


class AttentionBlock(nn.Module):
    """A pre-norm transformer block: attention, then the MLP sublayer."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.out = nn.Linear(WIDTH, WIDTH)
        self.mlp = Block()

    def forward(self, x):
        batch, seq, _ = x.shape
        q, k, v = (t.view(batch, seq, 4, WIDTH // 4).transpose(1, 2) for t in self.qkv(self.norm(x)).chunk(3, -1))
        attended = torch.softmax(q @ k.transpose(-1, -2) / 4.0, -1) @ v
        return self.mlp(x + self.out(attended.transpose(1, 2).reshape(batch, seq, WIDTH)))


class Captioner(nn.Module):
    """Three attention blocks (``vision``), two (``text``), a vocabulary head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.vision = nn.Sequential(*(AttentionBlock() for _ in range(3)))
        self.text = nn.Sequential(*(AttentionBlock() for _ in range(2)))
        self.head = nn.Linear(WIDTH, 512)

    def forward(self, x):
        return self.head(self.text(self.vision(x))).logsumexp(-1).mean()


def plans_of(model, config, x=None, root=None):
    """The ckpt Plans of each graph Dynamo captures from ``model`` (no Inductor)."""
    plans = []

    def backend(gm, example_inputs):
        graph_config = with_pytorch_budgets(config, gm)
        place = None if root is None else frame_place(gm, example_inputs, parameter_names(root))
        if place is not None:
            graph_config = graph_config.replace(module_prefix=place.prefix)

        def partition_fn(joint_gm, joint_inputs, **kwargs):
            result = partition(
                joint_gm, num_fwd_outputs=kwargs["num_fwd_outputs"],
                static_lifetime_input_indices=kwargs.get("static_lifetime_input_indices"), config=graph_config,
            )
            plans.append(result.plan)
            return result.forward, result.backward

        return aot_autograd(fw_compiler=nop, bw_compiler=nop, partition_fn=partition_fn)(gm, example_inputs)

    x = torch.randn(512, WIDTH) if x is None else x
    torch.compile(model, backend=backend)(x).backward()
    return plans


def by_region(plan):
    return {row.key: row for row in plan.regions}


def test_per_module_budgets_parse_from_a_mapping_and_from_the_compact_form():
    mapping = MemoryBudget.parse({"text": 0.5, "vision.0": 0.0, "": "peak:1GiB"})
    compact = MemoryBudget.parse("vision[0]=0.0, text=0.5, peak:1GiB")
    assert mapping == compact
    assert mapping.regions == (("text", 0.5), ("vision.0", 0.0))
    assert mapping.peak_bytes == 2**30 and mapping.rest is None
    assert MemoryBudget.parse("vision=0,0.25").rest == MemoryBudget(fraction=0.25)
    assert MemoryBudget.parse("vision=0.0,") == MemoryBudget.parse({"vision": 0.0})  # a trailing comma


@pytest.mark.parametrize("bad, says", [
    ("vision=1GiB", "a module's budget is a fraction"),
    ("vision=0,vision=0.5", "two budgets"),
    ({"vision": "peak:1GiB"}, "a module's budget is a fraction"),
    ({}, "names no module"),
    ({3: 0.0}, "is not a str"),
    ("L['self'].vision=0.0", "is not a module path"),
    ("vision..up=0.0", "is not a module path"),
    ("vision=0,peak:1GiB,peak:2GiB", "gives the step's cap two budgets"),
])
def test_bad_per_module_budgets_name_the_forms(bad, says):
    with pytest.raises(ConfigError, match=says) as error:
        Config(memory_budget=bad)
    assert "vision_tower=0.0,language_model.layers=0.5" in str(error.value)


def test_the_tightened_modules_save_less_and_the_rest_keeps_its_runtime_optimal_plan():
    (default,) = plans_of(Tower(), Config())
    (tight,) = plans_of(Tower(), Config(memory_budget=0.0))
    (vision,) = plans_of(Tower(), Config(memory_budget={"vision": 0.0}))
    rows = by_region(vision)
    assert list(rows) == ["vision", "(rest)"]
    assert rows["vision"].saved_bytes < rows["vision"].optimal_bytes
    assert rows["vision"].recomputed_heavy  # the up projections
    assert rows["(rest)"].saved_bytes == rows["(rest)"].optimal_bytes
    assert tight.saved_activation_bytes < vision.saved_activation_bytes < default.saved_activation_bytes


def test_the_longest_prefix_wins():
    (plan,) = plans_of(Tower(), Config(memory_budget={"vision": 0.0, "vision.1": 1.0}))
    rows = by_region(plan)
    assert rows["vision.1"].saved_bytes == rows["vision.1"].optimal_bytes
    assert rows["vision"].saved_bytes < rows["vision"].optimal_bytes
    assert rows["vision"].nodes == rows["vision.1"].nodes  # one block each


def test_regions_all_at_zero_peak_no_higher_than_one_uniform_zero():
    # Planned from the runtime-optimal plan, vision at 0.0 went first and
    # recomputed all of itself; text's recomputation then no longer lowered
    # the peak, and both regions at 0.0 predicted 2.2% above uniform 0.0.
    x = torch.randn(2, 128, WIDTH)
    (uniform,) = plans_of(Captioner(), Config(memory_budget=0.0), x=x)
    (regional,) = plans_of(Captioner(), Config(memory_budget={"vision": 0.0, "text": 0.0}), x=x)
    assert regional.estimated_peak_bytes <= uniform.estimated_peak_bytes
    assert 0 < regional.recompute_time_s <= uniform.recompute_time_s


def test_a_looser_region_beside_a_tight_one_keeps_its_fraction():
    # The same graph: text at 0.5 used to plan exactly as text at 0.0.
    x = torch.randn(2, 128, WIDTH)
    (tight,) = plans_of(Captioner(), Config(memory_budget={"vision": 0.0, "text": 0.0}), x=x)
    (loose,) = plans_of(Captioner(), Config(memory_budget={"vision": 0.0, "text": 0.5}), x=x)
    text = by_region(loose)["text"]
    assert text.target_bytes == int(0.5 * text.optimal_bytes)  # not raised to a floor
    assert by_region(tight)["text"].saved_bytes < text.saved_bytes <= text.target_bytes
    assert loose.recompute_time_s < tight.recompute_time_s


def test_two_pytorch_regions_in_one_graph_keep_their_own_budgets():
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="ckpt")
        (plan,) = plans_of(Tower(regions=(0.0, 1.0)), Config())
    rows = by_region(plan)
    tight, loose = rows["region_activation_memory_budget(0)"], rows["region_activation_memory_budget(1)"]
    assert tight.saved_bytes <= tight.target_bytes == 0  # PyTorch's meaning: a hard limit
    assert loose.saved_bytes == loose.optimal_bytes
    assert plan.rungs == ()  # PyTorch's limits are hard: no fallback to the runtime-optimal plan


def test_per_block_compile_matches_prefixes_through_the_module_prefix():
    """Each stack compiled alone, as torchtitan compiles blocks: a node's own
    path starts at its stack, the prefix names where the stack sits."""
    tower = Tower()
    plans = {}
    for name in ("vision", "text"):
        stack = getattr(tower, name)
        config = Config(memory_budget={"vision.0": 0.0}, module_prefix=name)
        (plans[name],) = plans_of(lambda x, stack=stack: stack(x).mean(), config)
    assert [row.key for row in plans["vision"].regions] == ["vision.0", "(rest)"]
    assert [row.key for row in plans["text"].regions] == ["(rest)"]
    tightened = by_region(plans["vision"])["vision.0"]
    assert tightened.saved_bytes < tightened.optimal_bytes


def test_per_module_budgets_survive_a_graph_break():
    plans = plans_of(Tower(graph_break=True), Config(memory_budget={"text": 0.0}))
    assert [[row.key for row in plan.regions] for plan in plans] == [["(rest)"], ["text", "(rest)"]]
    text = by_region(plans[1])["text"]
    assert text.saved_bytes < text.optimal_bytes


class BreakingBlock(Block):
    """A block whose forward breaks the graph: Dynamo compiles its frame, and
    the frames around it, apart, each with paths from its own module."""

    def forward(self, x):
        hidden = self.up(self.norm(x))
        torch._dynamo.graph_break()
        return x + self.down(torch.nn.functional.gelu(hidden))


def test_a_graph_break_inside_a_module_finds_its_place_through_the_model():
    tower = Tower()
    tower.text[1] = BreakingBlock()
    budget = Config(memory_budget={"text.0": 0.0, "text.1": 0.0})
    lost = plans_of(tower, budget)
    assert all([row.key for row in plan.regions] == ["(rest)"] for plan in lost)  # paths start at each frame
    found = plans_of(tower, budget, root=tower)
    keys = [[row.key for row in plan.regions] for plan in found]
    assert ["text.0"] in keys and keys.count(["text.1"]) == 2, keys  # text.1's two halves


def test_a_prefix_matches_whole_names():
    blocks = nn.Module()
    blocks.layers = nn.Sequential(*(Block() for _ in range(11)))
    blocks.forward = lambda x: blocks.layers(x).mean()
    (plan,) = plans_of(blocks, Config(memory_budget={"layers.1": 0.0}))
    assert by_region(plan)["layers.1"].nodes == by_region(plans_of(Tower(), Config(
        memory_budget={"vision.1": 0.0}))[0])["vision.1"].nodes  # one block, not layers.10 too


def test_one_backend_for_identical_blocks_warns_that_they_share_a_plan():
    tower = Tower()
    backend = make_backend(strict=True, memory_budget={"vision": 0.0}, model=tower, step_planning=False)
    for block in [*tower.vision, *tower.text]:
        block.compile(backend=backend)
    with pytest.warns(UserWarning, match=r"one compiled graph runs for 'vision\.\d' and 'text\.0', whose per-module"):
        tower(torch.randn(512, WIDTH)).backward()


def test_a_peak_cap_is_the_limit_over_the_preferences():
    (free,) = plans_of(Tower(), Config(memory_budget={"vision": 0.0}))
    (tight,) = plans_of(Tower(), Config(memory_budget=0.0))
    planned = (free.estimated_peak_bytes + tight.estimated_peak_bytes) // 2  # between the two
    cap = int(planned / (1 - PEAK_MODEL_MARGIN))
    (capped,) = plans_of(Tower(), Config(memory_budget={"vision": 0.0, "": f"peak:{cap}"}))
    assert capped.estimated_peak_bytes <= planned < free.estimated_peak_bytes
    assert capped.budget_note.startswith("the regions' fractions were scaled by 0.5 to fit the cap")


def test_gradients_match_eager_and_the_report_shows_each_region(tmp_path):
    x = torch.randn(512, WIDTH)
    model = Tower()
    eager_loss = model(x)
    eager_loss.backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    backend = make_backend(strict=True, memory_budget="vision=0.0,text=0.5", report_dir=tmp_path)
    compiled = torch.compile(model, backend=backend)
    loss = compiled(x)
    loss.backward()
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6)
    for got, want in zip([p.grad for p in model.parameters()], expected):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    # The graph's report (the step view writes step.md beside it).
    (report,) = [path.read_text() for path in tmp_path.glob("*.md") if path.name != "step.md"]
    table = report[report.index("## Regions"):]
    assert re.search(r"\| vision \| 0 of runtime-optimal \| \d+ \|", table)
    assert re.search(r"\| text \| 0.5 of runtime-optimal \| \d+ \|", table)
    (vision,) = [line for line in table.splitlines() if line.startswith("- vision: saves ")]
    assert "vision.0.up/addmm" in vision.split("recomputes")[1]
