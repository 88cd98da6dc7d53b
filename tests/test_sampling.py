"""The sampling transform against HF's logits warpers, and the sampler's exact distribution."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from scipy import stats as sps
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from jaxspec.decoding.sampling import (
    SamplingArrays,
    filtered_logits,
    row_keys,
    sample_tokens,
    target_probs,
)
from jaxspec.sampling_params import SamplingParams

SETTINGS = [  # (temperature, top_k, top_p)
    (1.0, 0, 1.0),
    (0.7, 5, 1.0),
    (1.3, 0, 0.8),
    (0.5, 20, 0.6),
]


def _params(settings):
    t, k, p = zip(*settings)
    return SamplingArrays.of([SamplingParams(temperature=t_, top_k=k_, top_p=p_) for t_, k_, p_ in settings])


def _hf_filtered(logits: np.ndarray, temperature, top_k, top_p) -> np.ndarray:
    scores = torch.from_numpy(logits.copy())[None]
    ids = torch.zeros((1, 1), dtype=torch.long)
    scores = TemperatureLogitsWarper(temperature)(ids, scores)
    if top_k:
        scores = TopKLogitsWarper(top_k)(ids, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(ids, scores)
    return scores[0].numpy()


def test_filter_matches_hf_warpers():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(len(SETTINGS), 512)).astype(np.float32) * 3
    ours = np.asarray(filtered_logits(jnp.asarray(logits), _params(SETTINGS)))
    for row, (t, k, p) in enumerate(SETTINGS):
        ref = _hf_filtered(logits[row], t, k, p)
        np.testing.assert_array_equal(np.isfinite(ours[row]), np.isfinite(ref))
        kept = np.isfinite(ref)
        np.testing.assert_allclose(ours[row][kept], ref[kept], rtol=1e-6)
        assert kept.sum() >= 1


@pytest.mark.parametrize("settings", [SETTINGS[:1], [(1.0, 0, 1.0), (0.0, 0, 1.0)]], ids=["one", "with-greedy"])
def test_rows_that_do_not_filter_skip_the_sort_and_match_hf(settings):
    """No row filters: the batch takes the branch without the sort, with HF's result all the same."""
    logits = np.random.default_rng(1).normal(size=(len(settings), 512)).astype(np.float32) * 3
    ours = np.asarray(jax.jit(filtered_logits)(jnp.asarray(logits), _params(settings)))
    for row, (t, k, p) in enumerate(settings):
        np.testing.assert_allclose(ours[row], _hf_filtered(logits[row], t or 1.0, k, p), rtol=1e-6)


def _draw(logits, settings, n):
    """n independent draws per row, each from its own seed (as per-request streams are)."""
    params = _params(settings)
    rows = len(settings)

    def one(i):
        keys = row_keys(jnp.full((rows,), i, jnp.uint32), jnp.zeros((rows,), jnp.int32))
        return sample_tokens(logits, params, keys, greedy_only=False)

    return np.asarray(jax.jit(jax.vmap(one))(jnp.arange(n, dtype=jnp.uint32)))  # [n, rows]


def _chi2_pvalue(samples: np.ndarray, probs: np.ndarray) -> float:
    counts = np.bincount(samples, minlength=len(probs))
    support = probs > 0
    assert counts[~support].sum() == 0, "drew a token outside the filtered support"
    expected = probs[support] / probs[support].sum() * len(samples)
    return sps.chisquare(counts[support], expected).pvalue


N = 200_000


def test_sampler_matches_exact_distribution():
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(size=(len(SETTINGS), 12)).astype(np.float32) * 1.5)
    probs = np.asarray(target_probs(logits, _params(SETTINGS)), np.float64)
    draws = _draw(logits, SETTINGS, N)
    for row in range(len(SETTINGS)):
        assert _chi2_pvalue(draws[:, row], probs[row]) > 1e-4, SETTINGS[row]


