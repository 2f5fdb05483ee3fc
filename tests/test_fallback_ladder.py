"""The step view's fallback ladder (ckpt/step_view.py): where a budget's own
plans measure above what a looser budget's plans are predicted to peak, the
step tries those, and then runs the plans that measured lowest. So a
fraction never peaks above a looser one's plans or the runtime-optimal plan
it tried, however wrong the peak model is about the tight plan.

The view's decisions are driven here by hand-made plans and measurements
(no Inductor), one graph called once per step as a whole-model compile;
the last two tests run the ladder end to end through Inductor."""
import pytest
import torch
import torch._dynamo
from bench.models import GPT, GPTConfig, gpt_batch

from ckpt import make_backend, step_view
from ckpt.backend import fresh_step_view, live_step_view
from ckpt.step_meter import StepMeter
from ckpt.step_view import OWN, MAX_FALLBACKS
from partitioners.budget import RUNTIME_OPTIMAL, Rung, ladder
from partitioners.config import MemoryBudget
from partitioners.peak import PeakEstimate
from partitioners.plan import SAVED, Decision, Plan

MiB = 2**20
KEY = "g"


def _plan(predicted_mib: float, rungs: dict[str, float], saved: str = "own") -> Plan:
    """A plan predicted to peak at ``predicted_mib``, whose looser rungs are
    predicted at ``rungs`` (label -> MiB), each saving a set of its own."""
    return Plan(
        decisions=(Decision(saved, "op", SAVED, 1, "saved"),),
        peak_estimate=PeakEstimate(int(predicted_mib * MiB), 0),
        rungs=tuple(Rung(label, PeakEstimate(int(mib * MiB), 0), (label,)) for label, mib in rungs.items()),
    )


class _Step:
    """One graph under ``budget``, its plans per rung given, each step
    measured at ``measured[rung]`` MiB; runs the view's loop by hand."""

    def __init__(self, budget: str, plans: dict[str, Plan], measured: dict[str, float]):
        self.view = step_view.StepView()
        self.budget = MemoryBudget.parse(budget)
        self.plans, self.measured = plans, measured
        self.view.context_for(KEY, self.budget)
        self.view.record_plan(KEY, plans[OWN], measure=True)
        self.view.last_sequence[KEY] = (KEY,)

    def run(self, steps: int = 12) -> list[str]:
        """The rungs the steps ran at, one per measured step."""
        ran = []
        for _ in range(steps):
            state = self.view.sequences.setdefault((KEY,), step_view._Sequence())
            if state.settled:
                break
            rung = self.view.planning_for(KEY)[2]
            self.view.record_plan(KEY, self.plans[rung], measure=True, rung=rung)
            ran.append(rung)
            self.view._judge((KEY,), state, int(self.measured[rung] * MiB), planned_for_it=True)
        return ran

    @property
    def state(self):
        return self.view.sequences[(KEY,)]


@pytest.fixture(autouse=True)
def _fresh_view():
    fresh_step_view()
    yield
    fresh_step_view()


def test_ladders_of_each_budget_form():
    assert ladder(MemoryBudget.parse(0.0)) == ("0.25", "0.5", "0.75", RUNTIME_OPTIMAL)
    assert ladder(MemoryBudget.parse(0.5)) == ("0.75", RUNTIME_OPTIMAL)
    assert ladder(MemoryBudget.parse("peak:1GiB")) == (RUNTIME_OPTIMAL,)
    assert ladder(MemoryBudget.parse("512MiB")) == ()  # bytes are a hard limit
    assert ladder(MemoryBudget(fraction=0.0, pytorch_meaning=True)) == ()  # so are PyTorch's fractions
    assert ladder(None) == ()


def test_a_right_model_settles_at_once():
    """Measured as predicted: no looser plan is predicted below the
    measurement, so the first measured step settles, nothing recompiled."""
    rungs = {"0.25": 30, "0.5": 40, "0.75": 50, RUNTIME_OPTIMAL: 60}
    step = _Step("0.0", {OWN: _plan(20, rungs)}, {OWN: 20.5})
    assert step.run() == [OWN]
    assert step.state.settled and step.state.rung == OWN


