"""ckpt under torch.distributed: 2 processes, gloo on CPU, real process groups."""
import json
import re
import socket

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

import distributed_workers as workers

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not built")
WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(worker, tmp_path, name):
    mp.spawn(worker, args=(WORLD, _free_port(), str(tmp_path)), nprocs=WORLD)
    return [json.loads((tmp_path / f"{name}-{rank}.json").read_text()) for rank in range(WORLD)]


def test_tensor_parallel_matches_single_process_eager(tmp_path):
    ranks = _run(workers.tensor_parallel, tmp_path, "tp")
    for case in ("mlp", "attention", "mlp-budget"):
        for result in ranks:
            r = result[case]
            assert r["fallbacks"] == [None] * len(r["fallbacks"])
            assert r["loss_diff"] < 1e-5 and r["grad_diff"] < 1e-5, (case, r)
            # Collectives are saved, never recomputed.
            assert all(decision == "saved" for decision, _ in r["collectives"]), r["collectives"]
        # Ranks compared their plans: the same fingerprint on both.
        fingerprints = [result[case]["fingerprints"] for result in ranks]
        assert fingerprints[0] == fingerprints[1] and all(fingerprints[0])
    assert ranks[0]["mlp"]["collectives"], "the MLP's all-reduced value feeds backward"
    # Under the tightest budget every rank recomputes its matmul shards, the
    # same on both (fingerprints above), and no collective (checked above:
    # backward may still read the all-reduced value, or a value saved after it).
    assert ranks[0]["mlp"]["recomputed_matmuls"] == 0
    assert ranks[0]["mlp-budget"]["recomputed_matmuls"] > 0
    assert all(reason == "saved: collective, must not be replayed" for _, reason in ranks[0]["mlp"]["collectives"])


def test_fsdp2_training_matches_single_process_eager(tmp_path):
    for result in _run(workers.fsdp, tmp_path, "fsdp"):
        assert result["fallbacks"] == [None] * result["plans"] and result["plans"] >= 1
        compiled, eager = result["losses"][0::2], result["losses"][1::2]
        assert max(abs(a - b) for a, b in zip(compiled, eager)) < 1e-5
        assert result["param_diff"] < 1e-5


def test_fsdp2_with_each_block_compiled_on_its_own_matches_eager(tmp_path):
    for result in _run(workers.fsdp_per_block, tmp_path, "fsdp_per_block"):
        # The blocks' graphs were partitioned by ckpt, none fell back.
        assert result["fallbacks"] == [None] * result["plans"] and result["plans"] >= 1
        compiled, eager = result["losses"][0::2], result["losses"][1::2]
        assert len(compiled) == 2 and max(abs(a - b) for a, b in zip(compiled, eager)) < 1e-5
        assert result["param_diff"] < 1e-5


def test_ranks_that_decide_differently_stop_with_a_clear_error(tmp_path):
    for rank, result in enumerate(_run(workers.mismatch, tmp_path, "mismatch")):
        other = 1 - rank
        assert re.search(
            rf"PlanMismatchError: ckpt decided differently on rank {rank} than on rank {other} "
            rf"for graph \w+: first difference at \S+: rank {rank} (saved|recomputed|not kept), "
            rf"rank {other} (saved|recomputed|not kept)\. Every rank must run the same ckpt",
            result["error"],
        ), result["error"]


def test_a_lone_fallback_stops_every_rank(tmp_path):
    for result in _run(workers.lone_fallback, tmp_path, "lone_fallback"):
        assert result["error"] is not None
        assert re.search(
            r"PlanMismatchError: ckpt fell back to PyTorch's partitioner on rank 1 but not on rank 0 "
            r"for graph \w+ \(RuntimeError: injected failure\)",
            result["error"],
        ), result["error"]



def test_a_budget_holds_per_rank_under_ddp_and_fsdp2_per_block(tmp_path):
    """bench.distributed_budget at a small size: a Qwen2 decoder at 0.0,
    DDP split into buckets and FSDP2 per block, each rank's step peak (the
    smallest of 9 settled steps: under gloo a step's peak moves by 0-2
    buffers that gloo's thread frees early or late, so both modes are
    compared at their plan's own peak) within 1.05x its eager per-layer
    checkpointing's, the ranks' plans alike."""
    from bench.distributed_budget import Settings, run

    # Each rank measures the step after its view settled.
    ranks = run(Settings(layers=3, seq=128, measured_steps=9, steps=24), tmp_path)
    assert ranks[0]["ddp"]["ckpt+budget=0.0"]["graphs"] >= 2, "DDP's optimizer did not split the graph"
    for layout in ("ddp", "fsdp2-per-block"):
        digests = [result[layout]["ckpt+budget=0.0"]["plan_digests"] for result in ranks]
        assert digests[0] == digests[1] and digests[0], layout
        for result in ranks:
            eager, ckpt = result[layout]["eager+checkpoint"], result[layout]["ckpt+budget=0.0"]
            assert ckpt["fallbacks"] == [None] * len(ckpt["fallbacks"])
            assert ckpt["settled"], (layout, ckpt["step_view"])
            assert ckpt["peak_bytes"] <= 1.05 * eager["peak_bytes"], (layout, ckpt["peak_bytes"], eager["peak_bytes"])
            # FSDP2's gathered parameters are in the step's predictions; DDP has none.
            gathered = "parameters a sharding gathers in the step" in ckpt["step_view"]
            assert gathered == (layout == "fsdp2-per-block"), ckpt["step_view"]


def test_a_rank_under_its_own_profiler_holds_no_rank_back(tmp_path):
    """Rank 0 profiles its first four steps (and so measures none of them);
    rank 1 measures. Every rank takes part in each step's agreement, so
    neither waits (the store-based agreement waited up to 10 minutes for the
    missing measurement); the steps measured on both ranks plan both, alike."""
    ranks = _run(workers.profiled_rank, tmp_path, "profiled_rank")
    for result in ranks:
        assert result["settled"] and not result["profiler_on"], ranks
        assert result["seconds"] < 120, result["seconds"]
    assert ranks[0]["judged"] == ranks[1]["judged"] and ranks[0]["judged"], ranks
    # Only steps after the profiler ended were used to plan.
    assert all(step > 4 for step, _ in ranks[0]["judged"]), ranks[0]["judged"]
    assert ranks[0]["saved"] == ranks[1]["saved"]
