"""Fixtures shared across test modules: the embedded real model pair and HumanEval prompts."""

import pytest

import jaxspec
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