def test_a_tight_plan_the_model_underestimates_falls_back_to_the_lowest_measured():
    """The tight plan measures 33% above its prediction, above what 0.5 and
    the runtime-optimal plan are predicted to peak (a ConvNeXt's case):
    the step tries the looser plan predicted lowest first, and runs the
    plans that measured lowest."""
    rungs = {"0.25": 16, "0.5": 15, "0.75": 15.5, RUNTIME_OPTIMAL: 14}
    plans = {
        OWN: _plan(12.9, rungs),
        RUNTIME_OPTIMAL: _plan(14, {}, saved="opt"),
        "0.5": _plan(15, {"0.75": 15.5, RUNTIME_OPTIMAL: 14}, saved="half"),
    }
    step = _Step("0.0", plans, {OWN: 17.1, RUNTIME_OPTIMAL: 14.1, "0.5": 15.5})
    ran = step.run()
    assert ran == [OWN, RUNTIME_OPTIMAL]  # 14.1 measured: nothing left predicted below it
    assert step.state.settled and step.state.rung == RUNTIME_OPTIMAL
    assert step.state.tried == {OWN: int(17.1 * MiB), RUNTIME_OPTIMAL: int(14.1 * MiB)}
    assert "runs the plans of the runtime-optimal plan" in step.view.describe()


def test_the_ladder_returns_to_the_own_plan_when_it_measured_lowest():
    """A looser plan predicted below the tight one's measurement measures
    higher still: the step goes back to the budget's own plans."""
    plans = {OWN: _plan(20, {"0.5": 21, RUNTIME_OPTIMAL: 40}), "0.5": _plan(21, {RUNTIME_OPTIMAL: 40}, "half")}
    step = _Step("0.0", plans, {OWN: 23, "0.5": 26})
    assert step.run() == [OWN, "0.5"]
    assert step.state.rung == OWN and step.state.settled


def test_tighter_fraction_never_settles_above_a_looser_one_it_tried():
    """0.0's plans measure above 0.5's (the T5 case): 0.0 ends on 0.5's
    plans, so 0.0 is not above 0.5."""
    rungs = {"0.25": 40, "0.5": 32.4, "0.75": 48, RUNTIME_OPTIMAL: 55}
    plans = {
        OWN: _plan(22.9, rungs),
        "0.25": _plan(40, {"0.5": 32.4, "0.75": 48, RUNTIME_OPTIMAL: 55}, "quarter"),
        "0.5": _plan(32.4, {"0.75": 48, RUNTIME_OPTIMAL: 55}, "half"),
        "0.75": _plan(48, {RUNTIME_OPTIMAL: 55}, "three"),
    }
    measured = {OWN: 51.2, "0.25": 52, "0.5": 47.5, "0.75": 60}
    step = _Step("0.0", plans, measured)
    ran = step.run()
    # Predicted lowest first; then 0.25 (40 < 47.5) is still worth a try,
    # 0.75 (48) is not.
    assert ran == [OWN, "0.5", "0.25"]
    assert step.state.rung == "0.5"


def test_the_ladder_is_bounded():
    """The model is wrong everywhere (every plan measures twice its
    prediction): at most MAX_FALLBACKS looser plans are tried."""
    labels = ["0.25", "0.5", "0.75", RUNTIME_OPTIMAL]
    predicted = dict(zip(labels, [11, 12, 13, 14]))
    plans = {OWN: _plan(10, predicted)}
    plans.update({label: _plan(predicted[label], {}, label) for label in labels})
    measured = {OWN: 30, **{label: 2 * mib for label, mib in predicted.items()}}
    step = _Step("0.0", plans, measured)
    ran = step.run()
    assert len(ran) == MAX_FALLBACKS + 1
    assert step.state.rung == min(step.state.tried, key=step.state.tried.get)


def test_equal_plans_are_tried_once():
    """0.25's plans are the budget's own (both stop at the lowest-peak
    plan): predicted below the measurement, but not tried again."""
    plan = Plan(
        decisions=(Decision("own", "op", SAVED, 1, "saved"),),
        peak_estimate=PeakEstimate(10 * MiB, 0),
        rungs=(Rung("0.25", PeakEstimate(10 * MiB, 0), ("own",)), Rung(RUNTIME_OPTIMAL, PeakEstimate(30 * MiB, 0), ("x",))),
    )
    step = _Step("0.0", {OWN: plan}, {OWN: 12})
    assert step.run() == [OWN]
    assert step.state.rung == OWN


