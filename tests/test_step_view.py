"""The step view end to end (ckpt/step_view.py): graphs learnt from the
first step, planned again for the step's peak, measured, and a plan per
size bucket of a dynamic graph. Small models, Inductor codegen on CPU.

Peaks are measured as the bench does (bench.measure.peak_cpu_bytes: the
profiler's memory events over one forward and backward)."""
import time

import pytest
import torch
import torch._dynamo

from bench.measure import peak_cpu_bytes
from conftest import Block, GraphBrokenBlocks
from bench.models import GPT, GPTConfig, gpt_batch
from ckpt import make_backend, step_view
from ckpt.backend import fresh_step_view, live_step_view
from ckpt.step_calls import Calls, InputIdentities
from ckpt.step_meter import StepMeter

transformers = pytest.importorskip("transformers")

QWEN = dict(vocab_size=128, hidden_size=64, intermediate_size=176, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, use_cache=False, attn_implementation="sdpa")
SEQ, BATCH = 256, 2


@pytest.fixture(autouse=True)
def _fresh_view():
    fresh_step_view()
    yield
    fresh_step_view()


def _qwen():
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**QWEN))


def _train(model, fn, batches, first_step=False):
    """AdamW steps over ``batches``; the losses, the last step's peak, and
    the peaks measured (with ``first_step``, the first step's too). A step
    measured here is not ckpt's to measure: its meter yields to a profiler
    that is on."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, peak, peaks = [], None, []
    for index, tokens in enumerate(batches):
        optimizer.zero_grad(set_to_none=True)
        box = {}

        def step():
            box["loss"] = fn(input_ids=tokens, labels=tokens).loss
            box["loss"].backward()

        if (first_step and index == 0) or index == len(batches) - 1:
            peak = peak_cpu_bytes(step)
            peaks.append(peak)
        else:
            step()
        optimizer.step()
        losses.append(box["loss"].item())
    return losses, peak, peaks


def _checkpointed_peak(batches) -> int:
    """The last step's peak of per-layer eager checkpointing (transformers')."""
    eager = _qwen()
    eager.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return _train(eager, eager, batches)[1]


def _tokens(steps, seq=SEQ):
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(QWEN["vocab_size"], (BATCH, seq), generator=generator) for _ in range(steps)]


def _per_block(budget, shared=True, **settings):
    """Each decoder layer compiled on its own: with one backend (the layers
    share one graph), or a backend per layer (a graph each)."""
    model = _qwen()
    shared_backend = make_backend(strict=True, memory_budget=budget, **settings)
    backends = [
        shared_backend if shared else make_backend(strict=True, memory_budget=budget, **settings)
        for _ in model.model.layers
    ]
    for layer, backend in zip(model.model.layers, backends):
        layer.compile(backend=backend)
    return model, backends


def test_per_block_budget_is_judged_on_the_step():
    """Alone, the layer graph's lowest-peak plan keeps its attention; in a
    step of three layers it pays that three times, so the step view's plan
    keeps less. The step peak at 0.0 is at most 1.05x per-layer eager
    checkpointing's; the losses equal the plan-alone run's bit for bit
    (Inductor's forward kernels do not depend on what is saved)."""
    batches = _tokens(4)
    alone_model, alone = _per_block(0.0, step_planning=False)
    alone_losses, alone_peak, _ = _train(alone_model, alone_model, batches)
    torch._dynamo.reset()
    model, backends = _per_block(0.0)
    losses, peak, _ = _train(model, model, batches)
    view = live_step_view()
    torch._dynamo.reset()
    checkpointed = _checkpointed_peak(batches)

    (alone_plan,), (plan,) = alone[0].plans, backends[0].plans  # the layers share one graph
    assert alone_plan.step is None and plan.step.startswith("3 call(s) in a step of 3")
    assert plan.saved_activation_bytes < alone_plan.saved_activation_bytes
    assert view.recompiles == 1  # the plan made alone, replaced once
    assert peak < alone_peak and peak <= 1.05 * checkpointed, (peak, alone_peak, checkpointed)
    assert losses == alone_losses
    # The rotary tables are handed to every layer's call: after the first
    # call they are the same tensors, which a plan that saves them holds once.
    (state,) = view.sequences.values()
    assert state.repeated[0] == frozenset() and state.repeated[1] == state.repeated[2] != frozenset()
    # Each layer's hidden-state input (the one with a gradient) is new each call.
    hidden = {position for position, _ in plan.peak_estimate.input_gradients}
    assert hidden and not hidden & state.repeated[1]
    # The uncorrected model of the step, against its first measurement: the
    # layers' activation gradients and shared tables are not counted per call.
    first = view.measurements[0]
    assert abs(first.ratio - 1) < 0.05, (first.predicted_bytes, first.measured_bytes)


def test_peak_cap_holds_for_the_step_and_is_measured():
    """A peak: cap is the step's, shared by its graphs: with the cap between
    per-layer checkpointing's peak and the plans made alone, the step stays
    under it, and the view reports predicted next to measured."""
    batches = _tokens(5)
    checkpointed = _checkpointed_peak(batches)
    torch._dynamo.reset()
    cap = int(checkpointed * 1.15)
    model, backends = _per_block(f"peak:{cap}")
    peaks = _train(model, model, batches, first_step=True)[2]
    view = live_step_view()
    # The first step too: before the step is known each layer
    # plans to fit the cap in a step of many calls of itself, not alone
    # (alone, step 1 peaked at 1.4-2.1x the cap).
    assert max(peaks) <= 1.03 * cap, ([p / cap for p in peaks], cap)
    (plan,) = backends[0].plans  # the plan in force: made for the step
    assert plan.step.startswith("3 call(s) in a step of 3"), plan.step
    assert view.measurements, "the view measured no step"
    measurement = view.measurements[-1]
    assert measurement.measured_bytes > 0 and measurement.predicted_bytes > 0
    assert "measured / predicted" in view.describe()


def _train_broken(steps: int) -> step_view.StepView:
    """``steps`` steps of GraphBrokenBlocks compiled at 0.0; the step view after them."""
    model = torch.compile(GraphBrokenBlocks(), backend=make_backend(strict=True, memory_budget=0.0))
    x = torch.randn(32, 64)
    for _ in range(steps):
        model(x).backward()
    view = live_step_view()
    view.finish_step()
    return view


def test_graph_broken_model_plans_each_graph_in_its_step():
    view = _train_broken(3)
    (sequence,) = view.sequences
    assert len(sequence) == 3 and len(set(sequence)) == 3  # three graphs, each once
    steps = [plan.step for plan in view.plans.values()]
    assert steps == ["1 call(s) in a step of 3 graph call(s)"] * 3
    assert view.recompiles == 3


def test_metering_every_step_measures_each_and_plans_the_same():
    """``meter_every_step`` (the bench's per-step peaks): every step without a
    compile is measured, those the plans do not need only informing, and
    the graphs are planned as without it (3 re-plans, as in the test above).
    Steps 1 and 2 compile (the graphs, then their step plans): a compile
    stops the step's measurement."""
    shared = fresh_step_view()  # held: the backend made next shares it
    shared.meter_every_step = True
    view = _train_broken(5)
    assert view is shared
    assert view.recompiles == 3
    assert [m.step for m in view.measurements] == [3, 4, 5]
    assert all(m.measured_bytes > 0 for m in view.measurements)
    assert [m.judged for m in view.measurements] == [True, False, False]  # settled after step 3


def test_a_backend_per_block_plans_every_entry_for_the_step():
    """Blocks of one shape, each compiled with a backend of its own: one
    graph in the step view, called three times, and each of Dynamo's three
    entries for it is planned again for the step (once each)."""
    blocks = [Block() for _ in range(3)]
    backends = [make_backend(strict=True, memory_budget=0.0) for _ in blocks]
    for block, backend in zip(blocks, backends):
        block.compile(backend=backend)
    x = torch.randn(32, 64, requires_grad=True)  # so that every block's graph is one graph
    for _ in range(3):
        y = x
        for block in blocks:
            y = block(y)
        y.square().mean().backward()
    view = live_step_view()
    assert len(view.plans) == 1 and view.recompiles == 3
    assert all(backend.plans[-1].step == "3 call(s) in a step of 3 graph call(s)" for backend in backends)


def test_step_planning_off_plans_each_graph_alone():
    model = torch.compile(GraphBrokenBlocks(), backend=make_backend(strict=True, memory_budget=0.0, step_planning=False))
    x = torch.randn(32, 64)
    for _ in range(3):
        model(x).backward()
    view = live_step_view()
    assert view is None or view.steps == 0  # no budgeted view learnt a step


def test_a_longer_batch_gets_its_own_plan_before_it_runs():
    """A dynamic sequence length: the plan is made at the next power of two
    of the size it is called with; a longer batch is planned for before it
    runs (a recompile inside ckpt's callable, counted), a shorter one reuses
    a plan. Gradients match eager's."""
    cfg = GPTConfig(depth=2, width=32, heads=2, seq=256, vocab=64)
    model = GPT(cfg)
    reference = GPT(cfg)
    reference.load_state_dict(model.state_dict())
    backend = make_backend(strict=True, memory_budget=0.0)
    compiled = torch.compile(model, backend=backend, dynamic=True)
    for seq in (48, 100, 256, 60):
        tokens, targets = gpt_batch(GPTConfig(depth=2, width=32, heads=2, seq=seq, vocab=64), 2)
        model.zero_grad()
        reference.zero_grad()
        compiled(tokens, targets).backward()
        reference(tokens, targets).backward()
        for got, want in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-5)
    keys = sorted(live_step_view().plans)
    sizes = sorted(int(key.rpartition("=")[2]) for key in keys)
    assert sizes == [64, 128, 256], keys  # 48 -> 64, 100 -> 128, 256 -> 256, 60 reuses 64
    assert live_step_view().recompiles == 2


