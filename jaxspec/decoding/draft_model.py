"""A draft model as drafter: a chain of K single-token steps, or a static tree expanded level by
level, with its own KV cache that follows the committed path.

The draft cache mirrors the target's: with n committed tokens it holds s[0..n-1) and s[n-1] is
pending. Each round re-reads [s[n-2], s[n-1]] (rewriting slot n-2 with identical K/V fills the
one hole left when the previous round accepted every draft, which the draft never ran).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.decoding.drafting import DrafterKind, Round
from jaxspec.decoding.sampling import SamplingArrays, filtered_logits
from jaxspec.decoding.state import prefill
from jaxspec.decoding.tree_verify import TreePlan, move_path
from jaxspec.decoding.trees import Tree, ancestor_mask, chain
from jaxspec.errors import InputError
from jaxspec.model.cache import KVCache
from jaxspec.model.config import ModelConfig
from jaxspec.model.forward import forward
from jaxspec.model.loading import Model
from jaxspec.model.weights import Weights

CATCH_UP_CHUNK = 16  # tokens per draft pass when a paused draft model catches up (adaptive K)


def _pick(logits: jnp.ndarray, sampling: SamplingArrays, keys: jnp.ndarray, greedy_only: bool):
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


def constrained_pick(logits, r: Round, keys, state):
    """_pick under the rows' structured-output constraints (r.constraint; none: as _pick) from each
    row's automaton state [b]: (tokens [b], distributions [b, v] or None, the state after the token)."""
    if r.constraint is None:
        return (*_pick(logits, r.sampling, keys, r.greedy_only), state)
    token, q = _pick(r.constraint.masked(logits, state), r.sampling, keys, r.greedy_only)
    return token, q, r.constraint.advance(state, token)


def draft_chain(weights: Weights, config: ModelConfig, cache: KVCache, r: Round):
    """Proposes K tokens per row (K = r.keys.shape[1]); returns (tokens [b, K], q [b, K, v] or
    None, cache)."""
    n, keys = r.n, r.keys
    cache = cache.replace(lengths=n - 2)
    at_last = jnp.ones(n.shape, jnp.int32)  # logits of `last` only
    logits, cache = forward(weights, config, jnp.stack([r.prev, r.last], axis=1), cache, attention=r.attention,
                            logits_at=at_last)
    state = r.constraint.state if r.constraint is not None else jnp.zeros_like(n)
    token, q, state = constrained_pick(logits[:, 0], r, keys[:, 0], state)
    cache = cache.replace(lengths=n)

    def step(carry, step_keys):
        cache, token, state = carry
        logits, cache = forward(weights, config, token[:, None], cache, attention=r.attention)
        cache = cache.replace(lengths=cache.lengths + 1)
        token, q, state = constrained_pick(logits[:, 0], r, step_keys, state)
        return (cache, token, state), (token, q)

    (cache, _, _), (tokens, qs) = jax.lax.scan(step, (cache, token, state), jnp.moveaxis(keys[:, 1:], 1, 0))
    tokens = jnp.concatenate([token[:, None], jnp.moveaxis(tokens, 0, 1)], axis=1)
    if q is not None:
        q = jnp.concatenate([q[:, None], jnp.moveaxis(qs, 0, 1)], axis=1)
    return tokens, q, cache


def draft_tree(weights: Weights, config: ModelConfig, cache: KVCache, plan: TreePlan, r: Round):
    """Fills the tree level by level: the top-k children of each node by draft probability
    (greedy), or i.i.d. draws from the draft distribution (sampling). Each pass re-reads
    [s[n-2], tree nodes] (the first entry fills the draft cache's possible hole, as in chain
    drafting) under the ancestor mask, and rewrites all of their cache slots, so each level
    takes the cache the last one left (handing every level the round's first cache made XLA
    copy it per layer and level). keys [b, t-1, 2]: one per node 1..t-1.

    Returns (tokens [b, t] with tokens[:, 0] = last, q [b, t-1, v] the draft distribution node
    i was drawn from at q[:, i-1] (None when greedy_only), cache)."""
    n, prev, last, keys, greedy_only = r.n, r.prev, r.last, r.keys, r.greedy_only
    b, t = last.shape[0], plan.size
    mask = np.zeros((t + 1, t + 1), bool)
    mask[:, 0] = True
    mask[1:, 1:] = ancestor_mask(plan.parents)
    positions = jnp.concatenate(
        [(n - 2)[:, None], (n - 1)[:, None] + jnp.asarray(plan.depth, jnp.int32)[None, :]], axis=1
    )
    tokens = jnp.zeros((b, t), jnp.int32).at[:, 0].set(last)
    q_all = None if greedy_only else jnp.zeros((b, t - 1, config.vocab_size), jnp.float32)
    cache = cache.replace(lengths=n - 2)
    states = None if r.constraint is None else jnp.zeros((b, t), jnp.int32).at[:, 0].set(r.constraint.state)
    for d in range(1, plan.max_depth + 1):
        nodes = plan.level(d)
        # The head and top_k run only at this level's parents (a few rows of a 128K vocabulary).
        parents = np.unique(np.asarray(plan.parents)[nodes])
        logits, cache = forward(
            weights, config, jnp.concatenate([prev[:, None], tokens], axis=1), cache, positions, jnp.asarray(mask),
            attention=r.attention, logits_at=jnp.broadcast_to(jnp.asarray(1 + parents, jnp.int32), (b, parents.size)),
        )  # [b, parents, v]
        if states is not None:  # each parent's logits under the constraint state its path reaches
            logits = r.constraint.masked(logits, states[:, parents])
        chosen, q = pick_children(logits, parents, plan, nodes, r.sampling, keys, greedy_only)
        if q is not None:
            q_all = q_all.at[:, nodes - 1].set(q)
        tokens = tokens.at[:, nodes].set(chosen)
        if states is not None:  # a child beyond its parent's allowed tokens (top-k ran short) is dead: -1
            of = jnp.asarray(np.asarray(plan.parents)[nodes])
            states = states.at[:, nodes].set(r.constraint.advance(states[:, of], chosen))
    return tokens, q_all, cache


