# One-command set-up on a fresh machine with Python 3.11: every target installs first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch pinned: this exact CPU build is on the machine's disk, a looser
# request would pull a multi-GB CUDA build.
TORCH_PIN := torch==2.13.0

.PHONY: install test check-package test-torch2.14 demo bench train clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_PIN)"  # first, pinned
	$(PY) -m pip install --quiet -e ".[test,bench]"
	touch $@

install: $(VENV)/.installed

test: install
	$(PY) -m pytest -q tests

# What a user gets from `pip install .` (not editable): a fresh venv, the
# wheel alone, checked from outside the checkout (tests/package_check.py).
PACKAGE_VENV ?= /tmp/ckpt-package-venv
check-package:
	rm -rf $(PACKAGE_VENV)
	$(PYTHON) -m venv $(PACKAGE_VENV)
	$(PACKAGE_VENV)/bin/python -m pip install --quiet "$(TORCH_PIN)"
	$(PACKAGE_VENV)/bin/python -m pip install --quiet .
	cd $(PACKAGE_VENV) && bin/python $(CURDIR)/tests/package_check.py

# The same suite on torch 2.14.1, in its own venv (.venv stays on 2.13.0,
# which CI tests). 2.14.1 and its CUDA libraries are on the machine's disk:
# the first run installs about 5.6 GB; the tests run on CPU.
VENV_TORCH214 ?= .venv-torch2.14
PY_TORCH214 := $(VENV_TORCH214)/bin/python

$(VENV_TORCH214)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV_TORCH214)
	$(PY_TORCH214) -m pip install --quiet --upgrade pip
	$(PY_TORCH214) -m pip install --quiet "torch==2.14.1"
	$(PY_TORCH214) -m pip install --quiet -e ".[test,bench]"
	touch $@

test-torch2.14: $(VENV_TORCH214)/.installed
	$(PY_TORCH214) -m pytest -q tests

demo: install
	$(PY) -m bench.demo

# The side-by-side suite (under 15 minutes on 2 cores): bench/results/.
# Pass options with BENCH_ARGS, e.g. make bench BENCH_ARGS="--quick".
bench: install
	$(PY) -m bench $(BENCH_ARGS)

clean:
	rm -rf $(VENV) $(VENV_TORCH214) build *.egg-info

# The training run (under 10 minutes on 2 cores): bench/results/train/.
train: install
	$(PY) -m bench.train $(TRAIN_ARGS)