def test_a_declared_bound_is_planned_for_once():
    """``mark_dynamic(..., max=...)``: the one plan is made at the bound, and
    every shorter batch runs it: no recompile."""
    cfg = GPTConfig(depth=1, width=32, heads=2, seq=128, vocab=64)
    backend = make_backend(strict=True, memory_budget=0.0)
    compiled = torch.compile(GPT(cfg), backend=backend)
    for seq in (40, 100):
        tokens, targets = gpt_batch(GPTConfig(depth=1, width=32, heads=2, seq=seq, vocab=64), 2)
        for tensor in (tokens, targets):
            torch._dynamo.mark_dynamic(tensor, 1, min=2, max=128)
        compiled(tokens, targets).backward()
    (key,) = live_step_view().plans
    assert key.endswith("=128"), key
    assert live_step_view().recompiles == 0


def test_a_peak_cap_over_per_module_budgets_holds_for_the_step():
    """Per-module budgets are preferences, the step's cap the limit: on a
    transformers model compiled whole (its forward is a wrapper, so Dynamo's
    paths start at ``L['args'][0]``), the layers' budgets are found by their
    named_modules() paths, the cap tightens them, the measured step stays
    under it; a path naming no module warns instead of changing nothing."""
    batches = _tokens(5)
    checkpointed = _checkpointed_peak(batches)
    torch._dynamo.reset()
    # Below what the layers' budgets alone plan for, above the lowest plan:
    # with partial rotary's scatters inline in the peak model (2026-12-06)
    # the regional plan fits under per-layer checkpointing's peak itself.
    cap = int(0.9 * checkpointed)
    model = _qwen()
    budget = {"model.layers.0": 0.0, "model.layers.1": 0.5, "model.layers.7": 0.0, "": f"peak:{cap}"}
    backend = make_backend(strict=True, memory_budget=budget)
    with pytest.warns(UserWarning, match=r"budget for 'model\.layers\.7' matched no module"):
        _, peak, _ = _train(model, torch.compile(model, backend=backend), batches)
    (plan,) = backend.plans
    assert {row.key for row in plan.regions} == {"model.layers.0", "model.layers.1", "(rest)"}
    assert plan.budget_note is not None and "cap" in plan.budget_note, plan.budget_note
    assert peak <= 1.03 * cap, (peak, cap)


