"""Repetition, presence and frequency penalties: against HF's RepetitionPenaltyLogitsProcessor and
OpenAI's formula, per node of a draft tree, and lossless under every drafter."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

import jaxspec
from jaxspec.decoding.penalties import logit_biases, penalized, penalized_nodes
from jaxspec.decoding.sampling import SamplingArrays
from jaxspec.decoding.trees import ancestor_mask
from jaxspec.defaults import CHECKPOINTS
from jaxspec.sampling_params import SamplingParams
from jaxspec.serving.batching import make_batch
from jaxspec.serving.requests import Request

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
PROMPTS = ["def fibonacci(n):", "import os\n"]


@pytest.fixture(scope="module")
def pair():
    return (jaxspec.load(CHECKPOINTS / "hf" / "code-target-16m", dtype="float32"),
            jaxspec.load(CHECKPOINTS / "hf" / "code-draft-4m", dtype="float32"))


def openai(logits, counts, in_prompt, s: SamplingParams):
    """NumPy, float64: OpenAI's logit bias, HF's repetition rule over prompt and output, then
    OpenAI's presence and frequency."""
    x = logits.astype(np.float64)
    for token, bias in s.logit_bias:
        x[token] += bias
    r = s.repetition_penalty
    x = np.where((counts > 0) | in_prompt, np.where(x > 0, x / r, x * r), x)
    return x - s.frequency_penalty * counts - s.presence_penalty * (counts > 0)


def biases(settings, vocab: int):
    """The loop's [b, v] biases of these settings, built as make_batch and the loop build them."""
    batch = make_batch([Request((1,), s) for s in settings], len(settings), 16, 0)
    return logit_biases(batch.bias_ids, batch.bias_values, vocab)


def test_penalized_logits_follow_the_formulas():
    rng = np.random.default_rng(0)
    settings = [SamplingParams(presence_penalty=0.7, frequency_penalty=0.3, logit_bias={3: -100, 40: 2.5}),
                SamplingParams(repetition_penalty=1.4, presence_penalty=-0.5, frequency_penalty=1.2)]
    logits = rng.normal(size=(2, 64)).astype(np.float32) * 3
    counts = rng.integers(0, 3, size=(2, 64)) * (rng.random((2, 64)) < 0.3)
    in_prompt = rng.random((2, 64)) < 0.2
    got = np.asarray(penalized(jnp.asarray(logits), jnp.asarray(counts, jnp.int32), jnp.asarray(in_prompt),
                               biases(settings, 64), SamplingArrays.of(settings)))
    for row, s in enumerate(settings):
        np.testing.assert_allclose(got[row], openai(logits[row], counts[row], in_prompt[row], s), atol=1e-6)


def test_each_tree_node_is_penalized_with_the_drafts_on_its_path():
    rng = np.random.default_rng(1)
    parents = (-1, 0, 0, 1, 3, 2)
    tokens = np.array([[5, 7, 7, 5, 9, 3]])  # repeats on and across paths
    s = SamplingParams(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.6, logit_bias={7: 1.5, 2: -3})
    logits = rng.normal(size=(1, len(parents), 16)).astype(np.float32) * 3
    counts = np.zeros((1, 16), np.int64)
    counts[0, [5, 3]] = [2, 1]  # committed output (node 0's token 5 among them)
    in_prompt = np.zeros((1, 16), bool)
    in_prompt[0, [1, 9]] = True
    got = np.asarray(penalized_nodes(jnp.asarray(logits), jnp.asarray(tokens), parents, jnp.asarray(counts, jnp.int32),
                                     jnp.asarray(in_prompt), biases([s], 16), SamplingArrays.of([s])))
    mask = ancestor_mask(parents)
    for i in range(len(parents)):
        own = counts[0].copy()
        for j in range(1, len(parents)):
            if mask[i, j]:
                own[tokens[0, j]] += 1
        np.testing.assert_allclose(got[0, i], openai(logits[0, i], own, in_prompt[0], s), atol=1e-6)


