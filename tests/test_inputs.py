"""Bad input raises a clear InputError naming the field and what is allowed."""

import pytest

import jaxspec
from jaxspec.defaults import CHECKPOINTS

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def model():
    return jaxspec.load(CHECKPOINTS / "hf" / "code-draft-4m", dtype="float32")


@pytest.mark.parametrize(
    "prompts, kwargs, match",
    [
        ([""], {}, r"prompts\[0\] is empty"),
        (["ok", []], {}, r"prompts\[1\] is empty"),
        ([], {}, "non-empty list"),
        ("a bare string", {}, "non-empty list"),
        ([[1, 2, 8192]], {}, r"prompts\[0\] contains token id 8192 outside the vocabulary \[0, 8192\)"),
        ([[-1]], {}, r"token id -1 outside the vocabulary"),
        ([[1.5]], {}, r"token id 1.5 outside the vocabulary"),
        ([[5] * 2049], {}, r"prompts\[0\] has 2049 tokens, longer than the model's context of 2048"),
        ([[5] * 2000], {"max_new_tokens": 100}, r"max_new_tokens=100 .* at most 48"),
        (["x"], {"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1; got 0"),
        (["x"], {"max_new_tokens": 2.5}, "max_new_tokens must be an integer"),
        (["x"], {"temperature": -0.1}, "temperature must be a finite number >= 0"),
        (["x"], {"temperature": float("nan")}, "temperature must be a finite number"),
        (["x"], {"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        (["x"], {"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        (["x"], {"top_k": -2}, r"top_k must be an integer >= -1 \(0 or -1 = off\)"),
        (["x"], {"min_p": 2}, r"min_p must be in \[0, 1\] \(0 = off\); got 2"),
        (["x"], {"top_q": 0.5}, r"generate\(\) got an unknown keyword 'top_q'"),
        (["x"], {"sampling": "greedy"}, "sampling must be a jaxspec.SamplingParams"),
        (["x", "y"], {"seed": [1]}, "seed has 1 entries for 2 prompts"),
        (["x"], {"seed": -3}, r"seed must be an integer in \[0, 2\*\*32\)"),
        ([{"text": "x"}], {}, r"prompts\[0\] must be a str or a list of token ids"),
        (["x"], {"max_batch_size": 0}, "max_batch_size must be an integer >= 1"),
    ],
)
def test_bad_generate_input(model, prompts, kwargs, match):
    with pytest.raises(jaxspec.InputError, match=match):
        jaxspec.generate(prompts, model, **kwargs)


def test_bad_dtype():
    with pytest.raises(jaxspec.InputError, match="dtype 'int8' is not supported; allowed: float32, bfloat16"):
        jaxspec.load(CHECKPOINTS / "hf" / "code-draft-4m", dtype="int8")


def test_errors_are_value_errors():
    # Callers that already catch ValueError keep working.
    assert issubclass(jaxspec.InputError, ValueError)
    assert issubclass(jaxspec.CheckpointError, ValueError)
