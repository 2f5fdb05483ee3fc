"""CkptPartitioner: joint graph -> Plan -> (forward, backward) GraphModules.

The path: passes/joint.py cleans the joint graph, classify -> solve_with_budget
-> build_plan decide, torch's extraction builds the two graphs from the saved
set, and passes/partitioned.py orders them.
"""
from __future__ import annotations

import dataclasses
import functools
import pathlib
import warnings
from collections.abc import Callable, Mapping

import torch.fx as fx

from passes import joint as joint_passes
from passes import partitioned as partitioned_passes
from passes import run_passes

import ckpt_compat as compat
from .classify import GraphFacts, classify, graph_device
from .config import Config, ConfigError, warn_once
from .budget import resolved_budget, solve_before_the_step, solve_with_budget
from . import peak
from .cost import profile_for
from .plan import Plan, build_plan
from .regions import label_regions, solve_regions
from .rank_sync import check_same_plan_on_all_ranks
from .step import UNKNOWN_STEP, StepContext

_PROJECT_ROOT = pathlib.Path(__file__).resolve().parent.parent
# Source that decides what a compile produces; part of the cache key.
_DECIDING_PACKAGES = ("ckpt_compat", "partitioners", "passes")

@dataclasses.dataclass(frozen=True)
class Partition:
    """What one partition produced: the two graphs, the Plan, and the facts
    the Plan was decided from."""

    forward: fx.GraphModule
    backward: fx.GraphModule
    plan: Plan
    facts: GraphFacts


def partition(
    joint_gm: fx.GraphModule,
    *,
    num_fwd_outputs: int,
    static_lifetime_input_indices: list[int] | None = None,
    config: Config = Config(),
    step: StepContext | None = None,
    sizes: dict[str, int] | None = None,
    optimal_settings: Mapping | None = None,
) -> Partition:
    """Plan, then build the forward and backward modules from the plan;
    ``step``: the training step the graph runs in (partitioners/step.py);
    ``sizes``: dynamic sizes to plan at (``{"s0": 512}``; else the example's);
    ``optimal_settings``: the Inductor settings the runtime-optimal rung
    compiles with, where they differ from this plan's."""
    with compat.planning_at(sizes):
        facts, solution = _decide(
            joint_gm, num_fwd_outputs, static_lifetime_input_indices, config, step, optimal_settings
        )
    order = {node: i for i, node in enumerate(joint_gm.graph.nodes)}
    saved = sorted(solution.saved, key=order.__getitem__)
    # AOTAutograd passes tensors, SymInts and opaque handles to backward
    # through separate slots.
    values, sym, opaque = [], [], []
    for node in saved:
        slot = sym if compat.is_sym_node(node) else opaque if compat.is_opaque_node(node) else values
        slot.append(node)
    fwd, bwd = compat.extract_forward_backward(
        joint_gm,
        values,
        sym,
        opaque,
        num_fwd_outputs=num_fwd_outputs,
        static_lifetime_input_nodes=facts.static_inputs,
    )
    fwd = run_passes(partitioned_passes.FORWARD, fwd)
    bwd = run_passes(partitioned_passes.BACKWARD, bwd)
    return Partition(fwd, bwd, _plan(facts, saved, solution, config, step), facts)


def _decide(joint_gm, num_fwd_outputs, static_lifetime_input_indices, config: Config, step=None,
            optimal_settings=None):
    run_passes(joint_passes.BEFORE_DECIDING, joint_gm)  # in place: joint_gm is the cleaned graph
    solve = functools.partial(
        _solve, joint_gm, num_fwd_outputs, static_lifetime_input_indices, config, step, optimal_settings
    )
    if config.memory_budget is None:
        return solve()
    return _unfolded_where_lower(joint_gm, solve, _shared_copies_where_lower(joint_gm, solve))


def _shared_copies_where_lower(joint_gm, solve):
    """Under a budget, leaves the joint graph with one copy per view that
    matmuls read and Inductor would copy (passes/joint.py
    ``share_matmul_copies``) where the peak model predicts the plan lower
    with them (``_predicted_lower``); else as it was. Returns what
    ``_solve_quietly(solve)`` gave for the graph it leaves."""
    plain = _solve_quietly(solve)
    (facts, plan), _ = plain
    kept = {peak.owner(n, facts) for n in (*facts.forward_outputs, *facts.backward_outputs)}
    copied = peak.copied_views(facts, list(facts.nodes), kept)
    if not copied or not joint_passes.shared_copies(joint_passes.share_matmul_copies(joint_gm, copied)):
        return plain
    shared = _solve_quietly(solve)
    (_, shared_plan), _ = shared
    if _predicted_lower(shared_plan, plan):
        return shared
    joint_passes.unshare_matmul_copies(joint_gm)
    return plain