def pick_children(logits, parents: np.ndarray, plan: TreePlan, nodes: np.ndarray, sampling: SamplingArrays,
                  keys: jnp.ndarray, greedy_only: bool):
    """One tree level's tokens from its parents' logits [b, len(parents), v]: node i is its
    parent's rank-th most likely token (greedy), or an i.i.d. draw from the parent's filtered
    distribution (sampling, keys[:, i - 1]). Returns (tokens [b, m], the distributions drawn
    from [b, m, v] or None when greedy_only)."""
    of_node = np.searchsorted(parents, np.asarray(plan.parents)[nodes])  # each node's parent row
    top = jax.lax.top_k(logits, plan.max_children)[1][:, of_node]  # [b, m, c]
    ranks = jnp.asarray(np.asarray(plan.rank)[nodes])
    greedy = jnp.take_along_axis(top, ranks[None, :, None], axis=2)[..., 0].astype(jnp.int32)
    if greedy_only:
        return greedy, None
    filtered = filtered_logits(logits[:, of_node], sampling)  # [b, m, v]
    drawn = jax.vmap(jax.vmap(jax.random.categorical))(keys[:, nodes - 1], filtered).astype(jnp.int32)
    return jnp.where((sampling.temperature > 0)[:, None], drawn, greedy), jax.nn.softmax(filtered, axis=-1)


@dataclasses.dataclass(frozen=True)
class ModelDrafter:
    """A draft model sharing the target's vocabulary; params are its Weights."""

    config: ModelConfig
    tree: Tree

    @property
    def is_chain(self) -> bool:
        return self.tree == chain(len(self.tree) - 1)

    def with_k(self, k: int) -> "ModelDrafter":
        """The chain of k (adaptive K's loops); a named tree has no K to vary."""
        if not self.is_chain:
            raise InputError("adaptive K varies a chain's length; a draft tree is fixed (drop tree=)")
        return dataclasses.replace(self, tree=chain(k))

    def init(self, weights: Weights, batch, capacity: int, max_out: int, first: jnp.ndarray) -> KVCache:
        return prefill(weights, self.config, batch, capacity)[1]  # whole: the shared prefixes are the target's

    def propose(self, weights: Weights, cache: KVCache, r: Round):
        if self.is_chain:
            drafts, q, cache = draft_chain(weights, self.config, cache, r)
            return jnp.concatenate([r.last[:, None], drafts], axis=1), q, cache
        return draft_tree(weights, self.config, cache, TreePlan.of(self.tree), r)

    def commit(self, weights: Weights, cache: KVCache, r: Round, path, emitted, kept) -> KVCache:
        # A chain's accepted drafts already sit in place; a tree's path moves there. The cache then
        # holds s[0 .. n + kept - 2) at least: its lengths say so, for catch_up after a pause.
        cache = cache if self.is_chain else move_path(cache, r.n - 1, path)
        return cache.replace(lengths=r.n + kept - 2)

    def follow(self, weights: Weights, cache: KVCache, r: Round, path, emitted, kept) -> KVCache:
        """A paused round (adaptive K at 0, decoding/adaptive.py) runs no draft pass: the cache
        falls behind, its lengths marking how far it is whole."""
        return cache

    def catch_up(self, weights: Weights, cache: KVCache, out_tokens, prompt_lens, n, running) -> KVCache:
        """Runs the draft over the tokens committed while paused, CATCH_UP_CHUNK at a time, so
        each running row's cache holds s[0 .. n - 2) again (a round re-reads s[n-2] and s[n-1])."""
        chunk = min(CATCH_UP_CHUNK, out_tokens.shape[1])  # prompt + max_out fit the cache: so does a chunk
        behind = lambda c: running & (c.lengths < n - 2)  # noqa: E731

        def step(c):
            lag = behind(c)
            # Never before the prompt's end (the slots keep no prompt) nor past the cache's end: a
            # chunk started earlier rewrites committed tokens with their own keys and values.
            start = jnp.maximum(jnp.minimum(c.lengths, c.capacity - chunk), prompt_lens)
            at = start[:, None] - prompt_lens[:, None] + jnp.arange(chunk)[None, :]
            tokens = jnp.take_along_axis(out_tokens, jnp.minimum(at, out_tokens.shape[1] - 1), axis=1)
            _, moved = forward(weights, self.config, tokens, c.replace(lengths=start),
                               logits_at=jnp.zeros(start.shape, jnp.int32))
            # Slots from n - 2 on got tokens not yet final there: a round rewrites them before reading.
            return moved.replace(lengths=jnp.where(lag, jnp.minimum(start + chunk, n - 2), c.lengths))

        return jax.lax.while_loop(lambda c: jnp.any(behind(c)), step, cache)


KIND = DrafterKind(
    "draft", "model", takes=Model, trees=True, needs=Model, needs_text="a draft model",
    build=lambda method, draft, target: (ModelDrafter(draft.config, method.parents), draft.weights),
    name=lambda method: f"speculative K={method.k}",
)
