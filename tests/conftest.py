"""Fixtures shared across test modules: the embedded real model pair and HumanEval prompts."""

import tempfile
from pathlib import Path

import jax
import pytest

# Four CPU devices for the tensor-parallel tests (before any JAX computation); everything else
# runs on the first, as it would with one.
jax.config.update("jax_num_cpu_devices", 4)
# Compiled graphs on disk, shared by the xdist workers (both build many of the same graphs):
# 12 % off the speculative and tree modules' wall time on two workers.
jax.config.update("jax_compilation_cache_dir", str(Path(tempfile.gettempdir()) / "jaxspec-tests-jit-cache"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
jax.config.update("jax_compilation_cache_max_size", 512 * 2**20)

import jaxspec  # noqa: E402
from jaxspec.defaults import CHECKPOINTS
from jaxspec.humaneval import load_prompts


@pytest.fixture(scope="session")
def real_pair():
    """(target, draft): the embedded code models, float32, loaded once per test session."""
    target = jaxspec.load(CHECKPOINTS / "hf" / "code-target-16m", dtype="float32")
    draft = jaxspec.load(CHECKPOINTS / "hf" / "code-draft-4m", dtype="float32")
    return target, draft


@pytest.fixture(scope="session")
def humaneval20():
    return load_prompts(limit=20)