def _solve(joint_gm, num_fwd_outputs, static_lifetime_input_indices, config: Config, step=None,
           optimal_settings=None):
    facts = classify(
        joint_gm,
        num_fwd_outputs=num_fwd_outputs,
        static_lifetime_input_indices=static_lifetime_input_indices,
    )
    profile = profile_for(joint_gm.graph, config.device_profile)
    # The backend resolved peak:auto from the example inputs already; a
    # partitioner used on its own resolves it here, from the graph.
    budget = resolved_budget(config.memory_budget, graph_device(joint_gm.graph.nodes))
    if step is UNKNOWN_STEP:
        if budget is not None and budget.is_peak and not budget.regional:
            return facts, solve_before_the_step(facts, budget, profile, optimal_settings)
        step = None
    if budget is not None and budget.regional:
        regions = label_regions(facts, budget, config.module_prefix)
        return facts, solve_regions(facts, budget, regions, profile, step, optimal_settings)
    return facts, solve_with_budget(facts, budget, profile, step, optimal_settings)


def _unfolded_where_lower(joint_gm, solve, solved):
    """Under a budget, the plan for the graph with late matmul adds unfolded
    (passes/joint.py) where it fits where the folded one does not, or the
    peak model predicts it lower; otherwise the graph Inductor folds, whose
    sums round as torch.compile's do (T5's tied embedding: no lower, and
    unfolded its losses were 1.5e-6 off torch.compile's). ``solved``:
    ``_solve_quietly(solve)`` of the graph as given."""
    folded, said = solved
    if not joint_passes.unfolded_adds(joint_passes.unfold_late_matmul_adds(joint_gm)):
        return _repeat(said, folded)
    unfolded, said_unfolded = _solve_quietly(solve)
    (_, plan), (_, unfolded_plan) = folded, unfolded
    if _predicted_lower(unfolded_plan, plan):
        return _repeat(said_unfolded, unfolded)
    joint_passes.refold_matmul_adds(joint_gm)
    return _repeat(said, folded)


# Below this predicted gain a sum keeps addmm's rounding (torch.compile's),
# and a graph keeps Inductor's copies.
UNFOLDING_GAIN = 0.01


def _predicted_lower(candidate, plan) -> bool:
    """Whether ``candidate`` fits where ``plan`` does not, or is predicted
    at least ``UNFOLDING_GAIN`` lower."""
    return (candidate.fits, plan.fits) == (True, False) or (
        candidate.fits == plan.fits
        and candidate.estimated_peak_bytes < plan.estimated_peak_bytes * (1 - UNFOLDING_GAIN)
    )


def _solve_quietly(solve):
    """``solve()`` and the warnings it gave, held back until a plan is chosen."""
    with warnings.catch_warnings(record=True) as said:
        result = solve()
    return result, said


def _repeat(said, result):
    for warning in said:
        warnings.warn(warning.message, warning.category, stacklevel=4)
    return result


def _plan(facts, saved, solution, config: Config, step: StepContext | None) -> Plan:
    if config.memory_budget is None:
        return build_plan(facts, saved, solution)
    return build_plan(
        facts, saved, solution, budget=str(config.memory_budget),
        step=None if step is None or step is UNKNOWN_STEP else step.describe(),
    )


@dataclasses.dataclass(frozen=True)
class PyTorchDecisions:
    """What PyTorch's partitioner decided on the same joint graph."""

    saved: frozenset[str]
    """Node names PyTorch's partitioner saves for backward."""
    in_backward: frozenset[str]
    """Node names its backward graph computes."""


def pytorch_decisions(fwd: fx.GraphModule, bwd: fx.GraphModule, *, num_fwd_outputs: int) -> PyTorchDecisions:
    """Read PyTorch's choices off the graphs its partitioner produced (nodes
    keep their joint-graph names)."""
    (output,) = fwd.graph.find_nodes(op="output")
    saved = {n.name for n in output.args[0][num_fwd_outputs:] if isinstance(n, fx.Node)}
    in_backward = {n.name for n in bwd.graph.nodes if n.op == "call_function"}
    return PyTorchDecisions(frozenset(saved), frozenset(in_backward))


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What CkptPartitioner decided for one joint graph (handed to ``on_outcome``)."""

    plan: Plan
    """The Plan Inductor compiles; ``plan.fallback`` says why when PyTorch's
    partitioner was used instead."""
    partition: Partition | None
    """ckpt's graphs, Plan and facts; None when it fell back."""
    pytorch: PyTorchDecisions | None = None
    """PyTorch's decisions on the same graph, when asked for
    (``compare_with_pytorch``) and ckpt did not fall back."""
    pytorch_error: str | None = None
    """Why PyTorch's decisions could not be read, when they were asked for."""
    device_profile: str | None = None
    """The cost model's device profile the plan was priced with (None: the graph's device)."""


