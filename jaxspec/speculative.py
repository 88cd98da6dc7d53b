"""Speculative decoding: draft -> verify -> accept -> commit, all inside one jitted while_loop.

Per row, with n committed tokens s[0..n): both caches hold s[0..n-1) (lengths n - 1) and s[n-1]
is pending. Each round:
  1. the draft re-reads [s[n-2], s[n-1]] (rewriting slot n-2 with identical K/V fills the one
     hole left when the previous round accepted all K drafts, which the draft never ran), then
     proposes K tokens with a `lax.scan` of single-token steps;
  2. the target scores [s[n-1], d1 .. dK] in one forward pass;
  3. the accepted prefix plus one target token is committed (cut at EOS / max_new_tokens), and
     both caches advance by exactly that; rejected entries are overwritten next round.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec.acceptance import accept_greedy, accept_sampling
from jaxspec.cache import KVCache
from jaxspec.config import ModelConfig
from jaxspec.decode import FINISH_LENGTH, FINISH_PADDING, RUNNING, Batch, commit_tokens, prefill
from jaxspec.model import Weights, forward
from jaxspec.sampling import SamplingParams, filtered_logits, row_keys, sample_tokens
from jaxspec.tree_speculative import TreePlan, path_to, accept_tree_greedy, accept_tree_sampling, draft_tree, move_path
from jaxspec.trees import Tree, ancestor_mask, chain


@struct.dataclass
class SpecState:
    target_cache: KVCache
    draft_cache: KVCache
    prev_token: jnp.ndarray  # [b] s[n-2]
    last_token: jnp.ndarray  # [b] s[n-1], pending in both caches
    out_tokens: jnp.ndarray  # [b, max_out]
    num_generated: jnp.ndarray  # [b]
    finish: jnp.ndarray  # [b]
    rounds: jnp.ndarray  # [b] target verify passes while the row was running
    accepted_per_position: jnp.ndarray  # [b, D] accepted at draft position / tree depth j + 1


@struct.dataclass
class SpecOutput:
    tokens: jnp.ndarray  # [b, max_out]
    num_generated: jnp.ndarray  # [b]
    finish: jnp.ndarray  # [b]
    rounds: jnp.ndarray  # [b] verify passes (prefill excluded)
    accepted_per_position: jnp.ndarray  # [b, D]: D = K for a chain, the depth for a tree


def _pick(logits: jnp.ndarray, sampling: SamplingParams, keys: jnp.ndarray, greedy_only: bool):
    """Draft choice at one position: ([b] tokens, [b, v] distribution drawn from, or None)."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if greedy_only:
        return greedy, None
    filtered = filtered_logits(logits, sampling)
    drawn = jax.vmap(jax.random.categorical)(keys, filtered).astype(jnp.int32)
    is_greedy = sampling.temperature == 0
    token = jnp.where(is_greedy, greedy, drawn)
    one_hot = jax.nn.one_hot(greedy, logits.shape[-1], dtype=jnp.float32)
    q = jnp.where(is_greedy[:, None], one_hot, jax.nn.softmax(filtered, axis=-1))
    return token, q


def draft_chain(
    weights: Weights, config: ModelConfig, cache: KVCache, n: jnp.ndarray,
    prev: jnp.ndarray, last: jnp.ndarray, sampling: SamplingParams, keys: jnp.ndarray,
    greedy_only: bool, attention: str = "xla",
):
    """Proposes K tokens per row (K = keys.shape[1]); returns (tokens [b, K], q [b, K, v] or
    None, cache)."""
    cache = cache.replace(lengths=n - 2)
    at_last = jnp.ones(n.shape, jnp.int32)  # logits of `last` only
    logits, cache = forward(weights, config, jnp.stack([prev, last], axis=1), cache, attention=attention,
                            logits_at=at_last)
    token, q = _pick(logits[:, 0], sampling, keys[:, 0], greedy_only)
    cache = cache.replace(lengths=n)

    def step(carry, step_keys):
        cache, token = carry
        logits, cache = forward(weights, config, token[:, None], cache, attention=attention)
        cache = cache.replace(lengths=cache.lengths + 1)
        token, q = _pick(logits[:, 0], sampling, step_keys, greedy_only)
        return (cache, token), (token, q)

    (cache, _), (tokens, qs) = jax.lax.scan(step, (cache, token), jnp.moveaxis(keys[:, 1:], 1, 0))
    tokens = jnp.concatenate([token[:, None], jnp.moveaxis(tokens, 0, 1)], axis=1)
    if q is not None:
        q = jnp.concatenate([q[:, None], jnp.moveaxis(qs, 0, 1)], axis=1)
    return tokens, q, cache


