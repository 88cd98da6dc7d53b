"""Log-probabilities of the tokens a loop commits: the chosen token's and the top k alternatives',
from the distribution each was drawn from (a plain step's logits, or the verify pass's at the
token's node on the accepted path), so speculation reports what plain decoding would.

Per row, "raw_logprobs" (vLLM's default) are the target's log-softmax before any setting;
"processed_logprobs" after temperature and the filters (SamplingArrays.logprobs_mode)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.decoding.sampling import SamplingArrays, filtered_logits


def fixed_order_log_softmax(x: jnp.ndarray) -> jnp.ndarray:
    """log_softmax over the last axis whose sum has one order for any leading shape: a pairwise tree
    of elementwise adds. XLA's reduce picks its order by shape, so a verify pass's rows and a plain
    step's summed the same logits differently (4.8e-7 apart); deterministic mode promises bits."""
    x = x.astype(jnp.float32)
    shifted = x - jnp.max(x, axis=-1, keepdims=True)  # a max is exact in any order
    e = jnp.exp(shifted)
    v = e.shape[-1]
    e = jnp.pad(e, [(0, 0)] * (e.ndim - 1) + [(0, (1 << (v - 1).bit_length()) - v)])
    while e.shape[-1] > 1:
        half = e.shape[-1] // 2
        e = e[..., :half] + e[..., half:]
    return shifted - jnp.log(e)


def token_logprobs(logits: jnp.ndarray, chosen: jnp.ndarray, params: SamplingArrays, k: int, penalized=None):
    """logits [b, m, v], chosen [b, m] -> (log-probabilities [b, m, 1 + k] float32, their token ids
    [b, m, 1 + k] int32): the chosen token first, then the k most likely, most likely first.
    penalized: the logits after the penalties, where a row has them (processed logprobs start there)."""
    raw = fixed_order_log_softmax(logits)
    processed = fixed_order_log_softmax(filtered_logits(logits if penalized is None else penalized, params))
    x = jnp.where(params.logprobs_mode[:, None, None], processed, raw)
    chosen_lp = jnp.take_along_axis(x, chosen[..., None], axis=-1)
    top_lp, top_ids = jax.lax.top_k(x, k)
    return (jnp.concatenate([chosen_lp, top_lp], axis=-1),
            jnp.concatenate([chosen[..., None], top_ids.astype(jnp.int32)], axis=-1))


LOGPROB_FIELDS = ("out_logprobs", "out_logprob_ids")  # the loop state's buffers, read back with the tokens


def logprob_buffers(b: int, max_out: int, k: int) -> dict:
    """The loop state's empty logprob buffers, filled by commit_tokens ([b, 0, 0] for k < 0: none)."""
    shape = (b, max_out, 1 + k) if k >= 0 else (b, 0, 0)
    return {"out_logprobs": jnp.zeros(shape, jnp.float32), "out_logprob_ids": jnp.zeros(shape, jnp.int32)}
