"""CkptPartitioner: joint graph -> Plan -> (forward, backward) GraphModules."""
from __future__ import annotations

import dataclasses
import functools
import pathlib
import warnings
from collections.abc import Callable

import torch.fx as fx

from . import _torch_compat as compat
from passes.report import build_report, pytorch_decisions, write_report

from .classify import GraphFacts, classify
from .config import Config, ConfigError
from .budget import resolve_peak_target, solve_with_budget
from .cost import profile_for
from .plan import Plan, build_plan
from .rank_sync import check_same_plan_on_all_ranks

_PROJECT_ROOT = pathlib.Path(__file__).resolve().parent.parent
# Source that decides what a compile produces; part of the cache key.
_DECIDING_PACKAGES = ("partitioners", "passes")

_warned: set[str] = set()


@dataclasses.dataclass(frozen=True)
class Partition:
    """What one partition produced: the two graphs, the Plan, and the facts
    the Plan was decided from."""

    forward: fx.GraphModule
    backward: fx.GraphModule
    plan: Plan
    facts: GraphFacts


def plan_partition(
    joint_gm: fx.GraphModule,
    *,
    num_fwd_outputs: int,
    static_lifetime_input_indices: list[int] | None = None,
    config: Config = Config(),
) -> Plan:
    """Decide what to save; the joint graph is cleaned (DCE, CSE) in place."""
    facts, solution = _decide(joint_gm, num_fwd_outputs, static_lifetime_input_indices, config)
    return _plan(facts, list(solution.saved), solution, config)


def partition(
    joint_gm: fx.GraphModule,
    *,
    num_fwd_outputs: int,
    static_lifetime_input_indices: list[int] | None = None,
    config: Config = Config(),
) -> Partition:
    """Plan, then build the forward and backward modules from the plan."""
    facts, solution = _decide(joint_gm, num_fwd_outputs, static_lifetime_input_indices, config)
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
    return Partition(fwd, bwd, _plan(facts, saved, solution, config), facts)


def _decide(joint_gm, num_fwd_outputs, static_lifetime_input_indices, config: Config):
    joint_gm.graph.eliminate_dead_code()
    compat.cse(joint_gm)
    facts = classify(
        joint_gm,
        num_fwd_outputs=num_fwd_outputs,
        static_lifetime_input_indices=static_lifetime_input_indices,
    )
    profile = profile_for(joint_gm.graph, config.device_profile)
    peak_target = resolve_peak_target(config.memory_budget, joint_gm.graph)
    return facts, solve_with_budget(facts, config.memory_budget, profile, peak_target)


def _plan(facts, saved, solution, config: Config) -> Plan:
    plan = build_plan(facts, saved, solution)
    if config.memory_budget is None:
        return plan
    return dataclasses.replace(plan, budget=str(config.memory_budget))


class CkptPartitioner(compat.CustomPartitionerFn):
    """The partitioner Inductor calls (``custom_partitioner_fn``).

    Never costs a user their run: if planning fails, it warns once with the
    reason and uses PyTorch's partitioner (unless ``config.strict``). With
    ``config.report_dir`` set, it also writes a report per graph (and hands
    it to ``on_report``).
    """

    def __init__(
        self,
        config: Config,
        on_plan: Callable[[Plan], None] | None = None,
        on_report: Callable[[dict], None] | None = None,
    ):
        self.config = config
        self.on_plan = on_plan
        self.on_report = on_report

    def __call__(self, joint_gm: fx.GraphModule, joint_inputs, **kwargs):
        result = None
        try:
            result = partition(
                joint_gm,
                num_fwd_outputs=kwargs["num_fwd_outputs"],
                static_lifetime_input_indices=kwargs.get("static_lifetime_input_indices"),
                config=self.config,
            )
            fwd, bwd, plan = result.forward, result.backward, result.plan
        except ConfigError:
            raise  # a setting that cannot work here: the user must change it
        except Exception as error:
            if self.config.strict:
                raise
            reason = f"{type(error).__name__}: {error}"
            _warn_once(
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
        if self.config.report_dir is not None:
            self._report(result, plan, joint_gm, joint_inputs, kwargs)
        if self.on_plan is not None:
            self.on_plan(plan)
        return fwd, bwd

    def _report(self, result, plan, joint_gm, joint_inputs, kwargs) -> None:
        """Write this graph's report; a failure here only warns."""
        try:
            pytorch = None
            if result is not None:
                # After ckpt's graphs are built, PyTorch's partitioner may
                # rewrite the joint graph: it is only read from here on.
                pytorch = pytorch_decisions(
                    *compat.torch_default_partition(joint_gm, joint_inputs, **kwargs),
                    num_fwd_outputs=kwargs["num_fwd_outputs"],
                )
            report = build_report(result, plan, pytorch)
            write_report(report, self.config.report_dir)
            if self.on_report is not None:
                self.on_report(report)
        except Exception as error:
            _warn_once(f"ckpt could not write its report ({type(error).__name__}: {error})")

    def uuid(self) -> str | None:
        # A graph served from Inductor's cache is never partitioned, so it
        # would get no report: with reports on, skip the cache.
        if self.config.report_dir is not None:
            return None
        return _uuid(self.config)


@functools.lru_cache(maxsize=None)
def _uuid(config: Config) -> str:
    files = sorted(
        str(path)
        for package in _DECIDING_PACKAGES
        for path in (_PROJECT_ROOT / package).rglob("*.py")
    )
    return compat.get_hash_for_files(tuple(files), extra=repr(config)).hex()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=3)
