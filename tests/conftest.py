"""Fixtures shared across test modules: the embedded real model pair and HumanEval prompts."""

import jax
import pytest

# Four CPU devices for the tensor-parallel tests (before any JAX computation); everything else
# runs on the first, as it would with one.
jax.config.update("jax_num_cpu_devices", 4)

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
