"""Reports, golden files, diffs and pictures."""
import collections
import copy
import dataclasses
import json
import re

import pytest
import torch

import partitioners.ops as ops
import partitioners.config as config_module
from bench.measure import count_saved_bytes
from bench.models import GPT, MLP, ConvNet, GPTConfig, gpt_batch
from ckpt import Config, make_backend
from ckpt.__main__ import main as ckpt_cli
from ckpt.pytest_plugin import compare_with_golden, render_reports, training_loss
import ckpt_compat as compat
from partitioners.partition import CkptPartitioner
from ckpt.reports import graph_svg
from ckpt.reports.report import render_markdown, write_report

GPT_DROPOUT = GPTConfig(depth=2, width=32, heads=2, seq=16, vocab=64, dropout=0.1)


def _gpt():
    torch.manual_seed(0)
    return GPT(GPT_DROPOUT), gpt_batch(GPT_DROPOUT, 2)


def _compile_gpt_with_report(folder):
    """One training step of the small dropout GPT, reporting into ``folder``;
    returns its report and the bytes autograd saved, measured."""
    model, batch = _gpt()
    backend = make_backend(strict=True, report_dir=str(folder))
    torch._dynamo.reset()
    with count_saved_bytes(list(model.parameters()) + list(batch)) as saved:
        loss = torch.compile(model, backend=backend)(*batch)
    loss.backward()
    (report,) = backend.reports
    return report, saved["bytes"]


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory):
    """Compiled once for the tests that read its report."""
    folder = tmp_path_factory.mktemp("gpt_report")
    with torch.compiler.config.patch(force_disable_caches=True):
        report, measured = _compile_gpt_with_report(folder)
    return folder, report, measured


def test_golden_mlp(ckpt_golden):
    ckpt_golden("mlp", MLP(depth=2, width=16), torch.randn(8, 16))


def test_golden_mlp_under_a_byte_budget(ckpt_golden):
    """Half the runtime-optimal bytes: matmuls recomputed, the reasons say why."""
    torch.manual_seed(0)
    text = ckpt_golden(
        "mlp_budget", MLP(depth=3, width=16), torch.randn(32, 16), config=Config(memory_budget="3KiB")
    )
    assert "memory budget: 0.00 MiB (3072 bytes), fits" in text
    assert "recomputed: compute-heavy op, to fit the memory budget" in text
    # The totals price ckpt's heavy recomputation as the budget search did.
    row_us = re.search(r"\| heavy ops recomputed \(cost model\) \| [1-9]\d*, ([\d.]+) us \|", text).group(1)
    assert f"heavy ops recomputed for it: {row_us} us" in text


def test_golden_gpt_with_dropout(gpt_run, request):
    _, report, _ = gpt_run
    golden = request.path.parent / "goldens" / "gpt_dropout.md"
    compare_with_golden(render_markdown(report), golden, request.config.getoption("--ckpt-update-goldens"))


def test_golden_convnet(ckpt_golden):
    ckpt_golden("convnet", ConvNet(channels=4, stages=2), torch.randn(2, 3, 8, 8), torch.randint(10, (2,)))


def test_changed_decision_fails_with_a_diff_naming_the_value(monkeypatch, request):
    # Pretend erf (inside GELU) were compute-heavy: ckpt stops recomputing
    # it and saves GELU's next value instead.
    monkeypatch.setitem(ops.__dict__, "COMPUTE_OPS", ops.COMPUTE_OPS | {torch.ops.aten.erf.default})
    text = render_reports(MLP(depth=2, width=16), torch.randn(8, 16))
    golden = request.path.parent / "goldens" / "mlp.md"
    with pytest.raises(pytest.fail.Exception) as failure:
        compare_with_golden(text, golden, update=False)
    message = str(failure.value)
    assert "ckpt report differs from" in message
    assert "-| blocks.0.2/erf | erf | 8x16 | float32 | 512 | recomputed |" in message
    assert "+| blocks.0.2/add | add | 8x16 | float32 | 512 | saved |" in message
    assert "-# ckpt report: graph" not in message  # the graph's id does not change