def test_a_broken_cap_is_corrected_before_falling_back():
    """Under a peak cap, a step over it corrects the model (as before: at its
    first measurement, then up to MAX_CORRECTIONS times) before the
    ladder's runtime-optimal rung is tried."""
    plans = {OWN: _plan(8, {RUNTIME_OPTIMAL: 11}), RUNTIME_OPTIMAL: _plan(11, {}, "opt")}
    step = _Step("peak:10MiB", plans, {OWN: 12, RUNTIME_OPTIMAL: 11.5})
    ran = step.run()
    assert ran == [OWN] * (2 + step_view.MAX_CORRECTIONS) + [RUNTIME_OPTIMAL]
    assert step.state.corrections == step_view.MAX_CORRECTIONS
    assert step.state.rung == RUNTIME_OPTIMAL


def test_a_step_falls_back_through_inductor_and_trains_alike(monkeypatch):
    """End to end on a small GPT at 0.0 (one graph): a meter that reads
    every step of the budget's own plans as 8x what it measured (a model
    far too low) makes the step try looser plans, recompiled through
    Inductor (the runtime-optimal one with no budget at all), and run
    those that measured lowest; the losses equal a run without the
    fallback bit for bit (the forward kernels do not depend on the plan)."""
    cfg = GPTConfig(depth=2, width=32, heads=2, seq=32, vocab=64)
    tokens, targets = gpt_batch(cfg, 2)

    def train():
        fresh_step_view()
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = GPT(cfg)
        compiled = torch.compile(model, backend=make_backend(strict=True, memory_budget=0.0))
        losses = []
        for _ in range(8):
            model.zero_grad()
            loss = compiled(tokens, targets)
            loss.backward()
            losses.append(loss.item())
        view = live_step_view()
        view.finish_step()
        return losses, view

    plain_losses, plain = train()
    real_peak = StepMeter.peak

    def inflated(meter, until_ns=None):
        measured = real_peak(meter, until_ns)
        rungs = {state.rung for state in live_step_view().sequences.values()}
        return None if measured is None else measured * (8 if rungs <= {OWN} else 1)

    monkeypatch.setattr(StepMeter, "peak", inflated)
    losses, view = train()
    (state,) = view.sequences.values()
    assert state.settled and state.rung != OWN and len(state.tried) >= 2, state
    assert state.tried[state.rung] == min(state.tried.values())
    assert view.recompiles > plain.recompiles
    assert losses == plain_losses


def test_the_runtime_optimal_rung_compiles_as_the_default_plan(monkeypatch):
    """Fallen back to the runtime-optimal rung, a step runs the default
    plan's code: Inductor compiles it without the budget's settings (no
    buffer reuse there), so its predicted peak and saved set are the
    default plan's to the byte (the MoE's rung measured 512 bytes above its
    default plan when it kept them). The budget's own plan predicted that
    rung, which the ladder reads to decide whether to try it, as it runs."""
    cfg = GPTConfig(depth=2, width=32, heads=2, seq=32, vocab=64)
    tokens, targets = gpt_batch(cfg, 2)

    def train(**budget):
        fresh_step_view()
        torch._dynamo.reset()
        torch.manual_seed(0)
        backend = make_backend(strict=True, **budget)
        compiled = torch.compile(GPT(cfg), backend=backend)
        for _ in range(8):
            compiled(tokens, targets).backward()
        if backend._step_view is not None:
            backend.step_view.finish_step()
        return backend.plans[-1]

    default = train()
    real_peak = StepMeter.peak

    def inflated(meter, until_ns=None):
        measured = real_peak(meter, until_ns)
        rungs = {state.rung for state in live_step_view().sequences.values()}
        return None if measured is None else measured * (1 if rungs == {RUNTIME_OPTIMAL} else 8)

    monkeypatch.setattr(StepMeter, "peak", inflated)
    recorded = []
    real_record = step_view.StepView.record_plan

    def recording(view, key, plan, measure, rung=OWN):
        recorded.append((rung, plan))
        return real_record(view, key, plan, measure, rung)

    monkeypatch.setattr(step_view.StepView, "record_plan", recording)
    fallen_back = train(memory_budget=0.5)
    own = next(plan for rung, plan in recorded if rung == OWN)
    (state,) = live_step_view().sequences.values()
    assert state.settled and state.rung == RUNTIME_OPTIMAL, state
    assert fallen_back.peak_estimate == default.peak_estimate
    (rung,) = [r for r in own.rungs if r.label == RUNTIME_OPTIMAL]
    assert rung.peak == default.peak_estimate
    assert [(d.name, d.decision) for d in fallen_back.decisions] == [(d.name, d.decision) for d in default.decisions]
