"""What every decode loop shares: the padded Batch of requests, the finish codes, the prefill
and the commit of new tokens (cut at EOS or a row's stop token, and at each row's budget)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec.decoding.constraints import step_constraints
from jaxspec.decoding.penalties import count_tokens
from jaxspec.decoding.sampling import SamplingArrays
from jaxspec.decoding.stop_strings import step_stops
from jaxspec.model.cache import KVCache
from jaxspec.model.config import ModelConfig
from jaxspec.model.forward import forward
from jaxspec.model.weights import Weights

# FINISH_STOP: the row generated an EOS id or one of its stop token ids (vLLM's and OpenAI's "stop").
RUNNING, FINISH_STOP, FINISH_LENGTH, FINISH_PADDING = 0, 1, 2, 3
FINISH_REASONS = {FINISH_STOP: "stop", FINISH_LENGTH: "length"}


@struct.dataclass
class Batch:
    """A padded batch of requests; all arrays are [b] or [b, t]."""

    tokens: jnp.ndarray  # [b, t] int32 prompts, right-padded
    prompt_lens: jnp.ndarray  # [b] int32; 0 marks a padding row
    max_new_tokens: jnp.ndarray  # [b] int32
    sampling: SamplingArrays
    seeds: jnp.ndarray  # [b] uint32
    stop_ids: jnp.ndarray  # [b, S] int32: each row's stop token ids, -1 past them
    stop_sets: jnp.ndarray  # [b] int32: each row's set of stop strings in stop_tables (0: none)
    stop_tables: "Shared"  # [sets, states, v] the call's stop-string automata (stop_strings.py)
    bias_ids: jnp.ndarray  # [b, B] int32: each row's logit_bias token ids, -1 past them ([b, 0]: none in the call)
    bias_values: jnp.ndarray  # [b, B] float32: their biases
    constraint_sets: jnp.ndarray  # [b] int32: each row's structured-output constraint in constraint_tables (0: none)
    constraint_tables: "Shared"  # a ConstraintTables: the call's compiled constraints (constraints.py)
    prefix: "PrefixUse | None" = None  # rows whose prompt starts with a prefix prefilled once


@struct.dataclass
class Shared:
    """An array that every row of a batch shares: inserting rows (slots.insert_rows) keeps it."""

    value: jnp.ndarray


@struct.dataclass
class PrefixUse:
    """Where a batch's rows find the keys and values of their prompt's shared prefix (computed once
    for the call: serving/prefixes.py), so prefill runs only the rest of each prompt."""

    rows: jnp.ndarray  # [b] int32: the row of `store` holding the row's prefix
    lens: jnp.ndarray  # [b] int32: the prefix's length (0: none, the whole prompt runs)
    suffix: jnp.ndarray  # [b, t] int32: the prompt after the prefix, right-padded
    store: KVCache  # [entries, capacity]: prefill_store's


def is_stop(tokens: jnp.ndarray, eos_ids: tuple[int, ...], stop_ids: jnp.ndarray) -> jnp.ndarray:
    """tokens [b, m] -> [b, m]: an EOS id (static) or one of the row's stop ids (stop_ids [b, S])."""
    hit = jnp.any(tokens[:, :, None] == stop_ids[:, None, :], axis=-1)
    for e in eos_ids:
        hit |= tokens == e
    return hit


def _empty_cache(weights: Weights, config: ModelConfig, rows: int, capacity: int) -> KVCache:
    return KVCache.create(config, rows, capacity, weights.embed.dtype, stacked=not isinstance(weights.layers, tuple),
                          mesh=weights.mesh)


def _prefill_attention(attention: str) -> str:
    """A prefill runs XLA's attention unless the loop is deterministic (whose kernels it must share)."""
    return "deterministic" if attention == "deterministic" else "xla"


def prefill(weights: Weights, config: ModelConfig, batch: Batch, capacity: int, features_at=(),
            attention: str = "xla", prefix: PrefixUse | None = None):
    """Runs the prompts; returns (logits of each row's last prompt token [b, v], cache), and with
    features_at the prompt's features as a third item (forward's). attention: the loop's.
    prefix: the target's shared prefixes (batch.prefix): their keys and values are copied in and
    only the rest of each prompt runs (no features: they exist for the rest only)."""
    cache = _empty_cache(weights, config, batch.tokens.shape[0], capacity)
    tokens, logits_at = batch.tokens, jnp.maximum(batch.prompt_lens - 1, 0)
    if prefix is not None:
        if features_at:
            raise ValueError("a shared prefix has no features to give: prefill such rows whole")
        cache = cache.with_prefix(prefix.store, prefix.rows, prefix.lens)
        tokens, logits_at = prefix.suffix, jnp.maximum(batch.prompt_lens - prefix.lens - 1, 0)
    logits, cache, *features = forward(weights, config, tokens, cache, attention=_prefill_attention(attention),
                                       logits_at=logits_at, features_at=features_at)
    return (logits[:, 0], cache.replace(lengths=batch.prompt_lens), *features)


