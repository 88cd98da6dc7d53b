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
# The correctness tests spend much of their time compiling small graphs that each run briefly, so
# they take the cheapest compiles: LLVM's O0 backend (the suite 32 -> 27 min on this 2-core
# machine; docs/bench/cpu-test-durations-o0-vs-default.txt) and XLA's older CPU fusion emitters,
# about 3x faster to compile, slower to run (main phase 1359 -> 1081 s, multi_device 114 -> 84 s;
# docs/bench/cpu-test-fusion-emitters-2026-12-04.txt). The timing tests keep XLA's defaults.
# Only the tensor-parallel tests need the CPU's four virtual devices (tests/conftest.py), and the
# rest ran 9 % faster on one, so they run apart. A compile cache shared by the workers and
# YNNPACK fusions off gave nothing (docs/bench/cpu-test-compile-share-2026-12-04.txt).
TEST_XLA_FLAGS = $(XLA_FLAGS) --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false
test: setup-test
	XLA_FLAGS="$(TEST_XLA_FLAGS)" $(BIN)/python -m pytest -q -n 2 -m "not timing and not multi_device" --durations=15
	XLA_FLAGS="$(TEST_XLA_FLAGS)" $(BIN)/python -m pytest -q -n 2 -m multi_device
	$(BIN)/python -m pytest -q -m timing

clean:
	rm -rf $(VENV) checkpoints/code-target-16m checkpoints/code-draft-4m
