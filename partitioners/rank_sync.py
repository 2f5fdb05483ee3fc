"""Every rank must decide the same plan: compare plans across ranks at compile time.

A rank that recomputed a collective, or saved something the others
recompute, would hang or corrupt the job. ckpt's decisions are a pure
function of the graph and the config, but a rank with other settings or
other code would still differ. So, when a process group exists and the
graph holds collectives, each rank publishes its decisions in the process
group's key-value store and compares them with every other rank's. A
difference is a clear error, on every rank, naming the first differing value. The wait is bounded: a rank
that never compiles this graph costs a warning, not a hang.
"""
from __future__ import annotations

import collections
import datetime
import hashlib
import json
import warnings

import torch.fx as fx

import ckpt_compat as compat
from .canonical import canonical_names, structure_digest
from .ops import COLLECTIVE_NAMESPACES
from .plan import Plan

# How long a rank waits for the other ranks' plans of the same graph. Ranks
# compile the same graph at about the same time; 10 minutes covers a slow
# compile of a large graph on a busy machine.
WAIT_FOR_OTHERS = datetime.timedelta(minutes=10)

# Times each graph was compiled in this process, so recompiling a graph
# (e.g. after torch._dynamo.reset()) uses fresh store keys.
_compiles: collections.Counter[str] = collections.Counter()


class PlanMismatchError(RuntimeError):
    """Ranks decided different plans for the same graph."""


FELL_BACK = "<fell back to PyTorch's partitioner>"


def check_same_plan_on_all_ranks(graph: fx.Graph, plan: Plan) -> str | None:
    """Compare this rank's plan of the joint ``graph`` with every other
    rank's; returns the plan's fingerprint (None when there is no process
    group or the graph has no collective).

    A fallback plan takes part too: if every rank fell back alike, all use
    PyTorch's partitioner; if only some did, all stop with the error.
    """
    store = compat.default_store()
    nodes = [n for n in graph.nodes if n.op != "output"]
    if store is None or not any(_is_collective(n) for n in nodes):
        return None
    import torch.distributed as dist

    names = canonical_names(graph)
    by_name = {node.name: node for node in nodes}
    digest = structure_digest(nodes, names)
    if plan.fallback is not None:
        decisions = [[FELL_BACK, plan.fallback]]
    else:
        decisions = [[names[by_name[d.name]], d.decision] for d in plan.decisions]
    _compiles[digest] += 1
    prefix = f"ckpt/plan/{digest}/{_compiles[digest]}"
    rank, world = dist.get_rank(), dist.get_world_size()
    store.set(f"{prefix}/{rank}", json.dumps(decisions))
    others = [r for r in range(world) if r != rank]
    try:
        store.wait([f"{prefix}/{r}" for r in others], WAIT_FOR_OTHERS)
    except Exception:  # the store raises its own timeout types
        warnings.warn(
            f"ckpt: not every rank published its plan for graph {digest} within "
            f"{WAIT_FOR_OTHERS}; this rank's plan was not compared with theirs",
            stacklevel=2,
        )
        return _fingerprint(decisions)
    plans = {other: json.loads(store.get(f"{prefix}/{other}")) for other in others}
    _delete_when_all_read(store, prefix, world)
    for other, theirs in plans.items():
        if theirs != decisions:
            raise PlanMismatchError(_describe_mismatch(digest, rank, other, decisions, theirs))
    return _fingerprint(decisions)


def _delete_when_all_read(store, prefix: str, world: int) -> None:
    """The last rank to read the plans of ``prefix`` deletes them: a long job
    compiles many graphs, and the store is the job's."""
    if store.add(f"{prefix}/read", 1) == world:
        for key in [f"{prefix}/{r}" for r in range(world)] + [f"{prefix}/read"]:
            try:
                store.delete_key(key)
            except Exception:  # a store without deletion keeps its keys
                return


def _is_collective(node: fx.Node) -> bool:
    namespace = getattr(node.target, "namespace", None)
    return node.op == "call_function" and namespace in COLLECTIVE_NAMESPACES


def _fingerprint(decisions: list) -> str:
    return hashlib.sha256(json.dumps(decisions).encode()).hexdigest()[:16]


def _describe_mismatch(graph: str, rank: int, other: int, mine: list, theirs: list) -> str:
    mine_by_name, theirs_by_name = dict(map(tuple, mine)), dict(map(tuple, theirs))
    for fell_back, reason, kept in ((rank, mine_by_name, other), (other, theirs_by_name, rank)):
        if FELL_BACK in reason:
            return (
                f"ckpt fell back to PyTorch's partitioner on rank {fell_back} but not on rank "
                f"{kept} for graph {graph} ({reason[FELL_BACK]}); the ranks would partition "
                "differently. Fix the failure, or set CKPT_STRICT=1 to see it."
            )
    names = [n for n, _ in mine] + [n for n, _ in theirs if n not in mine_by_name]
    first = next(n for n in names if mine_by_name.get(n) != theirs_by_name.get(n))
    return (
        f"ckpt decided differently on rank {rank} than on rank {other} for graph {graph}: "
        f"first difference at {first}: rank {rank} {mine_by_name.get(first, 'not kept')}, "
        f"rank {other} {theirs_by_name.get(first, 'not kept')}. Every rank must run the "
        "same ckpt version and settings (CKPT_* variables) on the same model."
    )


class MeasurementAgreement:
    """Measured step peaks agreed across ranks, so every rank plans from the
    same numbers: one ``all_gather_object`` per step on a gloo group of
    ckpt's own (never the default group, where it would interleave with
    DDP's or FSDP's collectives), while any rank still learns its steps.

    Every rank takes part in every agreement, with its measurement or with
    None (it did not measure: a profiler of the user's was on, the step ran
    below its planned sizes, a graph had just compiled). The agreed value is
    the largest measurement when every rank measured the same step (by
    name), else None on every rank: a step not measured alike corrects
    nothing, and no rank waits for a measurement that will not come. The
    agreements go on while any rank says it has ``more`` to learn; after
    that none is held, and a step learnt later is planned by the model.
    """

    def __init__(self):
        self._open = True
        self._group = None
        self._world_group = None

    @property
    def active(self) -> bool:
        """Ranks still agree at each step (never without a process group)."""
        return self._open and world_size() > 1

    @property
    def closed(self) -> bool:
        """Ranks agree no more: a step learnt now is not measured."""
        return not self._open and world_size() > 1

    def agree(self, name: str, value: int | None, more: bool) -> int | None:
        if world_size() <= 1:
            return value
        if not self._open:
            return None
        import torch.distributed as dist

        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (name, value, bool(more)), group=self._gloo_group())
        self._open = any(wants for _, _, wants in gathered)
        if any(other != name or measured is None for other, measured, _ in gathered):
            return None
        return max(measured for _, measured, _ in gathered)

    def _gloo_group(self):
        """ckpt's own group of every rank, made on first use (every rank
        reaches its first agreement at its first step) and again if the
        user made a new default group."""
        import torch.distributed as dist

        world = dist.group.WORLD
        if self._group is None or self._world_group is not world:
            self._group = dist.new_group(backend="gloo", timeout=WAIT_FOR_OTHERS)
            self._world_group = world
        return self._group


def world_size() -> int:
    """Ranks in the default process group (1 without one)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
