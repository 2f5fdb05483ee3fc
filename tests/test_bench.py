"""The bench suite's parts: mode strings, byte sizes, the batch search, block
checkpointing in the built-in models. Fast: the few tests that compile use
tiny models (the quick MLP)."""
import copy
import dataclasses
import types

import pytest
import torch

from bench import cases
from bench.capsearch import largest_batch_under_cap
from bench.harness import Settings, run_case
from bench.modes import Mode, ModeError, build_runner, parse_bytes, parse_mode, parse_modes
from bench.models import GPT, MLP, ConvNet, GPTConfig, gpt_batch, image_batch


@pytest.mark.parametrize("text, mode", [
    ("eager", Mode("eager")),
    ("eager+checkpoint", Mode("eager+checkpoint")),
    ("compile", Mode("compile")),
    (" compile+budget=0.1 ", Mode("compile", "0.1")),
    ("compile+budget=1", Mode("compile", "1")),
    ("ckpt", Mode("ckpt")),
    ("ckpt+budget=0.3", Mode("ckpt", "0.3")),
    ("ckpt+budget=16MiB", Mode("ckpt", "16MiB")),
    ("ckpt+budget=2GB", Mode("ckpt", "2GB")),
    ("ckpt+budget=1.5e9", Mode("ckpt", "1.5e9")),
    ("ckpt-per-block", Mode("ckpt-per-block")),
    ("ckpt-per-block+budget=0.0", Mode("ckpt-per-block", "0.0")),
    ("ckpt-per-block+budget=peak:64MiB", Mode("ckpt-per-block", "peak:64MiB")),
])
def test_valid_modes_parse_and_print_back(text, mode):
    assert parse_mode(text) == mode
    assert str(mode) == text.strip()


@pytest.mark.parametrize("text", [
    "inductor", "Compile", "ckpt+", "ckpt+budget=", "ckpt+budget=lots", "ckpt+budget=-1",
    "ckpt+budget=16 parsecs", "compile+budget=16MiB", "compile+budget=1.5",
    "eager+budget=0.5", "eager+checkpoint+budget=0.5", "ckpt+checkpoint",
    "ckpt-per-block+budget=lots", "ckpt-per-blocks", "ckpt-per-block+checkpoint",
])
def test_invalid_modes_name_the_valid_forms(text):
    with pytest.raises(ModeError, match="valid forms: eager, eager\\+checkpoint, compile"):
        parse_mode(text)


def test_per_block_mode_is_compiled_and_says_so_in_the_error_forms():
    assert parse_mode("ckpt-per-block").compiled
    with pytest.raises(ModeError, match="ckpt-per-block, ckpt-per-block\\+budget=B"):
        parse_mode("per-block")


def test_repeated_blocks_finds_the_block_list():
    from bench.modes import repeated_blocks

    gpt = GPT(GPTConfig(depth=3, width=16, heads=2, seq=4, vocab=8))
    assert repeated_blocks(gpt) is gpt.blocks
    mlp = MLP(depth=2, width=8)
    assert repeated_blocks(mlp) is mlp.blocks


class _Experts(torch.nn.Module):
    """A layer with a list of small experts inside: the layer list holds more."""

    def __init__(self):
        super().__init__()
        self.attn = torch.nn.Linear(8, 8)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(8, 8, bias=False) for _ in range(2))


def test_repeated_blocks_prefers_the_list_with_most_parameters():
    from bench.modes import repeated_blocks

    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList(_Experts() for _ in range(2))
    model.heads = torch.nn.ModuleList([torch.nn.Linear(8, 2), torch.nn.Linear(8, 3)])
    assert repeated_blocks(model) is model.model.layers


def test_repeated_blocks_without_a_block_list_is_a_clear_error():
    from bench.modes import repeated_blocks

    mixed = torch.nn.Module()
    mixed.parts = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.ReLU()])
    for model in (ConvNet(channels=4, stages=2), mixed):
        with pytest.raises(ValueError, match="has no list of repeated blocks .* use the ckpt mode"):
            repeated_blocks(model)


def test_step_plans_repeat_a_shared_block_plan():
    from bench.harness import step_plans
    from bench.modes import Runner

    a, b = object(), object()
    assert step_plans(Runner(None, [a, b])) == [a, b]  # whole model: each graph once
    assert step_plans(Runner(None, [a], blocks=3)) == [a, a, a]  # one graph for every block
    assert step_plans(Runner(None, [a, b], blocks=2)) == [a, b]  # a graph per block
    assert step_plans(Runner(None, [a, b], blocks=3)) is None  # which block ran which: unknown


