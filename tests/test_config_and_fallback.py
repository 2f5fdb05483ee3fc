"""Config from the environment, the backend factory, cache keys and the fallback."""
import pytest
import torch

import partitioners.partition as partition_module
from bench.models import MLP
from ckpt import Config, ConfigError, ckpt_backend, make_backend
from partitioners.mincut import PartitionError
from partitioners.partition import CkptPartitioner


def test_from_env_reads_ckpt_variables():
    assert Config.from_env({}) == Config()
    assert Config.from_env({"CKPT_STRICT": "1"}).strict is True
    assert Config.from_env({"CKPT_STRICT": "off"}).strict is False


def test_bad_value_names_the_variable_and_accepted_forms():
    with pytest.raises(ConfigError, match=r"CKPT_STRICT='maybe' is not a boolean; use one of 1, true"):
        Config.from_env({"CKPT_STRICT": "maybe"})


def test_unknown_variable_warns_with_the_known_ones():
    with pytest.warns(UserWarning, match="CKPT_STIRCT is not a ckpt setting.*CKPT_STRICT"):
        Config.from_env({"CKPT_STIRCT": "1"})


def test_make_backend_overrides_and_rejects_unknown_fields():
    assert make_backend(strict=True).config.strict is True
    assert make_backend(Config(strict=True)).config == Config(strict=True)
    with pytest.raises(ConfigError, match=r"unknown ckpt setting\(s\) \['budget'\]; valid settings: \['device_profile', 'memory_budget', 'report_dir', 'strict'\]"):
        make_backend(budget=0.5)


def test_default_backend_reads_environment_at_compile_time(monkeypatch):
    monkeypatch.setenv("CKPT_STRICT", "true")
    assert ckpt_backend.config.strict is True


def test_cache_key_covers_the_config():
    keys = {CkptPartitioner(Config(strict=s)).uuid() for s in (True, False)}
    assert len(keys) == 2
    assert CkptPartitioner(Config()).uuid() == CkptPartitioner(Config()).uuid()


def _failing_solve(*args):
    raise PartitionError("injected failure")


def test_failure_falls_back_to_pytorch_partitioner_with_a_warning(monkeypatch, tmp_path):
    monkeypatch.setattr(partition_module, "solve_with_budget", _failing_solve)
    partition_module._warned.clear()
    model, x = MLP(depth=2, width=16), torch.randn(8, 16)
    backend = make_backend(strict=False, report_dir=str(tmp_path))
    compiled_model = MLP(depth=2, width=16)
    compiled_model.load_state_dict(model.state_dict())
    with pytest.warns(UserWarning, match="ckpt could not partition this graph .*injected failure.*PyTorch's partitioner"):
        torch.compile(compiled_model, backend=backend)(x).backward()
    model(x).backward()
    (plan,) = backend.plans
    assert plan.fallback == "PartitionError: injected failure"
    # ... and the report says so.
    (report,) = backend.reports
    assert "ckpt fell back to PyTorch's partitioner for this graph: PartitionError: injected failure" in (
        tmp_path / f"{report['graph']}.md"
    ).read_text()
    for got, want in zip(compiled_model.parameters(), model.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-5)


def test_strict_mode_raises_the_partitioner_error(monkeypatch):
    monkeypatch.setattr(partition_module, "solve_with_budget", _failing_solve)
    compiled = torch.compile(MLP(depth=1, width=8), backend=make_backend(strict=True))
    with pytest.raises(Exception, match="injected failure"):
        compiled(torch.randn(4, 8))
