"""pytest plugin: pin ckpt's decisions in golden report files.

    def test_my_model_plan(ckpt_golden):
        ckpt_golden("my_model", model, x)

compiles ``model`` with ckpt on the example inputs, runs one forward and
backward, renders the report of every graph and compares it with
``goldens/my_model.md`` beside the test file. A difference fails with a
unified diff naming the values whose decisions changed; run pytest with
``--ckpt-update-goldens`` to rewrite the golden files instead.

The backward pass runs on ``training_loss(output, loss_fn)``: see there for
how tuples, dicts, dataclasses and transformers' ModelOutput make a loss.
"""
from __future__ import annotations

import dataclasses
import difflib
import pathlib
import tempfile
from collections.abc import Mapping

import pytest

GOLDEN_FOLDER = "goldens"


def pytest_addoption(parser):
    parser.addoption(
        "--ckpt-update-goldens",
        action="store_true",
        help="rewrite ckpt golden report files instead of comparing with them",
    )


def render_reports(model, *example_inputs, config=None, loss_fn=None) -> str:
    """Compile with ckpt, run forward and backward, and return the markdown
    reports of all graphs, in compile order."""
    import torch

    from ckpt import Config, make_backend
    from .reports.report import render_markdown

    with tempfile.TemporaryDirectory() as folder:
        backend = make_backend(config or Config(), strict=True, report_dir=folder)
        torch._dynamo.reset()
        output = torch.compile(model, backend=backend)(*example_inputs)
        training_loss(output, loss_fn).backward()
        torch._dynamo.reset()
    return "\n".join(render_markdown(report) for report in backend.reports)


def training_loss(output, loss_fn=None):
    """The scalar backward runs on, from a model's output. The first rule that applies:

    1. ``loss_fn(output)``, when a ``loss_fn`` is given;
    2. a tensor: itself if it is a scalar (0-dim), else its ``.sum()``;
    3. a ``loss`` tensor: a ``"loss"`` key of a dict (transformers' ModelOutput
       is one) or a ``loss`` attribute (a dataclass, a namedtuple), as in 2;
    4. the sum of ``.sum()`` of every floating-point tensor in the output,
       found through tuples, lists, dicts and dataclasses.

    An output with none, or none that requires grad, is a TypeError saying how
    to pass ``loss_fn``.
    """
    import torch

    if loss_fn is not None:
        return loss_fn(output)
    if isinstance(output, torch.Tensor):
        return output if output.dim() == 0 else output.sum()
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return training_loss(loss)
    tensors = _floating_tensors(output)
    if not any(t.requires_grad for t in tensors):
        raise TypeError(
            f"ckpt_golden: the model returned {type(output).__name__} with no floating-point "
            "tensor that requires grad, so there is no loss to call backward on; pass one, e.g. "
            "ckpt_golden(name, model, *inputs, loss_fn=lambda output: output[0].sum())"
        )
    return sum(t.sum() for t in tensors)


def _floating_tensors(output) -> list:
    import torch

    if isinstance(output, torch.Tensor):
        return [output] if output.is_floating_point() else []
    if isinstance(output, Mapping):
        items = list(output.values())
    elif isinstance(output, (tuple, list)):
        items = list(output)
    elif dataclasses.is_dataclass(output) and not isinstance(output, type):
        items = [getattr(output, f.name) for f in dataclasses.fields(output)]
    else:
        return []
    return [t for item in items for t in _floating_tensors(item)]


def compare_with_golden(text: str, golden: pathlib.Path, update: bool) -> None:
    if update or not golden.exists():
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(text)
        if not update:
            pytest.fail(f"golden file {golden} did not exist; wrote it. Check it in and rerun.")
        return
    expected = golden.read_text()
    if text != expected:
        diff = "".join(
            difflib.unified_diff(
                expected.splitlines(keepends=True),
                text.splitlines(keepends=True),
                fromfile=str(golden),
                tofile="this run",
            )
        )
        pytest.fail(
            f"ckpt report differs from {golden} "
            "(rerun with --ckpt-update-goldens to accept):\n" + diff,
            pytrace=False,
        )


@pytest.fixture
def ckpt_golden(request):
    """``check(name, model, *inputs, config=None, loss_fn=None)``: compare the
    model's ckpt reports with ``goldens/<name>.md`` beside the test file.
    ``loss_fn(output)`` makes the loss; without it, see ``training_loss``."""
    update = request.config.getoption("--ckpt-update-goldens")
    folder = request.path.parent / GOLDEN_FOLDER

    def check(name: str, model, *example_inputs, config=None, loss_fn=None) -> str:
        text = render_reports(model, *example_inputs, config=config, loss_fn=loss_fn)
        compare_with_golden(text, folder / f"{name}.md", update)
        return text

    return check
