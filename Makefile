# Two commands set up everything on a fresh machine: `make demo` and `make test`.
# torch is pinned to 2.13.0: on our machines that version installs the CPU build from local disk, while a plain
# `pip install torch` would download a multi-GB CUDA build.
#
# Every setting below can be overridden on the command line or in the environment, which is how CI's matrix runs
# the same two commands (`make install`, `make test`) for each Python and Lightning version, e.g.
#   make test LIGHTNING_VERSION=2.6.0 TORCH_VERSION=2.4.1 TORCH_INDEX=https://download.pytorch.org/whl/cpu
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
# Where torch comes from: empty for pip's own indexes; CI passes PyTorch's CPU index (PyPI's Linux wheels are the
# CUDA builds). A CPU build's version (2.4.1+cpu) satisfies the `torch==2.4.1` pins below.
TORCH_INDEX ?=
# Empty: the newest pytorch-lightning and lightning that pyproject.toml admits; else `==` this (2.6.0, 2.6.*...).
LIGHTNING_VERSION ?=
TORCH_SOURCE := $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
LIGHTNING_PINS := $(if $(LIGHTNING_VERSION),"pytorch-lightning==$(LIGHTNING_VERSION)" "lightning==$(LIGHTNING_VERSION)")
VERSIONS := torch-$(TORCH_VERSION)-lightning-$(or $(subst *,x,$(LIGHTNING_VERSION)),newest)
# Two stamps: what the demo needs (torch, Lightning, FairScale and this package) and, on top, what the tests, linters,
# docs and benchmarks need (the `test` and `docs` extras, the Hugging Face packages). `make demo` installs the first
# only, so a newcomer's first command trains within a minute or two of a fresh clone.
CORE_STAMP := $(VENV)/.core-$(VERSIONS)
STAMP := $(VENV)/.installed-$(VERSIONS)

# Bytecode: every process starts from the installed packages' (Python writes none of its own where
# PYTHONDONTWRITEBYTECODE is set, as on our machines). pip compiles on one core (20 s of the 27 s torch takes), so the
# installs skip it and `compileall` compiles what they added on every core (11 s for torch on 2); a file it cannot
# compile (a package's Python 2 example) is skipped, as pip skips it.
PIP := $(PY) -m pip install --quiet --no-compile
COMPILE = $(PY) -m compileall -q -j 0 $(1) > /dev/null 2>&1 || true
SITE = $$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')

$(CORE_STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PIP) $(TORCH_SOURCE) "torch==$(TORCH_VERSION)"
	$(PIP) -e . "torch==$(TORCH_VERSION)" $(LIGHTNING_PINS)
	$(call COMPILE,$(SITE))
	rm -f $(VENV)/.core-* $(VENV)/.installed-*  # another set of versions installed before: switching back reinstalls
	touch $(CORE_STAMP)

$(STAMP): $(CORE_STAMP)
	$(PIP) -e ".[test,docs]" "torch==$(TORCH_VERSION)" $(LIGHTNING_PINS)
	# The Hugging Face packages of tests/test_hf_models.py (pyproject's `hf` extra), in a folder that only those tests
	# put on their path: in the environment, torchmetrics would import transformers in every process that imports
	# Lightning. PEFT and Accelerate without their dependencies (torch is the environment's).
	rm -rf $(VENV)/hf
	$(PIP) --target $(VENV)/hf "transformers>=4.45,<6"
	$(PIP) --target $(VENV)/hf --no-deps "peft>=0.13,<1" accelerate psutil
	# LitGPT's model (its own GPT and Block): without its dependencies, which the two lines above and the environment
	# hold (it caps huggingface-hub below what transformers needs; its model does not use the hub).
	$(PIP) --target $(VENV)/hf --no-deps "litgpt>=0.5,<0.6"
	$(call COMPILE,$(SITE) $(VENV)/hf)
	touch $(STAMP)

install: $(STAMP)

demo: $(CORE_STAMP)
	$(PY) examples/demo.py