def _target_distribution(logits: jnp.ndarray, sampling: SamplingParams) -> jnp.ndarray:
    """[b, K+1, v]: the filtered sampling distribution, one-hot argmax for greedy rows."""
    one_hot = jax.nn.one_hot(jnp.argmax(logits, -1), logits.shape[-1], dtype=jnp.float32)
    p = jax.nn.softmax(filtered_logits(logits, sampling), axis=-1)
    return jnp.where((sampling.temperature == 0)[:, None, None], one_hot, p)


def _chain_round(target_weights, draft_weights, target_config, draft_config, batch, s, n, K, greedy_only, attention):
    """One draft-chain round; -> (accepted [b], emitted [b, K+1], target cache, draft cache)."""
    keys = jax.vmap(lambda k: jax.random.split(k, 2 * K + 1))(row_keys(batch.seeds, s.num_generated))
    drafts, q, d_cache = draft_chain(
        draft_weights, draft_config, s.draft_cache, n, s.prev_token, s.last_token,
        batch.sampling, keys[:, :K], greedy_only, attention,
    )
    verify_tokens = jnp.concatenate([s.last_token[:, None], drafts], axis=1)
    t_cache = s.target_cache.replace(lengths=n - 1)
    logits, t_cache = forward(target_weights, target_config, verify_tokens, t_cache, attention=attention)
    if greedy_only:
        accepted, next_token = accept_greedy(drafts, logits)
    else:
        uniforms = jax.vmap(jax.vmap(lambda k: jax.random.uniform(k)))(keys[:, K : 2 * K])
        p = _target_distribution(logits, batch.sampling)
        accepted, next_token = accept_sampling(drafts, q, p, uniforms, keys[:, 2 * K])
    j = jnp.arange(K + 1)[None, :]
    emitted = jnp.where(j < accepted[:, None], jnp.pad(drafts, ((0, 0), (0, 1))), next_token[:, None])
    return accepted, emitted, t_cache, d_cache


def _tree_round(target_weights, draft_weights, target_config, draft_config, batch, s, n, plan, greedy_only, attention):
    """One draft-tree round; -> (accepted depth [b], emitted [b, D+1], target cache, draft cache)."""
    t, b = plan.size, n.shape[0]
    keys = jax.vmap(lambda k: jax.random.split(k, 2 * t + 1))(row_keys(batch.seeds, s.num_generated))
    tokens, q, d_cache = draft_tree(
        draft_weights, draft_config, s.draft_cache, n, s.prev_token, s.last_token, plan,
        batch.sampling, keys[:, :t], greedy_only, attention,
    )
    positions = (n - 1)[:, None] + jnp.asarray(plan.depth, jnp.int32)[None, :]
    t_cache = s.target_cache.replace(lengths=n - 1)
    logits, t_cache = forward(
        target_weights, target_config, tokens, t_cache, positions,
        jnp.asarray(ancestor_mask(plan.parents)), attention=attention,
    )
    accepted, next_token, best = accept_tree_greedy(plan, tokens, logits)
    if not greedy_only:
        uniforms = jax.vmap(jax.vmap(lambda k: jax.random.uniform(k)))(keys[:, t : 2 * t])
        p = _target_distribution(logits, batch.sampling)
        sampled = accept_tree_sampling(plan, tokens, q, p, uniforms, keys[:, 2 * t])
        greedy_row = batch.sampling.temperature == 0
        accepted, next_token, best = (jnp.where(greedy_row, g, x) for g, x in zip((accepted, next_token, best), sampled))
    path = path_to(plan, best)  # [b, D+1]
    path_tokens = jnp.take_along_axis(tokens, path, axis=1)
    j = jnp.arange(plan.max_depth + 1)[None, :]
    emitted = jnp.where(j < accepted[:, None], jnp.pad(path_tokens[:, 1:], ((0, 0), (0, 1))), next_token[:, None])
    base = n - 1
    return accepted, emitted, move_path(t_cache, base, path), move_path(d_cache, base, path)


