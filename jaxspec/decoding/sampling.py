"""Per-row sampling settings on the device, the logits transform (temperature -> min-p -> top-k ->
top-p, in vLLM's order) and per-request PRNG streams, all in float32.

A row's random stream depends only on its seed and on the index of the token being drawn, so a
seeded request produces the same text whatever else shares its batch.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec.sampling_params import SamplingParams, row_values


@struct.dataclass
class SamplingArrays:
    """The per-row values [b] of every jaxspec.SamplingParams field the loop reads (its `row`
    fields: temperature, top_p, top_k, min_p, ...), read as attributes (`params.top_k`)."""

    values: dict  # field name -> [b] array

    def __getattr__(self, name):
        try:
            return self.__dict__["values"][name]
        except KeyError:
            raise AttributeError(name) from None

    @classmethod
    def of(cls, params: Sequence[SamplingParams], rows: int | None = None) -> "SamplingArrays":
        """The arrays of `params`, one row each, padded with neutral rows to `rows`."""
        return cls({k: jnp.asarray(v) for k, v in row_values(params, rows or len(params)).items()})


def filtered_logits(logits: jnp.ndarray, params: SamplingArrays) -> jnp.ndarray:
    """logits [b, ..., v] -> float32 logits / temperature with filtered tokens at -inf.

    Rows with temperature 0 are left at temperature 1 (they are decoded greedily anyway).
    """
    x = logits.astype(jnp.float32)
    extra = (1,) * (x.ndim - 2)  # broadcast per-row settings over middle axes
    temp = jnp.where(params.temperature > 0, params.temperature, 1.0).reshape((-1,) + extra + (1,))
    x = x / temp
    # The filters sort the vocabulary at every position (a verify pass: K + 1 of them per row),
    # which cost a sampled CPU round more than the model: skipped when no row filters.
    filtering = jnp.any((params.top_k > 0) | (params.top_p < 1.0) | (params.min_p > 0))
    return jax.lax.cond(filtering, functools.partial(_filter, params=params, extra=extra), lambda x: x, x)


def _filter(x: jnp.ndarray, params: SamplingArrays, extra: tuple) -> jnp.ndarray:
    """x (logits / temperature) with the tokens that min-p, top-k and top-p drop at -inf."""
    vocab = x.shape[-1]
    # min-p (vLLM's, before top-k/top-p): keep p >= min_p * p_max; the top token always stays.
    probs = jax.nn.softmax(x, axis=-1)
    min_p = params.min_p.reshape((-1,) + extra + (1,))
    x = jnp.where(probs >= min_p * jnp.max(probs, axis=-1, keepdims=True), x, -jnp.inf)
    desc = -jnp.sort(-x, axis=-1)  # [b, ..., v] descending
    # top-k: keep everything >= the k-th largest (ties kept, as HF does).
    k = jnp.where(params.top_k > 0, jnp.minimum(params.top_k, vocab), vocab).reshape((-1,) + extra + (1,))
    kth = jnp.take_along_axis(desc, k - 1, axis=-1)
    desc = jnp.where(desc >= kth, desc, -jnp.inf)
    # top-p: keep the smallest head of the sorted distribution whose mass reaches p (the token
    # that crosses p is kept): rank r stays iff the mass strictly above it is < p.
    probs = jax.nn.softmax(desc, axis=-1)
    mass_above = jnp.cumsum(probs, axis=-1) - probs
    top_p = params.top_p.reshape((-1,) + extra + (1,))
    # top_p == 1 keeps everything: float32 cumulative sums can reach 1 before the tail ends.
    keep = (mass_above < top_p) | (top_p >= 1.0)
    keep = keep.at[..., 0].set(True)
    floor = jnp.min(jnp.where(keep, desc, jnp.inf), axis=-1, keepdims=True)
    return jnp.where((x >= kth) & (x >= floor), x, -jnp.inf)


def target_probs(logits: jnp.ndarray, params: SamplingArrays) -> jnp.ndarray:
    """The sampling distribution [b, ..., v] float32 that the settings define."""
    return jax.nn.softmax(filtered_logits(logits, params), axis=-1)


def row_keys(seeds: jnp.ndarray, index: jnp.ndarray) -> jnp.ndarray:
    """One PRNG key per row for drawing that row's token number `index` ([b] each)."""
    return jax.vmap(lambda s, i: jax.random.fold_in(jax.random.PRNGKey(s), i))(seeds, index)


def sample_tokens(
    logits: jnp.ndarray,  # [b, v]
    params: SamplingArrays,
    keys: jnp.ndarray,  # [b, 2]
    greedy_only: bool,
) -> jnp.ndarray:
    """[b] int32: argmax for temperature-0 rows, a draw from the filtered distribution otherwise."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if greedy_only:
        return greedy
    drawn = jax.vmap(jax.random.categorical)(keys, filtered_logits(logits, params)).astype(jnp.int32)
    return jnp.where(params.temperature > 0, drawn, greedy)
