"""Speculative sampling is lossless: emitted tokens follow the target's sampling distribution.

A tiny random target/draft pair on a 16-token vocabulary; each request samples 3 tokens (the
first from the target's prefill, the next two from one draft -> verify round with K = 2, which
exercises acceptance, rejection + residual, and the bonus token). The empirical joint of tokens
2 and 3 over many seeds is compared with the exact distribution computed from the target's
filtered probabilities over every prefix, by a chi-square test; the same test must reject a
deliberately biased acceptance rule.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as sps
from tiny_models import save_tiny

import jaxspec
import jaxspec.decoding.speculative as speculative
from jaxspec.decoding.acceptance import accept_sampling
from jaxspec.decoding.method import DecodeMethod
from jaxspec.decoding.sampling import SamplingArrays, target_probs
from jaxspec.model.cache import KVCache
from jaxspec.model.forward import forward
from jaxspec.sampling_params import SamplingParams
from jaxspec.serving.requests import Request, samples
from jaxspec.serving.runner import run

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
VOCAB = 16
PROMPT = (3, 7, 1, 12)
N = 40_000
SETTINGS = [
    SamplingParams(temperature=0.8),
    SamplingParams(temperature=1.3, top_k=6),
    SamplingParams(temperature=1.0, top_p=0.8),
    SamplingParams(temperature=1.2, min_p=0.15),  # min_p applies to p and q alike: exact too
]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    base = dict(vocab_size=VOCAB, eos_token_id=None, bos_token_id=None, pad_token_id=0, initializer_range=0.5)
    root = tmp_path_factory.mktemp("pair")
    target = jaxspec.load(save_tiny(root / "t", "llama", base, seed=3), dtype="float32")
    draft = jaxspec.load(save_tiny(root / "d", "llama", {**base, "num_hidden_layers": 1}, seed=4), dtype="float32")
    return target, draft


def penalize(logits, tokens, s: SamplingParams):
    """logits [n, V] after the prompt + generated tokens [n, L]: vLLM's logit bias and penalties,
    written out here (the bias first; repetition over prompt and output, HF's rule; presence and
    frequency over the output, OpenAI's)."""
    vocab = jnp.arange(logits.shape[-1])
    for token, bias in s.logit_bias:
        logits = logits.at[:, token].add(bias)
    counts = jnp.sum(tokens[:, len(PROMPT):, None] == vocab, axis=1)
    seen = (counts > 0) | jnp.any(tokens[:, : len(PROMPT), None] == vocab, axis=1)
    r = s.repetition_penalty
    x = jnp.where(seen, jnp.where(logits > 0, logits / r, logits * r), logits)
    return x - s.frequency_penalty * counts - s.presence_penalty * (counts > 0)


def exact_joint(target, s: SamplingParams) -> np.ndarray:
    """P(token 2 = a, token 3 = b) [VOCAB, VOCAB] under the target's own sampling."""
    params = SamplingArrays.of([s])

    @jax.jit  # one graph per prefix length (op by op, the three passes took 9-13 s on a 2-core CPU)
    def last_probs(weights, tokens):
        cache = KVCache.create(target.config, tokens.shape[0], tokens.shape[1], target.dtype)
        logits, _ = forward(weights, target.config, tokens, cache)
        last = penalize(logits[:, -1], tokens, s)
        return jax.vmap(lambda l: target_probs(l[None], params)[0])(last)

    def probs_after(prefixes: np.ndarray) -> np.ndarray:
        return np.asarray(last_probs(target.weights, jnp.asarray(prefixes, jnp.int32)), np.float64)

    p1 = probs_after(np.array([PROMPT]))[0]  # [V]
    y1 = np.arange(VOCAB)
    p2 = probs_after(np.array([PROMPT + (a,) for a in y1]))  # [V(y1), V(y2)]
    pairs = [(a, b) for a in y1 for b in y1]
    p3 = probs_after(np.array([PROMPT + ab for ab in pairs])).reshape(VOCAB, VOCAB, VOCAB)
    joint = np.einsum("a,ab,abc->bc", p1, p2, p3)
    return joint / joint.sum()


def sampled_joint(target, draft, s: SamplingParams, tree=None, graphs=None, as_n: bool = False) -> np.ndarray:
    """draft: a draft model or jaxspec.ngram.Ngram, K = 2 (or `tree`). N samples, each seeded alone,
    or (as_n) as the n = N samples of one seeded request."""
    if as_n:
        reqs = samples(Request(PROMPT, dataclasses.replace(s, max_tokens=3, seed=5, n=N)))
        assert len({r.seed for r in reqs}) == N and [r.index for r in reqs] == list(range(N))
    else:
        reqs = [Request(PROMPT, dataclasses.replace(s, max_tokens=3, seed=seed)) for seed in range(N)]
    outs = run(target, reqs, 8192, DecodeMethod.of(draft, 2, tree), draft, graphs=graphs)
    counts = np.zeros((VOCAB, VOCAB))
    for o in outs:
        assert len(o.token_ids) == 3
        counts[o.token_ids[1], o.token_ids[2]] += 1
    return counts


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    counts, probs = counts.ravel(), probs.ravel()
    assert counts[probs == 0].sum() == 0, "sampled a token pair the target's filters exclude"
    expected = probs * counts.sum()
    big = expected >= 5  # pool sparse cells so the chi-square approximation holds
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return sps.chisquare(obs, exp).pvalue


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: f"T{s.temperature}-k{s.top_k}-p{s.top_p}-minp{s.min_p}")
def test_speculative_sampling_matches_target_distribution(pair, setting):
    target, draft = pair
    probs = exact_joint(target, setting)
    counts = sampled_joint(target, draft, setting)
    assert chi2_pvalue(counts, probs) > 1e-4