@functools.partial(
    jax.jit,
    static_argnames=("target_config", "draft_config", "capacity", "max_out", "tree", "greedy_only", "attention"),
)
def speculative_decode(
    target_weights: Weights,
    draft_weights: Weights,
    batch: Batch,
    *,
    target_config: ModelConfig,
    draft_config: ModelConfig,
    capacity: int,
    max_out: int,
    tree: Tree,
    greedy_only: bool,
    attention: str = "xla",
) -> SpecOutput:
    """Prefill both models, then draft -> verify -> accept -> commit rounds in one while_loop.
    tree: static parents array; a chain (-1, 0, .., K-1) drafts K tokens with single-token steps."""
    plan = TreePlan.of(tree)
    is_chain = tree == chain(plan.size - 1)
    D = plan.max_depth
    eos_ids = target_config.eos_token_ids
    b = batch.tokens.shape[0]
    logits, t_cache = prefill(target_weights, target_config, batch, capacity, target_weights.embed.dtype)
    _, d_cache = prefill(draft_weights, draft_config, batch, capacity, draft_weights.embed.dtype)
    zeros = jnp.zeros((b,), jnp.int32)
    state = SpecState(
        target_cache=t_cache,
        draft_cache=d_cache,
        prev_token=jnp.take_along_axis(batch.tokens, jnp.maximum(batch.prompt_lens - 1, 0)[:, None], 1)[:, 0],
        last_token=zeros,
        out_tokens=jnp.full((b, max_out), target_config.pad_token_id, jnp.int32),
        num_generated=zeros,
        finish=jnp.where(batch.prompt_lens > 0, RUNNING, FINISH_PADDING),
        rounds=zeros,
        accepted_per_position=jnp.zeros((b, D), jnp.int32),
    )
    # The first token comes from the target's prefill, exactly as in plain decoding.
    first = sample_tokens(logits, batch.sampling, row_keys(batch.seeds, zeros), greedy_only)
    state, _ = commit_tokens(state, first[:, None], jnp.ones_like(first), batch, eos_ids)
    state = state.replace(last_token=first)

    def committed(s: SpecState):
        return batch.prompt_lens + s.num_generated  # n per row

    def cond(s: SpecState):
        running = s.finish == RUNNING
        # A round writes the tree's t nodes at slots n - 1 .. n + t - 2.
        fits = jnp.all(jnp.where(running, committed(s) + plan.size - 1 <= capacity, True))
        return jnp.any(running) & fits

    def body(s: SpecState):
        running = s.finish == RUNNING
        n = committed(s)
        args = (target_weights, draft_weights, target_config, draft_config, batch, s, n)
        if is_chain:
            accepted, emitted, t_cache, d_cache = _chain_round(*args, D, greedy_only, attention)
        else:
            accepted, emitted, t_cache, d_cache = _tree_round(*args, plan, greedy_only, attention)
        s2, kept = commit_tokens(s, emitted, accepted + 1, batch, eos_ids)
        # The last two committed tokens seed the next round's draft.
        all_tokens = jnp.concatenate([s.last_token[:, None], emitted], axis=1)
        rows = jnp.arange(b)
        prev = jnp.where(kept > 0, all_tokens[rows, jnp.maximum(kept - 1, 0)], s.prev_token)
        last = jnp.where(kept > 0, all_tokens[rows, kept], s.last_token)
        return s2.replace(
            target_cache=t_cache,
            draft_cache=d_cache,
            prev_token=prev,
            last_token=last,
            rounds=s.rounds + running,
            accepted_per_position=s.accepted_per_position
            + (running[:, None] & (jnp.arange(D)[None, :] < accepted[:, None])),
        )

    state = jax.lax.while_loop(cond, body, state)
    finish = jnp.where(state.finish == RUNNING, FINISH_LENGTH, state.finish)
    return SpecOutput(state.out_tokens, state.num_generated, finish, state.rounds, state.accepted_per_position)
