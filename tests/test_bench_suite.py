"""A smoke run of ``python -m bench --quick`` on the tiny MLP: the files it
writes, their keys, and numbers that make sense."""
import json
import os

from bench.suite import run


def test_quick_suite_on_the_mlp_writes_json_markdown_and_plots(tmp_path):
    out = str(tmp_path)
    # No batch search (each probe is a compile; tests/test_bench.py covers
    # it) and two timed steps: the run stays well under 30 seconds.
    run(["--quick", "--models", "mlp", "--modes", "eager", "compile", "ckpt",
         "--repeats", "2", "--probes", "0", "--out", out])

    with open(os.path.join(out, "results.json")) as f:
        data = json.load(f)
    assert {"platform", "cpu_count", "torch", "threads", "device", "date"} <= set(data["machine"])
    assert data["settings"]["modes"] == ["eager", "compile", "ckpt"]
    (model,) = data["models"]
    assert model["name"] == "mlp" and model["unit"] == "samples"
    modes = {m["mode"]: m for m in model["modes"]}
    assert list(modes) == ["eager", "compile", "ckpt"]
    for m in modes.values():
        assert m["error"] is None, m["error"]
        assert m["peak_bytes"] > 0 and m["saved_bytes"] > 0
        assert m["step_s"] > 0 and len(m["step_times_s"]) == 2 and m["throughput"] > 0
        assert m["compile_s"] > 0
        assert m["max_grad_diff"] < 1e-4
        # The ledger's step is one more step of the same kind: the same peak and saved bytes.
        ledger = m["ledger"]
        assert (ledger["peak_bytes"], ledger["saved_activations_bytes"]) == (m["peak_bytes"], m["saved_bytes"])
        assert ledger["optimizer_state_bytes"] is None and ledger["peak_phase"] == "backward"
    assert modes["eager"]["max_grad_diff"] == 0.0  # eager is the reference
    assert modes["ckpt"]["saved_bytes"] <= modes["compile"]["saved_bytes"]
    assert modes["ckpt"]["plan_saved_bytes"] is not None and modes["ckpt"]["fallback"] is None
    assert modes["compile"]["partitioner_s"] > 0 and modes["ckpt"]["partitioner_s"] > 0
    assert modes["eager"]["partitioner_s"] is None
    assert model["cap_bytes"] is None and modes["ckpt"]["cap_batch"] is None  # --probes 0: no search
    assert data["sweep"] == []

    markdown = open(os.path.join(out, "results.md")).read()
    assert "### mlp:" in markdown and "| ckpt |" in markdown
    assert "| ckpt | 0.03 | - | 0.03 |" in markdown  # the ledger: parameters, no optimizer, gradients
    assert data["plots"] == ["mlp_memory_vs_time.png", "mlp_memory_ledger.png"]
    for plot in data["plots"]:
        with open(os.path.join(out, plot), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_pytorch_budget_mode_keeps_its_plan_after_another_mode_compiles():
    """Dynamo hands a recompiled frame the cached graph of any backend that
    compares equal: PyTorch's budget must travel with the backend, or once the
    next mode's prepare resets Dynamo, the budget mode runs compile's graph
    (the bench used to time PyTorch's budget points so)."""
    import torch

    from bench.cases import builtin_case
    from bench.harness import prepare
    from bench.measure import count_saved_bytes
    from bench.modes import parse_mode

    case = builtin_case("mlp", "quick")
    torch.manual_seed(0)
    base = case.build()
    under_budget = prepare(case, base, parse_mode("compile+budget=0.0"), case.batch, "cpu")
    plain = prepare(case, base, parse_mode("compile"), case.batch, "cpu")  # resets Dynamo

    def saved_bytes(prep) -> int:
        with count_saved_bytes([*prep.model.parameters(), *prep.args]) as saved:
            loss = prep.loss()
        loss.backward()
        return saved["bytes"]

    plain_bytes = saved_bytes(plain)
    assert saved_bytes(under_budget) < plain_bytes
