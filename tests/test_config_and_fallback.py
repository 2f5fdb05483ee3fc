"""Config from the environment, the backend factory, torch.compile's mode and
options, cache keys and the fallback."""
import pathlib

import pytest
import torch

import partitioners.config as config_module
import partitioners.partition as partition_module
from bench.models import MLP
from ckpt import Config, ConfigError, ckpt_backend, make_backend
from ckpt.backend import inductor_patches
import ckpt_compat as compat
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
    with pytest.raises(ConfigError, match=r"unknown ckpt setting\(s\) \['budget'\]; valid settings: \['device_profile', 'measure_steps', 'memory_budget', 'module_prefix', 'report_dir', 'step_planning', 'strict'\]"):
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
    config_module._warned.clear()
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


# --- every field checked when a Config is made ---------------------------------


def test_bool_strings_read_as_the_environment_reads_them():
    assert make_backend(strict="false").config.strict is False
    assert make_backend(strict="Yes").config.strict is True
    with pytest.raises(ConfigError, match=r"^strict='maybe' is not a boolean; use one of 1, true, yes, on or 0, false, no, off"):
        make_backend(strict="maybe")
    with pytest.raises(ConfigError, match=r"^strict=2 is not a boolean"):
        Config(strict=2)


def test_report_dir_must_be_a_path():
    with pytest.raises(ConfigError, match=r"^report_dir=123 is not a folder path; use a str or pathlib.Path"):
        make_backend(report_dir=123)
    assert make_backend(report_dir=pathlib.Path("out")).config.report_dir == "out"
    assert Config(report_dir="").report_dir is None


def test_config_may_be_a_mapping_of_fields():
    assert make_backend(config={"strict": True}).config == Config(strict=True)
    assert make_backend(config={"memory_budget": "0.5"}, strict=True).config == Config(memory_budget=0.5, strict=True)
    with pytest.raises(ConfigError, match=r"unknown ckpt setting\(s\) \['strikt'\]; valid settings: \['device_profile'"):
        make_backend(config={"strikt": True})
    with pytest.raises(ConfigError, match=r"^config=42 is not a ckpt config; pass a ckpt.Config, a dict of its fields"):
        make_backend(config=42)


def test_device_profile_any_case_and_errors_name_field_or_variable():
    assert Config(device_profile="H100").device_profile == "h100"
    assert Config.from_env({"CKPT_DEVICE_PROFILE": " H200 "}).device_profile == "h200"
    assert Config.from_env({"CKPT_DEVICE_PROFILE": "", "CKPT_REPORT": " "}) == Config()
    with pytest.raises(ConfigError, match=r"^CKPT_DEVICE_PROFILE='abc' is unknown; use one of cpu, h100, h200"):
        Config.from_env({"CKPT_DEVICE_PROFILE": "abc"})
    with pytest.raises(ConfigError, match=r"^device_profile='abc' is unknown; use one of cpu, h100, h200 \(any case\)"):
        make_backend(device_profile="abc")
    with pytest.raises(ConfigError, match=r"^CKPT_MEMORY_BUDGET='lots' is not a memory budget"):
        Config.from_env({"CKPT_MEMORY_BUDGET": "lots"})


def test_bad_variable_at_compile_time_is_the_first_line_not_dynamos_wrapper(monkeypatch):
    # Dynamo wraps a backend's exceptions in BackendCompilerFailed ("backend=... raised:");
    # ckpt's setting errors pass through it, so the user reads the variable first.
    monkeypatch.setenv("CKPT_STRICT", "maybe")
    torch._dynamo.reset()
    compiled = torch.compile(MLP(depth=1, width=8), backend="ckpt")
    with pytest.raises(ConfigError) as caught:
        compiled(torch.randn(4, 8))
    assert not isinstance(caught.value, torch._dynamo.exc.BackendCompilerFailed)
    first_line = str(caught.value).splitlines()[0]
    assert first_line.startswith("CKPT_STRICT='maybe' is not a boolean; use one of 1, true, yes, on or 0, false, no, off")
    torch._dynamo.reset()