@functools.partial(jax.jit, static_argnames=("config", "capacity", "attention"))
def prefill_store(weights: Weights, tokens: jnp.ndarray, lens: jnp.ndarray, *, config: ModelConfig, capacity: int,
                  attention: str = "xla") -> KVCache:
    """The keys and values of a call's shared prefixes (tokens [entries, t], right-padded; lens
    [entries]) as a cache of one row each, computed as a prefill computes them."""
    cache = _empty_cache(weights, config, tokens.shape[0], capacity)
    _, cache = forward(weights, config, tokens, cache, attention=_prefill_attention(attention),
                       logits_at=jnp.zeros(tokens.shape[:1], jnp.int32))
    return cache.replace(lengths=lens)


def commit_tokens(state, new: jnp.ndarray, count: jnp.ndarray, batch: Batch, eos_ids, per_token: dict | None = None):
    """Appends the first count[b] of new [b, m] to each running row of `state`, cut after an EOS,
    a stop token or the token that completes a stop string (so a stop inside an accepted chunk
    ends the row there), after the token that completes a row's structured-output constraint, and
    at the row's max_new_tokens; returns (state with out_tokens/num_generated/finish/stop_state/
    constraint_state updated, tokens kept per row [b])."""
    running = state.finish == RUNNING
    m = new.shape[1]
    j = jnp.arange(m)[None, :]
    eos_hit = (j < count[:, None]) & is_stop(new, eos_ids, batch.stop_ids)
    if batch.stop_tables.value.shape[1] > 1:  # some row has stop strings (a static shape: else no work)
        first_string, stop_states = step_stops(batch.stop_tables.value, batch.stop_sets, state.stop_state, new, count)
    else:
        first_string, stop_states = jnp.full(count.shape, m, jnp.int32), jnp.zeros(new.shape, jnp.int32)
    first = jnp.minimum(jnp.where(jnp.any(eos_hit, axis=1), jnp.argmax(eos_hit, axis=1), m), first_string)
    tables = batch.constraint_tables.value
    if tables.on:  # a row has a structured-output constraint: it ends on the token that completes it
        first_done, constraint_states = step_constraints(tables, batch.constraint_sets, state.constraint_state, new,
                                                         count)
        first = jnp.minimum(first, first_done)
    has_stop = first < m
    kept = jnp.where(has_stop, first + 1, count)
    kept = jnp.where(running, jnp.minimum(kept, batch.max_new_tokens - state.num_generated), 0)
    rows = jnp.arange(new.shape[0])[:, None]
    # Positions past `kept` point outside the buffer and are dropped.
    idx = jnp.where(j < kept[:, None], state.num_generated[:, None] + j, state.out_tokens.shape[1])
    out = state.out_tokens.at[rows, idx].set(new, mode="drop")
    # per_token: more state buffers [b, max_out, ...] written beside the tokens (their logprobs)
    written = {name: getattr(state, name).at[rows, idx].set(v, mode="drop") for name, v in (per_token or {}).items()}
    n = state.num_generated + kept
    finish = jnp.where(running & has_stop & (first < kept), FINISH_STOP, state.finish)
    finish = jnp.where((finish == RUNNING) & (n >= batch.max_new_tokens), FINISH_LENGTH, finish)
    # an automaton's state after the last kept token (states after each token [b, m]; none kept: as it was)
    after_kept = lambda states, old: jnp.where(  # noqa: E731
        kept > 0, jnp.take_along_axis(states, jnp.maximum(kept - 1, 0)[:, None], 1)[:, 0], old)
    stop_state = after_kept(stop_states, state.stop_state)
    if tables.on:
        written["constraint_state"] = after_kept(constraint_states, state.constraint_state)
    if state.token_counts.shape[1]:  # a row has a penalty: the loop counts each row's output tokens
        written["token_counts"] = count_tokens(state.token_counts, new, kept)
    return state.replace(out_tokens=out, num_generated=n, finish=finish, stop_state=stop_state, **written), kept
