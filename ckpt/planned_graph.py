"""What the backend hands Dynamo for one graph under a budget: Inductor's
compiled callable for the plan the step view asks for, one per size bucket
of a dynamic graph, recompiled when the view learns more of the step.

Re-planning is a recompile inside this callable, before the call that needs
it runs, in the tracing context of the graph's Dynamo compile, as Dynamo
itself recompiles a graph for a specialization at run time. A plan per size
bucket (the next power of two of each dynamic size, or a declared
``mark_dynamic(max=...)`` bound) is picked by the sizes of the call, so a
longer batch gets a plan made for it before it runs.
"""
from __future__ import annotations

import hashlib

import torch
import torch.fx as fx

import ckpt_compat as compat
from partitioners.config import MemoryBudget
from partitioners.plan import Plan


class PlannedGraph:
    """One graph's compiled plans, called by Dynamo; ``view`` is the
    backend's StepView, which records the call and says what to plan for."""

    def __init__(self, gm: fx.GraphModule, compile_plan, budget: MemoryBudget | None, measure: bool,
                 view, device: torch.device | None):
        """``compile_plan(gm, example_inputs, step, sizes, budget=, replaces=plan)``
        compiles the graph for ``budget`` and returns (callable, Plan or None)."""
        # Compiled again as it is, as Dynamo compiles a graph again for a
        # specialization (a copy made with fx.GraphModule does not pickle
        # into Inductor's cache keys).
        self._graph = gm
        self._compile_plan = compile_plan
        self._tracing_context = compat.current_tracing_context()
        self._budget = budget
        self._measure = measure
        self._view = view
        self._device = device or torch.device("cpu")
        self._symbols = compat.size_symbols(gm)
        self.key = graph_key(gm, budget)
        self._compiled: dict[tuple, object] = {}
        self._plans: dict[tuple, Plan | None] = {}
        self._planned_for: dict[tuple, tuple] = {}
        """Per size bucket, what its plan was made for (StepView.planning_for)."""
        self._keys: dict[tuple, str] = {}

    def compile_first(self, example_inputs):
        """Compile for the sizes of Dynamo's example (inside its compile)."""
        self._first_bucket = self._bucket_of_hints()
        self._compile(self._first_bucket, example_inputs)
        return self

    def __call__(self, *args):
        # Dynamo calls a compiled graph with the arguments unpacked.
        if self._view.settled_keys:
            # Settled: a call of a settled bucket records and measures
            # nothing. (Any compile empties settled_keys, so a compile-time
            # call on fake tensors never comes this way.)
            bucket = self._bucket_of(args) if self._symbols else ()
            if self._keys.get(bucket) in self._view.settled_keys:
                return self._compiled[bucket](*args)
        if compat.has_fake_tensors(args):
            # A compile-time call on fake tensors (DDP's graph optimizer runs
            # each compiled bucket to get the next one's inputs): not a step.
            return self._compiled[self._first_bucket](*args)
        bucket = self._bucket_of(args) if self._symbols else ()
        if not torch.is_grad_enabled() and bucket in self._compiled:
            return self._compiled[bucket](*args)  # not training: nothing to record
        return self._recorded_call(bucket, args)

    def _recorded_call(self, bucket: tuple, args):
        key = self._plan_key(bucket)
        view = self._view
        view.finish_step()
        if bucket not in self._compiled or self._planned_for[bucket] != view.planning_for(key):
            view.recompiles += 1
            view.stop_measuring()
            compat.recompile_in(
                self._tracing_context,
                lambda: self._compile(bucket, compat.example_inputs_of(self._graph)),
            )
        view.before_call(key, self._device)
        try:
            outputs = self._compiled[bucket](*args)
        except BaseException:
            view.drop_step()
            raise
        at_planned_sizes = not self._symbols or self._sizes_of(args) == bucket
        view.after_call(key, outputs, self._planned_for[bucket], at_planned_sizes=at_planned_sizes, args=args)
        return outputs

    def _compile(self, bucket: tuple, example_inputs) -> None:
        key = self._plan_key(bucket)
        view = self._view
        context, planned_for = view.context_for(key, self._budget)
        sizes = dict(bucket) if bucket else None
        compiled, plan = self._compile_plan(
            self._graph, example_inputs, context, sizes,
            budget=view.budget_for(key, self._budget), replaces=self._plans.get(bucket),
        )
        self._plans[bucket] = plan
        view.record_plan(key, plan, self._measure, rung=planned_for[2])
        self._compiled[bucket], self._planned_for[bucket], self._keys[bucket] = compiled, planned_for, key

    def _plan_key(self, bucket: tuple) -> str:
        if not bucket:
            return self.key
        return self.key + "@" + ",".join(f"{name}={size}" for name, size in bucket)

    def _bucket_of_hints(self) -> tuple:
        return tuple((s.name, _planned_size(s, s.hint)) for s in self._symbols)

    def _bucket_of(self, args) -> tuple:
        return tuple(
            (name, _planned_size(symbol, size)) for (name, size), symbol in zip(self._sizes_of(args), self._symbols)
        )

    def _sizes_of(self, args) -> tuple:
        """The dynamic sizes of this call, by symbol name."""
        sizes = []
        for symbol in self._symbols:
            value = args[symbol.placeholder]
            sizes.append((symbol.name, int(value) if symbol.dim is None else int(value.shape[symbol.dim])))
        return tuple(sizes)


def _planned_size(symbol: compat.SizeSymbol, size: int) -> int:
    """The size a plan for ``size`` is made at: the declared bound, or the
    next power of two (one plan per bucket)."""
    if symbol.upper is not None:
        return symbol.upper
    return 1 << max(size - 1, 0).bit_length()


def graph_key(gm: fx.GraphModule, budget: MemoryBudget | None) -> str:
    """A name for a Dynamo graph that is the same for the same code at the
    same input shapes, in every process and on every rank."""
    text = [gm.code, repr(budget)]
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            value = node.meta.get("example_value", node.meta.get("val"))
            if isinstance(value, torch.Tensor):
                text.append(f"{tuple(value.shape)}:{value.dtype}:{value.requires_grad}")
            else:
                text.append(type(value).__name__)
    return "g" + hashlib.sha256("\n".join(text).encode()).hexdigest()[:10]