# --- torch.compile's mode= and options= ----------------------------------------


def _spy_on_inductor(monkeypatch) -> list[dict]:
    patches = []
    real_compile_fx = compat.compile_fx

    def compile_fx(gm, example_inputs, config_patches, **kwargs):
        patches.append(config_patches)
        return real_compile_fx(gm, example_inputs, config_patches=config_patches, **kwargs)

    monkeypatch.setattr(compat, "compile_fx", compile_fx)
    return patches


@pytest.mark.parametrize(
    "compile_kwargs",
    [{"mode": "max-autotune-no-cudagraphs"}, {"options": {"max_autotune": True}}],
    ids=["mode", "options"],
)
def test_torch_compile_mode_and_options_apply_on_top_of_ckpt(monkeypatch, compile_kwargs):
    patches = _spy_on_inductor(monkeypatch)
    torch.manual_seed(0)
    model, x = MLP(depth=2, width=16), torch.randn(8, 16)
    compiled_model = MLP(depth=2, width=16)
    compiled_model.load_state_dict(model.state_dict())
    backend = make_backend(Config(), strict=True)
    torch._dynamo.reset()
    torch.compile(compiled_model, backend=backend, **compile_kwargs)(x).backward()
    torch._dynamo.reset()
    model(x).backward()
    (patch,) = patches
    assert patch["max_autotune"] is True
    assert isinstance(patch["custom_partitioner_fn"], partition_module.CkptPartitioner)
    assert len(backend.plans) == 1 and backend.plans[0].fallback is None
    # float32, 2 blocks of width 16: Inductor's fused kernels reorder sums (as in the fallback test).
    for got, want in zip(compiled_model.parameters(), model.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-5)


def test_mode_presets_are_inductors():
    assert inductor_patches("max-autotune-no-cudagraphs", None) == torch._inductor.list_mode_options(
        "max-autotune-no-cudagraphs"
    )
    assert inductor_patches(None, {"max-autotune": True}) == {"max_autotune": True}
    assert inductor_patches(None, None) == {}


def test_unknown_option_is_rejected_at_the_first_compile():
    torch._dynamo.reset()
    compiled = torch.compile(MLP(depth=1, width=8), backend=make_backend(Config()), options={"max_autotun": True})
    with pytest.raises(ConfigError) as caught:
        compiled(torch.randn(4, 8))
    first_line = str(caught.value).splitlines()[0]
    assert first_line.startswith(
        "torch.compile(options={'max_autotun': ...}): 'max_autotun' is not an Inductor option "
        "(did you mean 'max_autotune'"
    )
    torch._dynamo.reset()


def test_bad_mode_and_option_types_get_inductors_error():
    with pytest.raises(ConfigError, match=r"Unrecognized mode=fast, should be one of: default, lite"):
        inductor_patches("fast", None)
    with pytest.raises(ConfigError, match=r"Unexpected type of attr max_autotune, got str should be bool"):
        inductor_patches(None, {"max_autotune": "yes"})
    with pytest.raises(ConfigError, match=r"ckpt is the partitioner and sets it itself"):
        inductor_patches(None, {"custom_partitioner_fn": None})


@pytest.mark.parametrize(
    "budget, options, unroll",
    [(None, None, None), ("0.0", None, 1), ("0.0", {"unroll_reductions_threshold": 4}, 4)],
    ids=["no budget", "budget", "user's option"],
)
def test_a_budget_compiles_without_unrolled_reductions_unless_the_user_says(monkeypatch, budget, options, unroll):
    """Under a budget Inductor must not unroll small reductions (they are
    inlined into a later consumer and hold their input alive); without one,
    ckpt compiles as torch.compile does; the user's own option wins."""
    patches = _spy_on_inductor(monkeypatch)
    torch._dynamo.reset()
    backend = make_backend(Config(), strict=True, memory_budget=budget, step_planning=False)
    torch.compile(MLP(depth=2, width=16), backend=backend, options=options)(torch.randn(8, 16)).backward()
    torch._dynamo.reset()
    (patch,) = patches
    assert patch.get("unroll_reductions_threshold") == unroll
