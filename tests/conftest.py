"""Fixtures shared across test modules: the embedded real model pair and HumanEval prompts."""


import gc
import os

# The suite compiles afresh: no persistent compilation cache in ~/.cache (tests of the cache give
# it a folder of their own).
os.environ.setdefault("JAXSPEC_COMPILE_CACHE", "off")

import jax
import pytest

import jaxspec
from jaxspec.bench.humaneval import load_prompts
from jaxspec.defaults import CHECKPOINTS


_SESSION_MODELS: list = []  # models that live through the session: their graphs are dropped per module


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_graphs():
    """Each module's compiled graphs are dropped after it: every XLA CPU executable keeps memory
    maps, and a test worker that kept them all passed Linux's 65 530 maps per process late in
    the run and crashed inside XLA's compiler (segfaults and aborts in test_trees, 2026-12-01).
    A module's own models take their graph caches with them; the session's are cleared here."""
    yield
    for model in _SESSION_MODELS:
        model.graphs.clear()
    jax.clear_caches()
    gc.collect()


def pytest_configure(config):
    """Four CPU devices for the tensor-parallel tests (set before any JAX computation; the rest
    runs on the first, as it would with one). Not for a run that leaves those tests out (`-m
    timing`, `-m "not multi_device"`): with four devices the CPU ran the embedded pair's decoding
    20-30 % slower (2-core EPYC, JAX 0.10.2). A multi_device test run on one device fails on
    the engine's own error (tensor_parallel N needs N devices), never skips."""
    marks = config.option.markexpr.strip()
    if marks != "timing" and "not multi_device" not in marks:
        jax.config.update("jax_num_cpu_devices", 4)


@pytest.fixture(scope="session")
def real_pair():
    """(target, draft): the embedded code models, float32, loaded once per test session."""
    target = jaxspec.load(CHECKPOINTS / "hf" / "code-target-16m", dtype="float32")
    draft = jaxspec.load(CHECKPOINTS / "hf" / "code-draft-4m", dtype="float32")
    _SESSION_MODELS.extend((target, draft))
    return target, draft


@pytest.fixture(scope="session")
def humaneval20():
    return load_prompts(limit=20)