class CkptPartitioner(compat.CustomPartitionerFn):
    """The partitioner Inductor calls (``custom_partitioner_fn``).

    Never costs a user their run: if planning fails, it warns once with the
    reason and uses PyTorch's partitioner (unless ``config.strict``). It hands
    what it decided for each graph to ``on_outcome``; with
    ``compare_with_pytorch``, that includes PyTorch's decisions on the same
    graph (what a report compares with).
    """

    def __init__(
        self,
        config: Config,
        on_outcome: Callable[[Outcome], None] | None = None,
        *,
        compare_with_pytorch: bool = False,
        step: StepContext | None = None,
        step_planning: bool = False,
        sizes: dict[str, int] | None = None,
        optimal_settings: Mapping | None = None,
    ):
        self.config = config
        self.optimal_settings = optimal_settings
        self.on_outcome = on_outcome
        self.compare_with_pytorch = compare_with_pytorch
        self.step = step
        self.step_planning = step_planning
        self.sizes = sizes

    def __call__(self, joint_gm: fx.GraphModule, joint_inputs, **kwargs):
        result = None
        try:
            result = partition(
                joint_gm,
                num_fwd_outputs=kwargs["num_fwd_outputs"],
                static_lifetime_input_indices=kwargs.get("static_lifetime_input_indices"),
                config=self.config,
                step=self.step,
                sizes=self.sizes,
                optimal_settings=self.optimal_settings,
            )
            fwd, bwd, plan = result.forward, result.backward, result.plan
        except ConfigError:
            raise  # a setting that cannot work here: the user must change it
        except Exception as error:
            if self.config.strict:
                raise
            reason = f"{type(error).__name__}: {error}"
            warn_once(
                f"ckpt could not partition this graph ({reason}); "
                "using PyTorch's partitioner for it instead. "
                "Set CKPT_STRICT=1 to raise instead."
            )
            plan = Plan(fallback=reason)
            # Ranks that disagree must stop, not hang: compare before
            # PyTorch's partitioner rewrites the graph.
            check_same_plan_on_all_ranks(joint_gm.graph, plan)
            fwd, bwd = compat.torch_default_partition(joint_gm, joint_inputs, **kwargs)
        else:
            fingerprint = check_same_plan_on_all_ranks(joint_gm.graph, plan)
            plan = dataclasses.replace(plan, fingerprint=fingerprint)
            result = dataclasses.replace(result, plan=plan)
        outcome = Outcome(plan, result, device_profile=self.config.device_profile)
        if self.compare_with_pytorch and result is not None:
            outcome = _with_pytorch_decisions(outcome, joint_gm, joint_inputs, kwargs)
        if self.on_outcome is not None:
            self.on_outcome(outcome)
        return fwd, bwd

    def uuid(self) -> str | None:
        # A graph served from Inductor's cache is never partitioned, so it
        # could not be compared with PyTorch's, and the step view would not
        # learn its plan: when asked for either, skip the cache.
        if self.compare_with_pytorch or self.step_planning:
            return None
        return _uuid(self.config)


def _with_pytorch_decisions(outcome: Outcome, joint_gm, joint_inputs, kwargs) -> Outcome:
    """``outcome`` with PyTorch's decisions on the same joint graph; a failure
    to get them is recorded, not raised (they only inform)."""
    try:
        # ckpt's graphs are built, and PyTorch's partitioner may rewrite the
        # joint graph: it is only read from here on.
        fwd, bwd = compat.torch_default_partition(joint_gm, joint_inputs, **kwargs)
        pytorch = pytorch_decisions(fwd, bwd, num_fwd_outputs=kwargs["num_fwd_outputs"])
    except Exception as error:
        return dataclasses.replace(outcome, pytorch_error=f"{type(error).__name__}: {error}")
    return dataclasses.replace(outcome, pytorch=pytorch)


@functools.lru_cache(maxsize=None)
def _uuid(config: Config) -> str:
    files = sorted(
        str(path)
        for package in _DECIDING_PACKAGES
        for path in (_PROJECT_ROOT / package).rglob("*.py")
    )
    return compat.get_hash_for_files(tuple(files), extra=repr(config)).hex()