PENALIZED = SamplingParams(temperature=1.0, min_p=0.05, repetition_penalty=1.6, presence_penalty=0.5,
                           frequency_penalty=0.4, logit_bias={2: 1.5, 9: -2.0})


@pytest.mark.parametrize("tree", [None, (-1, 0, 0, 1)], ids=["chain", "tree"])
def test_penalties_and_min_p_keep_speculative_sampling_exact(pair, tree):
    """The penalties (and a logit bias) read the drafted tokens before each position along its path: the joint of
    tokens 2 and 3 (whose penalties depend on tokens 1 and 2) is still the target's. The chain's
    samples are one request's n (SamplingParams.n): each of its streams samples the target too."""
    target, draft = pair
    counts = sampled_joint(target, draft, PENALIZED, tree, as_n=tree is None)
    assert chi2_pvalue(counts, exact_joint(target, PENALIZED)) > 1e-4


def test_the_test_sees_penalties_left_out(pair):
    """Without the penalties the joint differs from the penalized one: the test above could fail."""
    target, draft = pair
    plain = dataclasses.replace(PENALIZED, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0,
                                logit_bias=())
    counts, probs = sampled_joint(target, draft, plain), exact_joint(target, PENALIZED)
    try:
        pvalue = chi2_pvalue(counts, probs)
    except AssertionError:  # it sampled pairs that min_p excludes after the penalties: also caught
        return
    assert pvalue < 1e-6


def sampled_with(module, name: str, replacement, *args) -> np.ndarray:
    """sampled_joint(*args) with module.name replaced inside the decode loop: jit's traces are
    keyed by the function, so they are dropped before (to trace the loop again with the
    replacement) and after (so nothing else runs it), and a graph cache of its own compiles it."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(module, name, replacement)
        jax.clear_caches()
        counts = sampled_joint(*args, graphs=jaxspec.GraphCache())
    jax.clear_caches()
    return counts


def test_the_test_catches_a_biased_acceptance_rule(pair):
    """Accepting drafts 5 % too often skews the output toward the draft: the test must see it."""
    target, draft = pair

    def biased(drafts, q, p, uniforms, keys):
        return accept_sampling(drafts, q, p * 1.05, uniforms, keys)

    setting = SETTINGS[0]
    counts = sampled_with(speculative, "accept_sampling", biased, target, draft, setting)
    assert chi2_pvalue(counts, exact_joint(target, setting)) < 1e-6


@pytest.mark.parametrize("tree", [None, (-1, 0, 0, 1, 2)], ids=["chain", "tree"])
def test_an_eagle3_head_samples_the_target_distribution(pair, tmp_path, tree):
    """A random EAGLE-3 head with a draft vocabulary of 12 of the 16 tokens (d2t-mapped): its q
    is a real distribution, zero off its vocabulary, and the output still follows the target,
    from a chain or from a tree's i.i.d. siblings."""
    from jaxspec.model.eagle import random_eagle_folder

    target, _ = pair
    head = jaxspec.load(random_eagle_folder(tmp_path / "head", target.config, draft_vocab_size=12, seed=5),
                        dtype="float32")
    setting = SETTINGS[0]
    assert chi2_pvalue(sampled_joint(target, head, setting, tree), exact_joint(target, setting)) > 1e-4
