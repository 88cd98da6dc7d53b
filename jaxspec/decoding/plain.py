"""Plain autoregressive decoding as a Loop (jaxspec.decoding.loop): prefill and the first token,
then one token per step for every running row."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import struct

from jaxspec.decoding.constraints import masked
from jaxspec.decoding.logprobs import LOGPROB_FIELDS, logprob_buffers, token_logprobs
from jaxspec.decoding.penalties import penalized, penalty_buffers, penalty_start
from jaxspec.decoding.sampling import row_keys, sample_tokens
from jaxspec.decoding.state import (
    FINISH_PADDING,
    RUNNING,
    Batch,
    commit_tokens,
    prefill,
)
from jaxspec.model.cache import KVCache
from jaxspec.model.config import ModelConfig
from jaxspec.model.forward import forward
from jaxspec.model.weights import Weights


@struct.dataclass
class DecodeState:
    cache: KVCache
    last_token: jnp.ndarray  # [b] int32, sampled but not yet in the cache
    out_tokens: jnp.ndarray  # [b, max_out] int32
    num_generated: jnp.ndarray  # [b] int32
    finish: jnp.ndarray  # [b] int32: RUNNING or a FINISH_* code
    stop_state: jnp.ndarray  # [b] int32: each row's stop-string automaton state
    constraint_state: jnp.ndarray  # [b] int32: each row's structured-output automaton state (constraints.py)
    out_logprobs: jnp.ndarray  # [b, max_out, 1 + k] float32 (logprobs.py), [b, 0, 0] when not asked for
    out_logprob_ids: jnp.ndarray  # [b, max_out, 1 + k] int32
    token_counts: jnp.ndarray  # [b, v] int32 output counts (penalties.py), [b, 0] when no row has a penalty
    in_prompt: jnp.ndarray  # [b, v] bool, [b, 0] likewise
    logit_bias: jnp.ndarray  # [b, v] float32, [b, 0] likewise


def _record(loop: "PlainLoop", state: DecodeState, logits, scored, token: jnp.ndarray, batch: Batch) -> DecodeState:
    """Appends one token (drawn from `scored`: logits [b, v] after any penalties) to every running
    row, with its logprobs when asked."""
    per_token = None
    if loop.logprobs >= 0:
        lp, ids = token_logprobs(logits[:, None], token[:, None], batch.sampling, loop.logprobs, scored[:, None])
        per_token = {"out_logprobs": lp, "out_logprob_ids": ids}
    state, _ = commit_tokens(state, token[:, None], jnp.ones_like(token), batch, loop.config.eos_token_ids, per_token)
    return state.replace(last_token=token)


@dataclasses.dataclass(frozen=True)
class PlainLoop:
    """The target alone, one token per step. params: unused (no drafter)."""

    config: ModelConfig  # the target's
    logprobs: int = -1  # top alternatives recorded per token (logprobs.py); -1: no logprobs
    penalties: bool = False  # a row has a penalty: the state counts tokens (penalties.py)
    slack = 0  # cache slots a step writes past a row's committed tokens and budget

    @property
    def result_fields(self) -> tuple[str, ...]:
        return ("out_tokens", "num_generated", "finish") + (LOGPROB_FIELDS if self.logprobs >= 0 else ())

    def start(self, weights: Weights, params, batch: Batch, capacity: int, max_out: int,
              greedy_only: bool, attention: str = "xla") -> DecodeState:
        """Prefill and the first token: the loop state of a fresh batch (padding rows finished)."""
        c = self.config
        b = batch.tokens.shape[0]
        logits, cache = prefill(weights, c, batch, capacity, attention=attention, prefix=batch.prefix)
        zeros = jnp.zeros((b,), jnp.int32)
        state = DecodeState(
            cache=cache,
            last_token=zeros,
            out_tokens=jnp.full((b, max_out), c.pad_token_id, jnp.int32),
            num_generated=zeros,
            finish=jnp.where(batch.prompt_lens > 0, RUNNING, FINISH_PADDING),
            stop_state=zeros,
            constraint_state=zeros,
            **logprob_buffers(b, max_out, self.logprobs),
            **penalty_buffers(b, c.vocab_size, self.penalties),
        )
        if self.penalties:
            state = state.replace(**penalty_start(batch, c.vocab_size))
        scored = self._scored(logits, state, batch)
        first = sample_tokens(scored, batch.sampling, row_keys(batch.seeds, zeros), greedy_only)
        return _record(self, state, logits, scored, first, batch)

    def _scored(self, logits, s: DecodeState, batch: Batch):
        """The logits that tokens are drawn from: biased and penalized when a row has a bias or a
        penalty, and masked by the row's structured-output constraint when a row has one."""
        if self.penalties:
            logits = penalized(logits, s.token_counts, s.in_prompt, s.logit_bias, batch.sampling)
        tables = batch.constraint_tables.value
        return masked(logits, tables, batch.constraint_sets, s.constraint_state) if tables.on else logits

    def fits(self, s: DecodeState, batch: Batch) -> jnp.ndarray:
        """[b]: a step has room in the cache (running rows only matter)."""
        return s.cache.lengths + 1 <= s.cache.capacity

    def step(self, weights: Weights, params, batch: Batch, s: DecodeState, greedy_only: bool,
             attention: str) -> DecodeState:
        """One token for every running row."""
        running = s.finish == RUNNING
        logits, cache = forward(weights, self.config, s.last_token[:, None], s.cache, attention=attention)
        cache = cache.replace(lengths=cache.lengths + running)
        keys = row_keys(batch.seeds, s.num_generated)
        scored = self._scored(logits[:, 0], s, batch)
        token = sample_tokens(scored, batch.sampling, keys, greedy_only)
        return _record(self, s.replace(cache=cache), logits[:, 0], scored, token, batch)
