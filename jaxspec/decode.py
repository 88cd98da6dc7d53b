"""Plain autoregressive decoding of a padded batch: prefill, then one jitted `lax.while_loop`
that runs until every row has hit EOS or its token budget, or the cache is full.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec.cache import KVCache
from jaxspec.config import ModelConfig
from jaxspec.model import Weights, forward
from jaxspec.sampling import SamplingParams, row_keys, sample_tokens

RUNNING, FINISH_EOS, FINISH_LENGTH, FINISH_PADDING = 0, 1, 2, 3
FINISH_REASONS = {FINISH_EOS: "eos", FINISH_LENGTH: "length"}


@struct.dataclass
class Batch:
    """A padded batch of requests; all arrays are [b] or [b, t]."""

    tokens: jnp.ndarray  # [b, t] int32 prompts, right-padded
    prompt_lens: jnp.ndarray  # [b] int32; 0 marks a padding row
    max_new_tokens: jnp.ndarray  # [b] int32
    sampling: SamplingParams
    seeds: jnp.ndarray  # [b] uint32


@struct.dataclass
class DecodeState:
    cache: KVCache
    last_token: jnp.ndarray  # [b] int32, sampled but not yet in the cache
    out_tokens: jnp.ndarray  # [b, max_out] int32
    num_generated: jnp.ndarray  # [b] int32
    finish: jnp.ndarray  # [b] int32: RUNNING or a FINISH_* code
    steps: jnp.ndarray  # [] int32, target forward passes after prefill


@struct.dataclass
class DecodeOutput:
    tokens: jnp.ndarray  # [b, max_out] int32; row b's first num_generated[b] are real
    num_generated: jnp.ndarray  # [b] int32
    finish: jnp.ndarray  # [b] int32 FINISH_* code
    steps: jnp.ndarray  # [] int32, target forward passes after prefill


def is_eos(tokens: jnp.ndarray, eos_ids: tuple[int, ...]) -> jnp.ndarray:
    hit = jnp.zeros(tokens.shape, bool)
    for e in eos_ids:
        hit |= tokens == e
    return hit


def prefill(weights: Weights, config: ModelConfig, batch: Batch, capacity: int, dtype):
    """Runs the prompts; returns (logits of each row's last prompt token [b, v], cache)."""
    b = batch.tokens.shape[0]
    cache = KVCache.create(config, b, capacity, dtype, stacked=not isinstance(weights.layers, tuple), mesh=weights.mesh)
    logits, cache = forward(weights, config, batch.tokens, cache, logits_at=jnp.maximum(batch.prompt_lens - 1, 0))
    return logits[:, 0], cache.replace(lengths=batch.prompt_lens)


def commit_tokens(state, new: jnp.ndarray, count: jnp.ndarray, batch: Batch, eos_ids):
    """Appends the first count[b] of new [b, m] to each running row of `state`, cut after an EOS
    and at the row's max_new_tokens; returns (state with out_tokens/num_generated/finish updated,
    tokens kept per row [b])."""
    running = state.finish == RUNNING
    j = jnp.arange(new.shape[1])[None, :]
    eos_hit = (j < count[:, None]) & is_eos(new, eos_ids)
    has_eos = jnp.any(eos_hit, axis=1)
    first_eos = jnp.argmax(eos_hit, axis=1)
    kept = jnp.where(has_eos, first_eos + 1, count)
    kept = jnp.where(running, jnp.minimum(kept, batch.max_new_tokens - state.num_generated), 0)
    rows = jnp.arange(new.shape[0])[:, None]
    # Positions past `kept` point outside the buffer and are dropped.
    idx = jnp.where(j < kept[:, None], state.num_generated[:, None] + j, state.out_tokens.shape[1])
    out = state.out_tokens.at[rows, idx].set(new, mode="drop")
    n = state.num_generated + kept
    finish = jnp.where(running & has_eos & (first_eos < kept), FINISH_EOS, state.finish)
    finish = jnp.where((finish == RUNNING) & (n >= batch.max_new_tokens), FINISH_LENGTH, finish)
    return state.replace(out_tokens=out, num_generated=n, finish=finish), kept


def _record(state: DecodeState, token: jnp.ndarray, batch: Batch, eos_ids) -> DecodeState:
    """Appends one token to every running row."""
    state, _ = commit_tokens(state, token[:, None], jnp.ones_like(token), batch, eos_ids)
    return state.replace(last_token=token)


def start(weights: Weights, config: ModelConfig, batch: Batch, capacity: int, max_out: int,
          greedy_only: bool) -> DecodeState:
    """Prefill and the first token: the loop state of a fresh batch (padding rows finished)."""
    b = batch.tokens.shape[0]
    logits, cache = prefill(weights, config, batch, capacity, weights.embed.dtype)
    zeros = jnp.zeros((b,), jnp.int32)
    state = DecodeState(
        cache=cache,
        last_token=zeros,
        out_tokens=jnp.full((b, max_out), config.pad_token_id, jnp.int32),
        num_generated=zeros,
        finish=jnp.where(batch.prompt_lens > 0, RUNNING, FINISH_PADDING),
        steps=jnp.zeros((), jnp.int32),
    )
    first = sample_tokens(logits, batch.sampling, row_keys(batch.seeds, zeros), greedy_only)
    return _record(state, first, batch, config.eos_token_ids)


def fits(s: DecodeState) -> jnp.ndarray:
    """[b]: a step has room in the cache (running rows only matter)."""
    return s.cache.lengths + 1 <= s.cache.capacity


def step(weights: Weights, config: ModelConfig, batch: Batch, s: DecodeState, greedy_only: bool,
         attention: str) -> DecodeState:
    """One token for every running row."""
    running = s.finish == RUNNING
    logits, cache = forward(weights, config, s.last_token[:, None], s.cache, attention=attention)
    cache = cache.replace(lengths=cache.lengths + running)
    keys = row_keys(batch.seeds, s.num_generated)
    token = sample_tokens(logits[:, 0], batch.sampling, keys, greedy_only)
    return _record(s.replace(cache=cache, steps=s.steps + 1), token, batch, config.eos_token_ids)


@functools.partial(jax.jit, static_argnames=("config", "capacity", "max_out", "greedy_only", "attention"))
def decode(
    weights: Weights,
    batch: Batch,
    *,
    config: ModelConfig,
    capacity: int,
    max_out: int,
    greedy_only: bool,
    attention: str = "xla",
) -> DecodeOutput:
    """Prefill + the whole decode loop as one compiled graph."""
    state = start(weights, config, batch, capacity, max_out, greedy_only)

    def cond(s: DecodeState):
        running = s.finish == RUNNING
        return jnp.any(running) & jnp.all(jnp.where(running, fits(s), True))

    state = jax.lax.while_loop(cond, lambda s: step(weights, config, batch, s, greedy_only, attention), state)
    # Rows still running stopped because the cache is full.
    finish = jnp.where(state.finish == RUNNING, FINISH_LENGTH, state.finish)
    return DecodeOutput(state.out_tokens, state.num_generated, finish, state.steps)
