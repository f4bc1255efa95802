# Two commands set up everything on a fresh machine: `make demo` and `make test`.
# torch is pinned to 2.13.0: on our machines that version installs the CPU build from local disk, while a plain
# `pip install torch` would download a multi-GB CUDA build.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.installed-$(TORCH_VERSION)

.PHONY: install demo test unit doctest docs bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "torch==$(TORCH_VERSION)"
	$(PY) -m pip install --quiet -e ".[test,docs]" "torch==$(TORCH_VERSION)"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

# The test suite includes the docs' examples (`make doctest`); docstring examples run under pytest itself.
test: doctest
	$(PY) -m pytest -q

# The in-process unit tests of the engine alone (tests/unit): seconds, no launched processes. Part of `make test`.
unit: $(STAMP)
	$(PY) -m pytest -q tests/unit

doctest: $(STAMP)
	$(PY) -m sphinx -W --keep-going -q -b doctest docs docs/_build/doctest

# Every benchmark in benchmarks/ (see benchmarks/README.md); `make bench BENCHMARKS=activation_checkpointing` runs
# only those named.
BENCHMARKS ?=

bench: $(STAMP)
	$(PY) -m pip install --quiet -e ".[bench]" "torch==$(TORCH_VERSION)"
	$(PY) benchmarks/run.py $(BENCHMARKS)

docs: $(STAMP)
	$(PY) -m sphinx -W --keep-going -q -b html docs docs/_build/html

clean:
	rm -rf $(VENV) build dist docs/_build src/*.egg-info