def test_two_runs_write_byte_identical_reports(gpt_run, tmp_path):
    first_folder, first, _ = gpt_run
    second, _ = _compile_gpt_with_report(tmp_path)
    assert first["graph"] == second["graph"]
    for suffix in (".json", ".md"):
        name = f"{first['graph']}{suffix}"
        assert (first_folder / name).read_bytes() == (tmp_path / name).read_bytes()


def test_report_saved_bytes_equal_measured_bytes(gpt_run):
    _, report, measured = gpt_run
    assert report["totals"]["ckpt_saved_bytes"] == measured > 0
    # ckpt keeps less than PyTorch would on this model (masks are replayed).
    assert report["totals"]["ckpt_saved_bytes"] < report["totals"]["pytorch_saved_bytes"]


def test_diff_cli_lists_changed_decisions_and_totals(gpt_run, tmp_path, capsys):
    folder, report, _ = gpt_run
    a = folder / f"{report['graph']}.json"
    changed = copy.deepcopy(report)
    row = next(v for v in changed["values"] if v["ckpt"] == "recomputed" and v["op"] == "erf")
    row["ckpt"] = "saved"
    changed["totals"]["ckpt_saved_bytes"] += row["bytes"]
    b = tmp_path / "b.json"
    b.write_text(json.dumps(changed))

    assert ckpt_cli(["diff", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert f"1 decision(s) differ\n  {row['name']} (erf, {row['bytes']} bytes): recomputed -> saved\n" in out
    assert f"({row['bytes']:+d} bytes)" in out

    assert ckpt_cli(["diff", str(a)]) == 0  # ckpt vs PyTorch in one report
    out = capsys.readouterr().out
    assert out.startswith("--- ckpt\n+++ PyTorch\n")
    assert "saved for backward:" in out


def test_svg_drawn_with_graphviz_or_a_clear_message(gpt_run, tmp_path, monkeypatch, capsys):
    _, report, _ = gpt_run
    dot = graph_svg.to_dot(report)
    assert dot.startswith("digraph forward {") and graph_svg.COLORS["saved"] in dot
    path = write_report(report, tmp_path)
    if graph_svg.shutil.which("dot"):
        assert ckpt_cli(["svg", str(path)]) == 0
        assert "<svg" in path.with_suffix(".svg").read_text()
    monkeypatch.setattr(graph_svg.shutil, "which", lambda name: None)
    assert ckpt_cli(["svg", str(path)]) == 2
    assert "graphviz's `dot` program is not installed" in capsys.readouterr().err


def test_report_setting_from_env_and_cache_key():
    assert Config.from_env({"CKPT_REPORT": "/tmp/r"}).report_dir == "/tmp/r"
    assert Config.from_env({"CKPT_REPORT": ""}).report_dir is None
    # Reports need the partitioner to run, so a reporting compile skips the cache.
    assert make_backend(report_dir="/tmp/r").make_partitioner().uuid() is None
    assert make_backend().make_partitioner().uuid() is not None
    assert CkptPartitioner(Config(), compare_with_pytorch=True).uuid() is None


def _broken_pytorch_partitioner(*args, **kwargs):
    raise RuntimeError("injected failure")


def test_a_report_that_cannot_be_made_only_warns(monkeypatch, tmp_path):
    # PyTorch's decisions, which the report compares with, cannot be read:
    # ckpt's plan is still used and recorded, and no report is written.
    monkeypatch.setattr(compat, "torch_default_partition", _broken_pytorch_partitioner)
    config_module._warned.clear()
    backend = make_backend(strict=True, report_dir=str(tmp_path))
    with pytest.warns(UserWarning, match=r"ckpt could not write its report \(RuntimeError: injected failure\)"):
        torch.compile(MLP(depth=1, width=8), backend=backend)(torch.randn(4, 8)).backward()
    (plan,) = backend.plans
    assert plan.fallback is None and plan.saved
    assert backend.reports == [] and list(tmp_path.iterdir()) == []


def test_cli_on_a_fallback_report_says_there_are_no_decisions(tmp_path, capsys):
    path = tmp_path / "fallback.json"
    path.write_text(json.dumps({"fallback": "PartitionError: no finite cut", "values": [], "totals": {}}))
    for command in (["diff", str(path)], ["svg", str(path)]):
        assert ckpt_cli(command) == 2
        assert "ckpt fell back to PyTorch's partitioner for that graph (PartitionError: no finite cut)" in (
            capsys.readouterr().err
        )


_NOT_REPORTS = {
    "empty object": (b"{}", "is not a ckpt report: it has no 'fallback', 'values', 'totals', 'forward_graph' key(s)"),
    "array": (b"[1, 2]", "is not a ckpt report: it holds a JSON array, not a report object"),
    "truncated": (b'{"fallback": null, "values": [{"name": "a"', "is not valid JSON (Expecting ',' delimiter at line 1"),
    "not UTF-8": (b'{"fallback": "\xff"}', "is not UTF-8 text (invalid start byte at byte 14)"),
    "rows of another shape": (
        json.dumps({"fallback": None, "values": [{"name": "x"}], "totals": {}, "forward_graph": {}}).encode(),
        "is not a ckpt report: 'values' is not a list of objects with name, op, bytes, ckpt, pytorch",
    ),
    "graph of another shape": (
        json.dumps({
            "fallback": None, "values": [], "totals": {"ckpt_saved_bytes": 0, "pytorch_saved_bytes": 0},
            "forward_graph": {"nodes": [["x", "kept", 4]], "edges": []},
        }).encode(),
        "is not a ckpt report: 'forward_graph' is not {'nodes': [[name, decision, bytes], ...]",
    ),
}


@pytest.mark.parametrize("command", ["diff", "svg"])
@pytest.mark.parametrize("case", list(_NOT_REPORTS))
def test_cli_rejects_what_is_not_a_report_in_one_line(tmp_path, capsys, command, case):
    content, reason = _NOT_REPORTS[case]
    path = tmp_path / "input.json"
    path.write_bytes(content)
    assert ckpt_cli([command, str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.startswith(f"ckpt: {path} ")
    assert reason in err


def test_cli_names_the_bad_file_of_two(gpt_run, tmp_path, capsys):
    folder, report, _ = gpt_run
    good, missing = folder / f"{report['graph']}.json", tmp_path / "missing.json"
    assert ckpt_cli(["diff", str(good), str(missing)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"ckpt: cannot read {missing}: No such file or directory\n"



@dataclasses.dataclass
class _Output:
    logits: torch.Tensor
    loss: torch.Tensor | None = None


_Pair = collections.namedtuple("_Pair", ["loss", "logits"])


def test_training_loss_rule():
    x = torch.randn(3, requires_grad=True)
    loss = (x * 2).sum()
    labels = torch.arange(3)  # an int tensor: never part of the loss
    assert training_loss(loss) is loss
    torch.testing.assert_close(training_loss(x), x.sum())
    assert training_loss({"loss": loss, "logits": x}) is loss  # a "loss" key wins (ModelOutput too)
    assert training_loss(_Output(logits=x, loss=loss)) is loss  # so does a loss attribute
    assert training_loss(_Pair(loss, x)) is loss
    # Otherwise every floating tensor, through tuples, dicts and dataclasses.
    torch.testing.assert_close(training_loss((x, labels, {"y": [x * 3]})), x.sum() * 4)
    torch.testing.assert_close(training_loss(_Output(logits=x)), x.sum())
    assert training_loss((x, loss), loss_fn=lambda out: out[1]) is loss  # loss_fn wins over all


def test_training_loss_without_a_differentiable_tensor_says_how_to_pass_loss_fn():
    with pytest.raises(TypeError, match=r"returned tuple with no floating-point tensor that requires grad.*loss_fn=lambda output"):
        training_loss((torch.arange(3), torch.zeros(2)))


class _Returns(torch.nn.Module):
    """Wraps a model whose output is a tensor and returns it as ``shape`` does."""

    def __init__(self, inner, shape):
        super().__init__()
        self.inner, self.shape = inner, shape

    def forward(self, x):
        y = self.inner(x)
        return {"tuple": (y,), "dict": {"out": y}, "tensor": y}[self.shape]


def test_golden_reports_of_tuple_and_dict_outputs_match_the_tensors():
    torch.manual_seed(0)
    inner, x = MLP(depth=1, width=8), torch.randn(4, 8)
    texts = {shape: render_reports(_Returns(inner, shape), x) for shape in ("tensor", "tuple", "dict")}
    assert texts["tensor"].startswith("# ckpt report")
    assert texts["tuple"] == texts["tensor"] and texts["dict"] == texts["tensor"]