def test_greedy_with_repetition_penalty_is_hfs_argmax_at_every_position(pair):
    target, _ = pair
    out = jaxspec.generate(PROMPTS[:1], target, max_new_tokens=24, repetition_penalty=1.5)[0]
    plain = jaxspec.generate(PROMPTS[:1], target, max_new_tokens=24)[0]
    assert out.token_ids != plain.token_ids  # the penalty changed the text
    prompt = target.tokenizer.encode(PROMPTS[0])
    model = transformers.AutoModelForCausalLM.from_pretrained(CHECKPOINTS / "hf" / "code-target-16m",
                                                              torch_dtype=torch.float32)
    ids = torch.tensor([prompt + out.token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0]
    process = RepetitionPenaltyLogitsProcessor(1.5)
    for i, token in enumerate(out.token_ids):
        at = len(prompt) + i
        scores = process(ids[:, :at], logits[at - 1][None].clone())
        assert int(scores.argmax()) == token, f"position {i}"


@pytest.mark.parametrize("drafter", ["model K=3", "ngram K=6", "model tree", "eagle K=3"])
def test_greedy_with_penalties_and_stops_equals_plain(pair, drafter):
    target, draft = pair
    kw = dict(max_new_tokens=32, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3,
              stop=["return 0"], logprobs=1, warn_below_acceptance=0.0, logit_bias={199: -4.0, 12: 2.0})
    plain = jaxspec.generate(PROMPTS, target, **kw)
    if drafter.startswith("eagle"):
        draft = jaxspec.load(CHECKPOINTS / "hf" / "code-eagle-16m", dtype="float32")
    draft_arg, how = {"model K=3": (draft, dict(num_draft_tokens=3)), "ngram K=6": ("ngram", dict(num_draft_tokens=6)),
                      "model tree": (draft, dict(tree="binary-3")), "eagle K=3": (draft, dict(num_draft_tokens=3))}[drafter]
    spec = jaxspec.generate(PROMPTS, target, draft_arg, **kw, **how)
    for a, b in zip(spec, plain):
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.keys() == y.keys() and max(abs(x[t] - y[t]) for t in x) < 1e-4


def test_logit_bias_forces_and_forbids_tokens(pair):
    target, draft = pair
    free = jaxspec.generate(PROMPTS, target, max_new_tokens=8)
    banned = jaxspec.generate(PROMPTS, target, max_new_tokens=8, logit_bias={free[0].token_ids[0]: -100})
    assert banned[0].token_ids[0] != free[0].token_ids[0]
    forced = jaxspec.generate(PROMPTS, target, draft, max_new_tokens=6, logit_bias={"42": 100})
    assert [o.token_ids for o in forced] == [[42] * 6] * 2
    with pytest.raises(jaxspec.InputError, match=r"logit_bias token id 9000 is outside the vocabulary \[0, 8192\)"):
        jaxspec.generate(PROMPTS, target, logit_bias={9000: 1})


def test_bad_penalties_are_named():
    for bad, match in ((dict(repetition_penalty=0), r"repetition_penalty must be a number > 0 \(1 = off\); got 0"),
                       (dict(presence_penalty=2.5), r"presence_penalty must be in \[-2, 2\]"),
                       (dict(frequency_penalty=float("nan")), r"frequency_penalty must be in \[-2, 2\]"),
                       (dict(logit_bias={5: 101}), r"logit_bias\[5\] must be a number in \[-100, 100\]; got 101"),
                       (dict(logit_bias={"x": 1}), r"logit_bias key must be an integer >= 0 \(a token id\); got 'x'"),
                       (dict(logit_bias=[3]), r"logit_bias must be an object of token ids to biases")):
        with pytest.raises(jaxspec.InputError, match=match):
            SamplingParams(**bad)