# The test suite: the launched scenarios (tests/, and the docstring examples of src/), the in-process unit tests
# (`make unit`), the linters (`make lint`) and the docs' examples (`make doctest`). The last three run beside the
# scenarios, which spend much of their time waiting (for ranks to start, for timeouts they test), each in a session of
# its own (Ctrl-C on `make test` stops them too), at a lower priority (niceness 10: they take the cores the scenarios
# leave idle instead of slowing the scenarios down, which set the suite's wall time), their output printed after the
# scenarios'; any failure fails it.
CHECKS := $(VENV)/checks
BESIDE := unit lint doctest
# The checks' make, named through a variable of our own: GNU make runs every recipe line that names $(MAKE) itself
# even under `make -n`, and with this recipe's line the whole suite; through SUBMAKE, `make -n test` only prints.
SUBMAKE = $(MAKE)
test: $(STAMP)
	@rm -rf $(CHECKS) && mkdir -p $(CHECKS)
	@for check in $(BESIDE); do \
	  (setsid nice -n 10 $(SUBMAKE) --no-print-directory $$check > $(CHECKS)/$$check.log 2>&1 & echo $$! > $(CHECKS)/$$check.pid; \
	   wait $$!; echo $$? > $(CHECKS)/$$check.rc) & \
	done; \
	trap 'for f in $(CHECKS)/*.pid; do kill -TERM -- -$$(cat $$f) 2>/dev/null; done; exit 130' INT TERM; \
	$(PY) -m pytest -q tests src --ignore=tests/unit; status=$$?; wait; \
	for check in $(BESIDE); do \
	  echo "--- make $$check (exit $$(cat $(CHECKS)/$$check.rc))"; cat $(CHECKS)/$$check.log; \
	  [ "$$(cat $(CHECKS)/$$check.rc)" = 0 ] || status=1; \
	done; \
	exit $$status

# The comparisons with unsharded training (and "ddp") under other summation orders than this CPU's own: MKL's
# reproducibility branches (`MKL_CBWR`: COMPATIBLE on every CPU; AVX2 on Intel CPUs; on AMD ones MKL keeps its own
# branch for it, as without the variable) and ATen's narrowest vector kernels (`ATEN_CPU_CAPABILITY=default`). A
# tolerance that holds on one CPU only fails here (the feature matrix's Adam cells at 1e-5 did: 7.9e-5 under
# COMPATIBLE). Not part of `make test` (each order is another run); CI runs it in one job. ORDER_TESTS: the files
# (the matrix and the other tests against "ddp", ~2 min an order on 2 cores); `make orders ORDER_TESTS=tests` for all.
ORDERS ?= MKL_CBWR=COMPATIBLE MKL_CBWR=AVX2 ATEN_CPU_CAPABILITY=default
ORDER_TESTS ?= tests/test_matrix.py tests/test_unsharded_shapes.py
orders: $(STAMP)
	@for order in $(ORDERS); do \
	  echo "--- $$order"; env $$order $(PY) -m pytest -q $(ORDER_TESTS) || exit 1; \
	done

# ruff on every Python file, mypy on the package (their settings are in pyproject.toml). Part of `make test`.
lint: $(STAMP)
	$(PY) -m ruff check src tests benchmarks examples tools
	$(PY) -m mypy

# The in-process unit tests of the engine alone (tests/unit): seconds, no launched processes. Part of `make test`.
unit: $(STAMP)
	$(PY) -m pytest -q tests/unit

doctest: $(STAMP)
	$(PY) -m sphinx -W --keep-going -q -b doctest docs docs/_build/doctest

# Every benchmark in benchmarks/ (see benchmarks/README.md); `make bench BENCHMARKS=activation_checkpointing` runs
# only those named.
BENCHMARKS ?=

bench: $(STAMP)
	$(PIP) -e ".[bench]" "torch==$(TORCH_VERSION)"
	$(call COMPILE,$(SITE))
	$(PY) benchmarks/run.py $(BENCHMARKS)

# The modules of `lightning_fairscale.lightning` (for `import lightning as L`): copies of the modules that import
# Lightning, with `pytorch_lightning` -> `lightning.pytorch` and `lightning_fabric` -> `lightning.fabric` renamed
# (tools/generate_lightning.py). Run it after changing such a module, or after a merge that touches one; a unit test
# (`make unit`) fails while a copy is out of date. Needs no installed package: it only reads and writes files.
lightning:
	$(PYTHON) tools/generate_lightning.py

# Each option of the strategies is declared once, as a field of its configuration (fsdp/config.py,
# sharded_ddp/config.py); this writes the Trainer's and Fabric's constructor parameters and `Args:` entries and the
# typed attributes (_adapters/options.py) from the fields (tools/generate_options.py). It imports the configurations,
# so it runs in the environment. Then `make lightning`; a unit test fails while either is out of date.
options: $(CORE_STAMP)
	$(PY) tools/generate_options.py

docs: $(STAMP)
	$(PY) -m sphinx -W --keep-going -q -b html docs docs/_build/html

clean:
	rm -rf $(VENV) build dist docs/_build src/*.egg-info .mypy_cache .ruff_cache
