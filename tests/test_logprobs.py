"""Log-probabilities: the chosen token's and the top alternatives' against HF transformers
(teacher-forced, float32), raw and processed, and equal under every drafter to plain decoding's."""

import numpy as np
import pytest
import torch
import transformers

import jaxspec
from jaxspec.defaults import CHECKPOINTS

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
PROMPTS = ["def fibonacci(n):", "import os\n"]
K = 4


@pytest.fixture(scope="module")
def pair():
    return (jaxspec.load(CHECKPOINTS / "hf" / "code-target-16m", dtype="float32"),
            jaxspec.load(CHECKPOINTS / "hf" / "code-draft-4m", dtype="float32"))


def hf_logits(prompt_ids, new_ids) -> np.ndarray:
    """HF's logits [len(new_ids), v] for each generated token, one teacher-forced full forward."""
    model = transformers.AutoModelForCausalLM.from_pretrained(CHECKPOINTS / "hf" / "code-target-16m",
                                                              torch_dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt_ids) + list(new_ids)])).logits[0].double().numpy()
    return logits[len(prompt_ids) - 1 : -1]


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_logprobs_match_hf(pair, mode):
    target, _ = pair
    sampling = jaxspec.SamplingParams(temperature=0.7, top_k=8, max_tokens=10, seed=3, logprobs=K, logprobs_mode=mode)
    out = jaxspec.generate(PROMPTS[:1], target, sampling=sampling)[0]
    logits = hf_logits(target.tokenizer.encode(PROMPTS[0]), out.token_ids)
    if mode == "raw_logprobs":
        ref = log_softmax(logits)
    else:  # temperature, then top-k: the distribution the token was drawn from
        x = logits / 0.7
        x = np.where(x >= np.sort(x, -1)[:, -8][:, None], x, -np.inf)
        ref = log_softmax(x)
    assert len(out.logprobs) == len(out.token_ids)
    for i, (entry, token) in enumerate(zip(out.logprobs, out.token_ids)):
        assert abs(entry[token] - ref[i, token]) < 1e-4
        top = set(np.argsort(-ref[i])[:K].tolist())
        assert set(entry) == top | {token}
        for t in top:
            assert abs(entry[t] - ref[i, t]) < 1e-4


@pytest.mark.parametrize("drafter", ["model K=3", "ngram K=6", "model tree"])
def test_logprobs_under_speculation_equal_plain(pair, drafter):
    target, draft = pair
    how = {"model K=3": (draft, dict(num_draft_tokens=3)), "ngram K=6": ("ngram", dict(num_draft_tokens=6)),
           "model tree": (draft, dict(tree="binary-3"))}[drafter]
    kw = dict(max_new_tokens=16, logprobs=2, warn_below_acceptance=0.0)
    plain = jaxspec.generate(PROMPTS, target, **kw)
    spec = jaxspec.generate(PROMPTS, target, how[0], **kw, **how[1])
    for a, b in zip(plain, spec):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.keys() == y.keys()
            assert max(abs(x[t] - y[t]) for t in x) < 1e-4


def test_logprobs_settings_are_checked(pair):
    for bad, match in ((dict(logprobs=-1), r"logprobs must be an integer in \[0, 20\]; got -1"),
                       (dict(logprobs=21), r"logprobs must be an integer in \[0, 20\]; got 21"),
                       (dict(logprobs_mode="logits"), r"logprobs_mode must be one of raw_logprobs, processed_logprobs")):
        with pytest.raises(jaxspec.InputError, match=match):
            jaxspec.SamplingParams(**bad)
    outs = jaxspec.generate(PROMPTS, pair[0], sampling=[jaxspec.SamplingParams(temperature=0, max_tokens=4),
                                                        jaxspec.SamplingParams(temperature=0, max_tokens=4, logprobs=0)])
    assert outs[0].logprobs is None and [list(e) for e in outs[1].logprobs] == [[t] for t in outs[1].token_ids]


def test_prompt_logprobs_match_hf(pair):
    target, draft = pair
    outs = jaxspec.generate(PROMPTS, target, draft, max_new_tokens=4, prompt_logprobs=3)
    for prompt, out in zip(PROMPTS, outs):
        ids = target.tokenizer.encode(prompt)
        ref = log_softmax(hf_logits(ids[:1], ids[1:]))  # the logits before each prompt token past the first
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
        for i, entry in enumerate(out.prompt_logprobs[1:]):
            token = ids[i + 1]
            assert abs(entry[token] - ref[i, token]) < 1e-4
            assert set(entry) == set(np.argsort(-ref[i])[:3].tolist()) | {token}
    assert jaxspec.generate(PROMPTS[:1], target, max_new_tokens=2)[0].prompt_logprobs is None
