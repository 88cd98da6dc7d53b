# Two entry points for a fresh machine:  `make demo`  and  `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# Make the prompts and sizes of the demo overridable: make demo PROMPT='def f(x):'
PROMPT ?= def fibonacci(n):

.PHONY: demo test setup setup-test convert clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# The engine and its runtime dependencies.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	touch $@

# Test extras; torch 2.13.0 first, so a CPU build is used where one is at hand.
$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $@

setup: $(VENV)/.installed
setup-test: $(VENV)/.installed-test

# Converts the embedded Hugging Face models (checkpoints/hf/) to Orbax checkpoints.
checkpoints/%/jaxspec.json: | $(VENV)/.installed
	$(BIN)/python scripts/convert_hf_checkpoint.py checkpoints/hf/$* checkpoints/$*

convert: checkpoints/code-target-16m/jaxspec.json checkpoints/code-draft-4m/jaxspec.json

# Speculative decoding with the embedded pair (K=2: acceptance 0.69 on this prompt, above the 0.6
# warning line); prints the completion, its acceptance stats and the speedup measured over plain decoding.
demo: convert
	$(BIN)/jaxspec generate "$(PROMPT)" --draft checkpoints/code-draft-4m --num-draft-tokens 2 --max-new-tokens 96 --compare-plain

# Two workers for the correctness tests, then the speed-comparing ones (marked timing) alone.
# The correctness tests spend most of their time compiling small graphs that each run briefly:
# LLVM's O0 backend compiles them faster (XLA's own graph passes still run; the whole suite
# 32 -> 27 min on this 2-core machine; per file again 2026-12-04, docs/bench/cpu-test-durations-o0-vs-default.txt:
# 2341 s summed at O0 against 2564 at XLA's default; the sampling-distribution tests and Ray jobs
# ran 1-3 min faster at the default, too little for an invocation of their own). The timing
# tests keep XLA's defaults. Only the tensor-parallel tests need the CPU's four virtual devices
# (tests/conftest.py), and the rest ran 9 % faster on one (the sampling-distribution tests:
# 154 -> 140 s), so they run apart. Half the main phase is compiling; a compile cache shared by the
# workers and YNNPACK fusions off gave nothing (docs/bench/cpu-test-compile-share-2026-12-04.txt).
test: setup-test
	XLA_FLAGS="$(XLA_FLAGS) --xla_backend_optimization_level=0" $(BIN)/python -m pytest -q -n 2 -m "not timing and not multi_device" --durations=15
	XLA_FLAGS="$(XLA_FLAGS) --xla_backend_optimization_level=0" $(BIN)/python -m pytest -q -n 2 -m multi_device
	$(BIN)/python -m pytest -q -m timing

clean:
	rm -rf $(VENV) checkpoints/code-target-16m checkpoints/code-draft-4m
