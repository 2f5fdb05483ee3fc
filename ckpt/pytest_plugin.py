"""pytest plugin: pin ckpt's decisions in golden report files.

    def test_my_model_plan(ckpt_golden):
        ckpt_golden("my_model", model, x)

compiles ``model`` with ckpt on the example inputs, runs one forward and
backward, renders the report of every graph and compares it with
``goldens/my_model.md`` beside the test file. A difference fails with a
unified diff naming the values whose decisions changed; run pytest with
``--ckpt-update-goldens`` to rewrite the golden files instead.
"""
from __future__ import annotations

import difflib
import pathlib
import tempfile

import pytest

GOLDEN_FOLDER = "goldens"


def pytest_addoption(parser):
    parser.addoption(
        "--ckpt-update-goldens",
        action="store_true",
        help="rewrite ckpt golden report files instead of comparing with them",
    )


def render_reports(model, *example_inputs, config=None) -> str:
    """Compile with ckpt, run forward and backward, and return the markdown
    reports of all graphs, in compile order."""
    import torch

    from ckpt import Config, make_backend
    from passes.report import render_markdown

    with tempfile.TemporaryDirectory() as folder:
        backend = make_backend(config or Config(), strict=True, report_dir=folder)
        torch._dynamo.reset()
        output = torch.compile(model, backend=backend)(*example_inputs)
        (output if output.dim() == 0 else output.sum()).backward()
        torch._dynamo.reset()
    return "\n".join(render_markdown(report) for report in backend.reports)


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
    """``check(name, model, *inputs, config=None)``: compare the model's ckpt
    reports with ``goldens/<name>.md`` beside the test file."""
    update = request.config.getoption("--ckpt-update-goldens")
    folder = request.path.parent / GOLDEN_FOLDER

    def check(name: str, model, *example_inputs, config=None) -> str:
        text = render_reports(model, *example_inputs, config=config)
        compare_with_golden(text, folder / f"{name}.md", update)
        return text

    return check