def test_a_tensor_freed_and_its_memory_reused_is_a_new_input():
    """The view names a step's inputs by their live storage: a tensor handed
    twice has one name; memory freed and allocated again (a block's input
    it did not save) gets a new one, so it is not taken for a repeat."""
    import weakref

    names = InputIdentities()
    kept = torch.randn(4096)
    assert names.of(kept) == names.of(kept[:]) and names.of(kept[1:]) != names.of(kept)
    assert names.of(torch.nn.Parameter(torch.randn(2))) is None and names.of(3) is None
    # A tensor named at an address, then freed; the allocator hands the
    # address to a new tensor (played here: the record of the freed one is
    # put at the new tensor's address, which the allocator may or may not reuse).
    freed = torch.randn(4096)
    record = (weakref.ref(freed), 0)
    del freed
    again = torch.randn(4096)
    names._storages[again.untyped_storage().data_ptr()] = record
    assert record[0]() is None
    assert names.of(again)[1] == 1  # a new generation: not the freed tensor's name
    assert names.of(again) == names.of(again)


def test_parameters_freed_by_the_steps_end_were_gathered_for_it():
    """FSDP frees a block's unsharded parameters after their backward (their
    storage resized to nothing): the view counts, per call, the bytes of
    the parameters it was handed whose memory is gone when the step ends;
    parameters that stay, and other inputs, count nothing."""
    calls = Calls()
    gathered, resident = torch.nn.Parameter(torch.randn(256)), torch.nn.Parameter(torch.randn(64))
    calls.record("block", (torch.randn(8), gathered, resident), None, True)
    calls.record("head", (torch.randn(8), resident), None, True)
    assert calls.freed_parameters() == (0, 0)
    gathered.untyped_storage().resize_(0)  # what FSDP's reshard does
    assert calls.freed_parameters() == (256 * 4, 0)
    del gathered  # a parameter gone altogether was not gathered by a sharding
    assert calls.freed_parameters() == (0, 0)


