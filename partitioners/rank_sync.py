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
    for other in others:
        theirs = json.loads(store.get(f"{prefix}/{other}"))
        if theirs != decisions:
            raise PlanMismatchError(_describe_mismatch(digest, rank, other, decisions, theirs))
    return _fingerprint(decisions)


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


# Measured step peaks are compared by the step's name and number; counted
# per name, like _compiles, so a repeated name gets fresh keys.
_measurements: collections.Counter[str] = collections.Counter()


def largest_on_all_ranks(name: str, value: int) -> int:
    """The largest ``value`` any rank of the process group reports under
    ``name`` (``value`` itself without a process group): a measurement every
    rank then decides from alike. Waits at most WAIT_FOR_OTHERS."""
    store = compat.default_store()
    if store is None:
        return value
    import torch.distributed as dist

    _measurements[name] += 1
    prefix = f"ckpt/measured/{name}/{_measurements[name]}"
    rank, world = dist.get_rank(), dist.get_world_size()
    store.set(f"{prefix}/{rank}", str(int(value)))
    keys = [f"{prefix}/{r}" for r in range(world)]
    try:
        store.wait(keys, WAIT_FOR_OTHERS)
    except Exception:  # the store raises its own timeout types
        warnings.warn(
            f"ckpt: not every rank reported its measured step {name} within {WAIT_FOR_OTHERS}; "
            "this rank plans from its own measurement",
            stacklevel=2,
        )
        return value
    return max(int(store.get(key)) for key in keys)