class _SetsConfigOnFirstCall(torch.nn.Module):
    """As transformers' classification loss: the first call sets a config
    attribute a guard reads, so Dynamo compiles the model again on the second."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.config = types.SimpleNamespace(problem_type=None)

    def forward(self, x):
        if self.config.problem_type is None:
            self.config.problem_type = "regression"
        return self.linear(x).relu().sum()


def test_a_step_counts_the_graphs_it_ran_not_every_graph_compiled():
    from bench.harness import plan_estimates, predicted_step_peak, step_plans

    torch._dynamo.reset()
    runner = build_runner(_SetsConfigOnFirstCall(), parse_mode("ckpt"))
    x = torch.randn(4, 8, requires_grad=True)
    for _ in range(2):
        runner(x).backward()
    first, second = runner.plans  # the second call compiled the model again
    assert step_plans(runner) == [second]
    assert plan_estimates(runner)[1] == predicted_step_peak([second]) < predicted_step_peak([first, second])


def test_mode_lists_keep_order_and_drop_duplicates():
    assert [str(m) for m in parse_modes(["ckpt", "eager", "ckpt"])] == ["ckpt", "eager"]


def test_unknown_mode_on_the_command_line_is_a_clear_error(capsys):
    from bench.suite import run

    with pytest.raises(SystemExit, match="unknown mode 'fast'; valid forms"):
        run(["--modes", "eager", "fast"])


@pytest.mark.parametrize("text, nbytes", [
    ("64MiB", 64 * 2**20), ("1.5GB", 1_500_000_000), ("512 KiB", 512 * 1024), ("100000", 100000), ("3b", 3),
])
def test_parse_bytes(text, nbytes):
    assert parse_bytes(text) == nbytes


@pytest.mark.parametrize("text", ["", "MiB", "12 parsecs", "-5MiB"])
def test_parse_bytes_rejects_nonsense(text):
    with pytest.raises(ValueError):
        parse_bytes(text)


def _linear_peak(per_item: int, fixed: int = 0):
    probes = []

    def peak_at(batch):
        probes.append(batch)
        return fixed + per_item * batch

    return peak_at, probes


def test_cap_search_doubles_then_bisects():
    peak_at, probes = _linear_peak(per_item=10)
    best, record = largest_batch_under_cap(peak_at, cap=250, start=8, start_peak=80, max_probes=10)
    assert probes[:2] == [16, 32]  # doubling until over the cap (250 // 10 = 25)
    assert probes[2] == 24  # then bisection
    assert best == 24  # 25 is within 1/8 of 24: not worth a compile
    assert record == [(b, 10 * b) for b in probes]


def test_cap_search_halves_when_the_start_is_over():
    peak_at, probes = _linear_peak(per_item=10)
    best, _ = largest_batch_under_cap(peak_at, cap=35, start=8, start_peak=80, max_probes=10)
    assert probes[:2] == [4, 2]
    assert best == 3


def test_cap_search_stops_at_its_probe_budget_and_at_batch_one():
    peak_at, probes = _linear_peak(per_item=10)
    best, _ = largest_batch_under_cap(peak_at, cap=10**6, start=8, start_peak=80, max_probes=2)
    assert (best, probes) == (32, [16, 32])
    peak_at, probes = _linear_peak(per_item=10, fixed=100)
    best, _ = largest_batch_under_cap(peak_at, cap=50, start=4, start_peak=140, max_probes=10)
    assert (best, probes) == (None, [2, 1])
    best, record = largest_batch_under_cap(peak_at, cap=10**6, start=4, start_peak=140, max_probes=0)
    assert (best, record) == (4, [])


def test_cap_search_treats_a_failed_probe_as_over():
    best, _ = largest_batch_under_cap(lambda b: None, cap=100, start=4, start_peak=40, max_probes=1)
    assert best == 4


def _grads(model, *inputs):
    model.zero_grad(set_to_none=True)
    model(*inputs).backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("build, inputs", [
    (lambda: MLP(depth=2, width=16), lambda: (torch.randn(4, 16),)),
    (lambda: GPT(GPTConfig(depth=2, width=32, heads=2, seq=8, vocab=32, dropout=0.1)),
     lambda: gpt_batch(GPTConfig(seq=8, vocab=32), 2)),
    (lambda: ConvNet(channels=4, stages=2), lambda: image_batch(2, size=8)),
])
def test_checkpoint_blocks_gives_the_same_gradients_and_saves_less(build, inputs):
    from bench.measure import count_saved_bytes

    torch.manual_seed(0)
    model, args = build(), inputs()
    checkpointed = copy.deepcopy(model)
    checkpointed.checkpoint_blocks = True
    saved = {}
    for name, m in (("plain", model), ("checkpointed", checkpointed)):
        torch.manual_seed(1)  # the same dropout masks: checkpoint replays the RNG state
        with count_saved_bytes([*m.parameters(), *args]) as saved[name]:
            loss = m(*args)
        loss.backward()
    for p, q in zip(model.parameters(), checkpointed.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    assert saved["checkpointed"]["bytes"] < saved["plain"]["bytes"]


def test_models_keep_their_default_behaviour():
    assert MLP().checkpoint_blocks is False
    assert GPT(GPTConfig(depth=1, width=16, heads=2, seq=4, vocab=8)).checkpoint_blocks is False
    assert ConvNet().checkpoint_blocks is False


def test_eager_cap_search_through_the_harness():
    case = cases.builtin_case("mlp", "quick")
    result = run_case(case, [Mode("eager")], Settings(repeats=1, probes=3))
    (mode,) = result.modes
    assert result.cap_bytes == mode.peak_bytes and result.cap_source.startswith("peak of eager")
    assert mode.cap_batch == case.batch  # its own peak is the cap: doubling overshoots
    assert [b for b, _ in mode.cap_probes][:2] == [case.batch, 2 * case.batch]
    smaller = run_case(case, [Mode("eager")], Settings(repeats=1, probes=3, cap=mode.peak_bytes // 2))
    assert 0 < smaller.modes[0].cap_batch < case.batch
    assert smaller.modes[0].cap_throughput > 0


def test_timing_drops_a_mode_whose_recompiled_graph_saves_other_bytes():
    """The timed steps must run the measured plan: a warm-up step that saves
    other bytes (Dynamo handed the frame another mode's graph) drops the
    mode's times with an error that says so."""
    from bench.harness import ModeResult, _time_interleaved, prepare, saved_bytes_of_step

    case = cases.builtin_case("mlp", "quick")
    torch.manual_seed(0)
    base = case.build()
    modes = [Mode("eager"), Mode("eager+checkpoint")]
    preps = {mode: prepare(case, base, mode, case.batch, "cpu") for mode in modes}
    results = {mode: ModeResult(str(mode), case.batch) for mode in modes}
    results[modes[0]].saved_bytes = saved_bytes_of_step(preps[modes[0]])
    results[modes[1]].saved_bytes = saved_bytes_of_step(preps[modes[0]])  # another mode's bytes
    assert results[modes[1]].saved_bytes != saved_bytes_of_step(preps[modes[1]])
    _time_interleaved(case, preps, results, Settings(repeats=2), lambda mode, phase: None)
    kept, dropped = results[modes[0]], results[modes[1]]
    assert kept.error is None and len(kept.step_times_s) == 2
    assert dropped.step_times_s == [] and dropped.step_s is None
    assert dropped.error.startswith("timing: the recompiled graph saves") and "another plan" in dropped.error


def test_run_case_lets_every_compiled_mode_keep_its_own_cache_entry(monkeypatch):
    """Each compiled mode has a backend of its own, so each keeps an entry in
    Dynamo's cache of the model's forward: past the default limit of 8, the
    sweep's 9th compiled mode ran eagerly. run_case lifts the limit."""
    import bench.harness as harness

    limits = []
    monkeypatch.setattr(harness, "_time_interleaved",
                        lambda *args: limits.append(torch._dynamo.config.recompile_limit))
    default = torch._dynamo.config.recompile_limit
    run_case(cases.builtin_case("mlp", "quick"), [Mode("eager")], Settings(repeats=1, probes=0))
    assert limits == [harness.RECOMPILE_LIMIT] and harness.RECOMPILE_LIMIT > default
    assert torch._dynamo.config.recompile_limit == default


def test_real_models_are_skipped_with_a_note_when_absent():
    from bench import real

    for name in real.REAL:
        reason = real.missing(name)
        assert reason is None or reason == f"{real.REAL[name]} is not installed"


def test_budgets_option_replaces_the_budget_modes():
    from bench.suite import PRESET_DEFAULTS, _modes, parser

    args = parser().parse_args(["--budgets", "0.3", "16MiB"])
    assert [str(m) for m in _modes(args, PRESET_DEFAULTS["default"])] == [
        "eager", "eager+checkpoint", "compile", "ckpt",
        "compile+budget=0.3", "ckpt+budget=0.3", "ckpt+budget=16MiB",
    ]


def test_bad_cap_and_unknown_model_are_clear_errors():
    from bench.suite import run

    with pytest.raises(SystemExit, match="--cap: 'lots' is not a byte size"):
        run(["--models", "mlp", "--cap", "lots"])
    with pytest.raises(SystemExit, match="unknown model"):
        run(["--models", "resnet50"])


def test_predicted_step_peak_composes_graphs_in_run_order():
    from bench.harness import predicted_step_peak
    from partitioners.peak import PeakEstimate

    class Planned:
        def __init__(self, peak):
            self.peak_estimate = peak

    model = PeakEstimate(forward_bytes=100, backward_bytes=300, held_bytes=60, output_bytes=10, gradient_bytes=50)
    loss = PeakEstimate(forward_bytes=5, backward_bytes=20, held_bytes=4, output_bytes=1, gradient_bytes=10)
    assert predicted_step_peak([Planned(model)]) == 300
    # The loss graph runs after the model's forward holds 60 + 10 bytes, and
    # its gradient (10) is alive while the model's backward runs.
    assert predicted_step_peak([Planned(model), Planned(loss)]) == max(100, 300 + 10, 70 + 5, 60 + 20)
    # When that gradient is of the activation the model handed the loss
    # graph, it is the model's tangent, which its backward peak counts.
    handed = dataclasses.replace(loss, input_gradient_bytes=10)
    assert predicted_step_peak([Planned(model), Planned(handed)]) == max(100, 300, 70 + 5, 60 + 20)
    assert predicted_step_peak([Planned(model), object()]) is None  # a graph without a prediction
    assert predicted_step_peak([]) is None


def test_peak_budget_mode_compiles_per_batch_in_the_cap_search():
    from bench.harness import CapSearch

    case = cases.builtin_case("mlp", "quick")
    torch.manual_seed(0)
    search = CapSearch(case, case.build(), parse_mode("ckpt+budget=peak:64KiB"), Settings())
    assert search.per_batch and search.start_peak > 0
    plans = search.prep.runner.plans
    # A probe at another batch recompiles for it: a new graph, a new Plan.
    assert search.peak_at(2 * case.batch) > search.start_peak
    assert search.prep.args[0].shape[0] == 2 * case.batch
    assert search.prep.runner.plans is not plans and len(search.prep.runner.plans) == 1


def test_calibrate_names_the_order_inductor_keeps():
    from bench.calibrate import describe_reorder

    # Inductor takes the first lowest estimate: graph order wins ties.
    assert describe_reorder([("baseline", 2 << 20), ("lpmf", 2 << 20), ("dfs", 3 << 20)]).startswith(
        "keeps graph order")
    assert describe_reorder([("baseline", 3 << 20), ("lpmf", 2 << 20), ("bfs", 2 << 20)]).startswith(
        "reorders (lpmf)")


def test_vlm_summary_takes_the_fastest_region_setting_at_or_below_each_uniform_peak():
    from bench.vlm import summary

    results = {
        "ckpt+budget=0.0": {"peak_bytes": 100 * 2**20, "step_s": 1.0},
        "ckpt+budget=0.5": {"peak_bytes": 120 * 2**20, "step_s": 0.9},
        "ckpt+budget=vision_tower=0.0": {"peak_bytes": 110 * 2**20, "step_s": 0.8},
        "ckpt+budget=vision_tower=0.0,language_model=0.5": {"peak_bytes": 99 * 2**20, "step_s": 0.95},
    }
    rows = {line.split(" | ")[0].strip("| "): line for line in summary(results)[2:]}
    assert rows["0.0"].endswith("| vision_tower=0.0,language_model=0.5 | 99.00 | 0.950 |")
    assert rows["0.5"].endswith("| vision_tower=0.0 | 110.00 | 0.889 |")


def test_memory_is_measured_once_the_step_view_has_settled():
    """A budget mode's step view re-plans over its first steps: the harness
    steps until it has settled, so the measured step runs the plans that run
    on (ConvNeXt at 0.5 measured 19.56 MiB mid-re-plan, 14.65 settled)."""
    from bench.harness import ModeResult, measure_memory, prepare
    from ckpt.backend import live_step_view

    case = cases.builtin_case("mlp", "quick")
    torch.manual_seed(0)
    base = case.build()
    budget = parse_mode("ckpt+budget=0.0")
    result = ModeResult(str(budget), case.batch)
    measure_memory(prepare(case, base, budget, case.batch, "cpu"), result, "cpu")
    assert result.settle_steps >= 1 and live_step_view().settled
    default = ModeResult("ckpt", case.batch)
    measure_memory(prepare(case, base, parse_mode("ckpt"), case.batch, "cpu"), default, "cpu")
    assert default.settle_steps == 0  # no budget: no step view, nothing to wait for
    assert result.peak_bytes <= default.peak_bytes


def test_peak_model_names_budgets_measured_above_a_looser_point():
    from bench.peak_model import above_looser

    def row(mode, measured):
        return {"model": "m", "mode": mode, "measured_bytes": measured}

    rows = [row("ckpt", 100), row("ckpt+budget=0.5", 90), row("ckpt+budget=0.0", 95),
            row("ckpt+budget=peak:99B", 101)]
    assert above_looser(rows) == [("m", "ckpt+budget=0.0", "ckpt+budget=0.5"),
                                  ("m", "ckpt+budget=peak:99B", "ckpt")]
    assert above_looser(rows[:2]) == []