def test_the_cpu_meter_records_allocations_and_gives_record_functions_no_callbacks():
    """The meter starts in one graph call and stops in a later one, inside
    record functions (Dynamo's compiled region, autograd's nodes) that began
    while it ran; a profiler with record-function callbacks, stopped there
    and followed by another, corrupts the heap when they end (their end
    writes into its freed events). The meter records memory events only."""
    import ckpt_compat as compat

    compat.start_recording_memory()
    try:
        with torch.autograd.profiler.record_function("opened under the meter"):
            x = torch.ones(1000)
            y = x * 2
            del x
    finally:
        recorded = compat.stop_recording_memory()
    names = {event.name for event in recorded.experimental_event_tree()}
    assert names == {"[memory]"}, names
    # x and y, 4000 bytes each (the record function itself holds a few bytes)
    assert [n for _, _, n in compat.memory_events(recorded) if abs(n) >= 1000] == [4000, 4000, -4000]
    del y

    meter = StepMeter.start(torch.device("cpu"), lambda finished: None)
    z = torch.ones(250)  # 1000 bytes
    assert meter.peak(time.time_ns()) == 1000
    assert not compat.profiler_active()
    del z


def test_a_profiler_the_user_starts_while_the_meter_runs_is_left_running():
    """A user's profiler replaces the meter: the meter's step is not
    measured, and stopping the meter does not stop the user's profiler."""
    from torch.profiler import ProfilerActivity, profile

    meter = StepMeter.start(torch.device("cpu"), lambda finished: None)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        assert meter.peak(time.time_ns()) is None
        torch.ones(8).mul(2)
    assert any(event.name == "aten::mul" for event in prof.events())

    meter = StepMeter.start(torch.device("cpu"), lambda finished: None)
    with profile(activities=[ProfilerActivity.CPU]):
        pass
    assert meter.peak(time.time_ns()) is None
    # A profiler of the user's already on: no meter starts under it.
    with profile(activities=[ProfilerActivity.CPU]):
        assert StepMeter.start(torch.device("cpu"), lambda finished: None) is None
