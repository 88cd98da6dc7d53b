"""Fixtures shared across test modules: the embedded real model pair and HumanEval prompts."""

import os
import shutil
import tempfile
from pathlib import Path

import jax
import pytest

# Compiled graphs on disk, shared by the xdist workers of one run (both build many of the same
# graphs): 12 % off the speculative and tree modules' wall time on two workers. One folder per
# run: reading an entry written by an earlier run segfaulted a worker twice on 2026-12-01 (inside
# jax's compilation_cache.get_executable_and_time, for graphs with the Pallas kernel in interpret
# mode, whose host callbacks do not survive another process's serialisation).
CACHE_ROOT = Path(tempfile.gettempdir()) / "jaxspec-tests-jit-cache"
jax.config.update("jax_compilation_cache_dir",
                  str(CACHE_ROOT / (os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"pid{os.getpid()}")))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
jax.config.update("jax_compilation_cache_max_size", 512 * 2**20)

import jaxspec  # noqa: E402
from jaxspec.defaults import CHECKPOINTS  # noqa: E402
from jaxspec.humaneval import load_prompts  # noqa: E402


def pytest_unconfigure(config):
    """The controller (or a run without workers) removes the run's compiled graphs, and any left
    by an earlier run that was killed: none is ever read again."""
    if not hasattr(config, "workerinput"):
        shutil.rmtree(CACHE_ROOT, ignore_errors=True)


def pytest_configure(config):
    """Four CPU devices for the tensor-parallel tests (set before any JAX computation; the rest
    runs on the first, as it would with one). Not for the timing tests: with four devices the
    CPU ran the embedded pair's decoding 20-30 % slower (2-core EPYC, JAX 0.10.2), and they
    compare speeds."""
    if config.option.markexpr.strip() != "timing":
        jax.config.update("jax_num_cpu_devices", 4)


@pytest.fixture(scope="session")
def real_pair():
    """(target, draft): the embedded code models, float32, loaded once per test session."""
    target = jaxspec.load(CHECKPOINTS / "hf" / "code-target-16m", dtype="float32")
    draft = jaxspec.load(CHECKPOINTS / "hf" / "code-draft-4m", dtype="float32")
    return target, draft


@pytest.fixture(scope="session")
def humaneval20():
    return load_prompts(limit=20)
