"""Fixtures shared across test modules: the embedded real model pair and HumanEval prompts."""

# No persistent compilation cache: on JAX 0.10.2 its reads and its writes each segfaulted a test
# worker here (2026-12-01: jax's compilation_cache get_executable_and_time twice, then
# put_executable_and_time on a speculative graph), for a 12 % gain on two modules.

import jax
import pytest

import jaxspec
from jaxspec.defaults import CHECKPOINTS
from jaxspec.humaneval import load_prompts


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
