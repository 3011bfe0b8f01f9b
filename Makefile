# The README's two commands: `make demo` and `make test`. Both set up everything first.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.mlcomp-installed

.PHONY: setup demo test test-all test-perf bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip setuptools wheel
	# torch first, the CPU build (a plain `torch` requirement would pull CUDA wheels)
	$(BIN)/python -m pip install torch==2.13.0
	$(BIN)/python -m pip install -c constraints.txt -e ".[test]"
	$(BIN)/python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $(STAMP)

# the main job: compile a built-in model with the default pipeline (-O2) for every available
# target and print the imperative-vs-compiled table (unavailable targets say why)
demo: setup
	$(BIN)/mlcomp bench mlp --targets eager,cpu,onnxruntime,tvm,cuda --batch 1,32 -p -O2

# CI's command: everything except the tests marked `slow` (multi-process runs, TVM tuning, the
# largest models of a sweep), which `make test-all` adds, and `perf` (tests/perf: wall-clock
# comparisons, machine-dependent), which `make test-perf` runs; the suite stays under 10 minutes on 2 cores.
# Two pytest-xdist workers, one test file each at a time (--dist loadfile: a file's module-scoped fixtures,
# the zoo's compiled artifacts, are built once); every worker is its own process, so process-wide settings
# (the allocator policy, thread counts) stay per worker. TEST_WORKERS=0 runs everything in this process.
TEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

test: setup
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q $(XDIST) -m "not slow and not perf"

test-all: setup
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q $(XDIST) -m "not perf"

test-perf: setup
	$(BIN)/python -m pytest -q -m perf tests/perf

bench: setup
	$(BIN)/python benchmarks/targets.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