def test_chi_square_detects_a_one_percent_bias():
    """The same test rejects a sampler that moves 1 % of the mass between two tokens."""
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(size=(1, 12)).astype(np.float32) * 1.5)
    probs = np.asarray(target_probs(logits, _params(SETTINGS[:1])), np.float64)[0]
    biased = probs.copy()
    biased[np.argmax(probs)] -= 0.01
    biased[np.argmin(probs)] += 0.01
    draws = np.random.default_rng(2).choice(len(probs), size=N, p=biased / biased.sum())
    assert _chi2_pvalue(draws, probs) < 1e-6


def test_greedy_rows_take_argmax_in_mixed_batch():
    rng = np.random.default_rng(3)
    logits = jnp.asarray(rng.normal(size=(2, 64)).astype(np.float32))
    params = SamplingArrays.of([SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)])
    keys = row_keys(jnp.array([5, 5], jnp.uint32), jnp.array([0, 0]))
    out = np.asarray(sample_tokens(logits, params, keys, greedy_only=False))
    assert out[0] == int(np.argmax(np.asarray(logits[0])))


@pytest.mark.parametrize("top_p", [1e-6, 0.3])
def test_top_p_keeps_at_least_the_top_token(top_p):
    logits = jnp.asarray([[0.0, 3.0, 1.0, 2.0]])
    kept = np.isfinite(np.asarray(filtered_logits(logits, _params([(1.0, 0, top_p)]))))[0]
    assert kept[1] and kept.sum() == 1


def _min_p_reference(logits: np.ndarray, temperature: float, min_p: float, top_k: int = 0) -> np.ndarray:
    """vLLM's order in NumPy, float64: temperature, then min-p (p >= min_p * p_max), then top-k."""
    x = logits.astype(np.float64) / temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    keep = p >= min_p * p.max()
    if top_k:
        keep &= x >= np.sort(np.where(keep, x, -np.inf))[-top_k]
    return keep


@pytest.mark.parametrize("temperature, min_p, top_k", [(1.0, 0.05, 0), (0.7, 0.2, 0), (1.3, 0.1, 3), (1.0, 1.0, 0)])
def test_min_p_keeps_what_vllm_keeps(temperature, min_p, top_k):
    logits = np.random.default_rng(4).normal(size=(1, 256)).astype(np.float32) * 3
    params = SamplingArrays.of([SamplingParams(temperature=temperature, min_p=min_p, top_k=top_k)])
    ours = np.asarray(filtered_logits(jnp.asarray(logits), params))[0]
    np.testing.assert_array_equal(np.isfinite(ours), _min_p_reference(logits[0], temperature, min_p, top_k))
    if not top_k:  # alone, it is HF's MinPLogitsWarper too
        ref = MinPLogitsWarper(min_p)(None, TemperatureLogitsWarper(temperature)(None, torch.from_numpy(logits)))
        np.testing.assert_array_equal(np.isfinite(ours), np.isfinite(ref[0].numpy()))


def test_every_token_sampled_with_min_p_is_at_least_min_p_of_the_top():
    logits = jnp.asarray(np.random.default_rng(5).normal(size=(2, 12)).astype(np.float32) * 1.5)
    settings = [SamplingParams(temperature=1.0, min_p=0.2), SamplingParams(temperature=0.8, min_p=0.05)]
    params = SamplingArrays.of(settings)
    rows = len(settings)

    def one(i):
        keys = row_keys(jnp.full((rows,), i, jnp.uint32), jnp.zeros((rows,), jnp.int32))
        return sample_tokens(logits, params, keys, greedy_only=False)

    draws = np.asarray(jax.jit(jax.vmap(one))(jnp.arange(50_000, dtype=jnp.uint32)))
    for row, s in enumerate(settings):
        p = np.asarray(jax.nn.softmax(logits[row] / s.temperature), np.float64)
        assert p[draws[:, row]].min() >= s.min_p * p.max()
        probs = np.asarray(target_probs(logits, params), np.float64)[row]
        assert _chi2_pvalue(draws[:, row], probs) > 1e-4
