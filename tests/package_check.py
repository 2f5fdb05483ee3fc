"""Run by ``make check-package`` in a fresh venv where ``pip install .`` (not
editable) installed ckpt, from a folder outside the checkout: the wheel
holds the library alone, and torch.compile finds the backend by name."""
import importlib.util
import pathlib
import sys

import torch

import ckpt

checkout = pathlib.Path(__file__).resolve().parent.parent
installed = pathlib.Path(ckpt.__file__).resolve()
if checkout in installed.parents:
    sys.exit(f"ckpt was imported from the checkout ({installed}), not from the installed wheel")
for name in ("bench", "reports", "tests"):
    if importlib.util.find_spec(name) is not None:
        sys.exit(f"the wheel installed a top-level package {name!r}: keep it out of [tool.setuptools.packages.find]")

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
x = torch.randn(8, 16)
compiled = torch.compile(model, backend="ckpt")
compiled(x).sum().backward()
got = [p.grad.clone() for p in model.parameters()]
model.zero_grad()
model(x).sum().backward()
for a, b in zip(got, (p.grad for p in model.parameters())):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
print(f"ckpt installed at {installed.parent}: backend='ckpt' compiles, gradients match eager; no bench/reports packages")
