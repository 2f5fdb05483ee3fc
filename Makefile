# One-command set-up on a fresh machine with Python 3.11: every target installs first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install test demo bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and pinned: this exact CPU build is on the machine's disk,
	# a looser request would pull a multi-GB CUDA build.
	$(PY) -m pip install --quiet "torch==2.13.0"
	$(PY) -m pip install --quiet -e ".[test,bench]"
	touch $@

install: $(VENV)/.installed

test: install
	$(PY) -m pytest -q tests

demo: install
	$(PY) -m bench.demo

# The side-by-side suite (under 15 minutes on 2 cores): bench/results/.
# Pass options with BENCH_ARGS, e.g. make bench BENCH_ARGS="--quick".
bench: install
	$(PY) -m bench $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
