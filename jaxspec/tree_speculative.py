"""Tree speculation: the draft expands a static tree, the target verifies every node in one pass
(positions = depth, mask = committed prefix + ancestors), the longest accepted root-to-leaf path
is committed, and its K/V entries move into place in both caches.

Node i of the tree sits at cache slot (n - 1) + i during the round (node 0 = the last committed
token s[n-1]); after acceptance the path's nodes move to slots (n - 1) + depth.

Acceptance:
  * greedy: a node is right when its token is the target's argmax at its parent; the deepest
    node whose whole ancestry is right wins (children of a node carry distinct tokens, so that
    path is unique), plus the target's argmax after it;
  * sampling: the children of a node are i.i.d. draws from the draft distribution q at that node;
    walking down from the root, child c is accepted with probability min(1, p(c) / q(c)), and
    after each rejection p <- normalize(max(p - q, 0)) (SpecInfer's multi-step speculative
    sampling); when no child is accepted (or a leaf is reached) one token is drawn from the
    current p. The emitted tokens are distributed exactly as the target's sampling.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.cache import KVCache
from jaxspec.config import ModelConfig
from jaxspec.model import Weights, forward
from jaxspec.sampling import SamplingParams, filtered_logits
from jaxspec.trees import Tree, ancestor_mask, depths


@dataclasses.dataclass(frozen=True)
class TreePlan:
    """Static facts of a tree, derived once from its parents array."""

    parents: Tree
    depth: tuple[int, ...]
    rank: tuple[int, ...]  # position of each node among its parent's children
    children: tuple[tuple[int, ...], ...]  # per node, padded with -1 to max_children
    max_depth: int
    max_children: int

    @classmethod
    def of(cls, parents: Tree) -> "TreePlan":
        kids: list[list[int]] = [[] for _ in parents]
        rank = [0] * len(parents)
        for i, p in enumerate(parents[1:], 1):
            rank[i] = len(kids[p])
            kids[p].append(i)
        width = max(1, max(len(k) for k in kids))
        return cls(
            parents=parents,
            depth=tuple(int(d) for d in depths(parents)),
            rank=tuple(rank),
            children=tuple(tuple(k + [-1] * (width - len(k))) for k in kids),
            max_depth=int(max(depths(parents))),
            max_children=width,
        )

    @property
    def size(self) -> int:
        return len(self.parents)

    def level(self, d: int) -> np.ndarray:
        return np.array([i for i, x in enumerate(self.depth) if x == d], np.int32)


def draft_tree(
    weights: Weights, config: ModelConfig, cache: KVCache, n: jnp.ndarray, prev: jnp.ndarray,
    last: jnp.ndarray, plan: TreePlan, sampling: SamplingParams, keys: jnp.ndarray, greedy_only: bool,
    attention: str = "xla",
):
    """Fills the tree level by level. Each pass re-reads [s[n-2], tree nodes] (the first entry
    fills the draft cache's possible hole, as in chain drafting) under the ancestor mask, and
    rewrites all of their cache slots, so each level takes the cache the last one left (handing
    every level the round's first cache made XLA copy it per layer and level).

    Returns (tokens [b, t] with tokens[:, 0] = last, q [b, t, v] the draft distribution each
    node was drawn from (None when greedy_only), cache)."""
    b, t = last.shape[0], plan.size
    mask = np.zeros((t + 1, t + 1), bool)
    mask[:, 0] = True
    mask[1:, 1:] = ancestor_mask(plan.parents)
    positions = jnp.concatenate(
        [(n - 2)[:, None], (n - 1)[:, None] + jnp.asarray(plan.depth, jnp.int32)[None, :]], axis=1
    )
    tokens = jnp.zeros((b, t), jnp.int32).at[:, 0].set(last)
    q_all = None if greedy_only else jnp.zeros((b, t, config.vocab_size), jnp.float32)
    cache = cache.replace(lengths=n - 2)
    for d in range(1, plan.max_depth + 1):
        nodes = plan.level(d)
        # The head and top_k run only at this level's parents (a few rows of a 128K vocabulary).
        parents = np.unique(np.asarray(plan.parents)[nodes])
        logits, cache = forward(
            weights, config, jnp.concatenate([prev[:, None], tokens], axis=1), cache, positions, jnp.asarray(mask),
            attention=attention, logits_at=jnp.broadcast_to(jnp.asarray(1 + parents, jnp.int32), (b, parents.size)),
        )  # [b, parents, v]
        of_node = np.searchsorted(parents, np.asarray(plan.parents)[nodes])  # each node's parent row
        parent_logits = logits[:, of_node]  # [b, m, v]
        top = jax.lax.top_k(logits, plan.max_children)[1][:, of_node]  # [b, m, c]
        ranks = jnp.asarray(np.asarray(plan.rank)[nodes])
        greedy = jnp.take_along_axis(top, ranks[None, :, None], axis=2)[..., 0].astype(jnp.int32)
        if greedy_only:
            chosen = greedy
        else:
            filtered = filtered_logits(parent_logits, sampling)
            node_keys = keys[:, nodes]  # [b, m, 2]
            drawn = jax.vmap(jax.vmap(jax.random.categorical))(node_keys, filtered).astype(jnp.int32)
            chosen = jnp.where((sampling.temperature > 0)[:, None], drawn, greedy)
            q_all = q_all.at[:, nodes].set(jax.nn.softmax(filtered, axis=-1))
        tokens = tokens.at[:, nodes].set(chosen)
    return tokens, q_all, cache


def path_to(plan: TreePlan, best: jnp.ndarray) -> jnp.ndarray:
    """[b, D+1]: the node at each depth on the root path to `best` (best itself past its depth)."""
    anc = jnp.asarray(ancestor_mask(plan.parents))[best]  # [b, t]
    at_depth = anc[:, None, :] & (jnp.asarray(plan.depth)[None, None, :] == jnp.arange(plan.max_depth + 1)[None, :, None])
    found = jnp.any(at_depth, axis=2)
    return jnp.where(found, jnp.argmax(at_depth, axis=2), best[:, None]).astype(jnp.int32)


def accept_tree_greedy(plan: TreePlan, tokens: jnp.ndarray, logits: jnp.ndarray):
    """-> (accepted depth [b], next token [b], best node [b])."""
    target = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [b, t]
    parents = np.maximum(np.asarray(plan.parents), 0)
    right = (tokens == target[:, parents]).at[:, 0].set(True)
    anc = jnp.asarray(ancestor_mask(plan.parents))
    ok = ~jnp.any(anc[None] & ~right[:, None, :], axis=2)  # whole ancestry right
    depth = jnp.asarray(plan.depth)
    best = jnp.argmax(jnp.where(ok, depth[None], -1), axis=1).astype(jnp.int32)
    return depth[best], jnp.take_along_axis(target, best[:, None], 1)[:, 0], best


def accept_tree_sampling(plan: TreePlan, tokens, q, p, uniforms, final_keys):
    """Recursive rejection down the tree. tokens [b, t]; q [b, t, v] (node i's token was drawn
    from q[:, i]); p [b, t, v] target distributions at each node; uniforms [b, t];
    final_keys [b, 2]. -> (accepted depth [b], next token [b], last accepted node [b])."""
    b = tokens.shape[0]
    rows = jnp.arange(b)
    children = jnp.asarray(plan.children)  # [t, c]
    cur = jnp.zeros((b,), jnp.int32)
    p_cur = p[:, 0]
    searching = jnp.ones((b,), bool)
    accepted = jnp.zeros((b,), jnp.int32)
    for _ in range(plan.max_depth):
        moved = jnp.zeros((b,), bool)
        for c in range(plan.max_children):
            child = children[cur, c]
            try_it = searching & ~moved & (child >= 0)
            node = jnp.maximum(child, 0)
            tok = tokens[rows, node]
            q_node = q[rows, node]  # [b, v]
            take = try_it & (uniforms[rows, node] * q_node[rows, tok] < p_cur[rows, tok])
            residual = jnp.maximum(p_cur - q_node, 0.0)
            total = jnp.sum(residual, axis=-1, keepdims=True)
            residual = jnp.where(total > 0, residual / jnp.where(total > 0, total, 1.0), p_cur)
            rejected = try_it & ~take
            p_cur = jnp.where(take[:, None], p[rows, node], jnp.where(rejected[:, None], residual, p_cur))
            cur = jnp.where(take, node, cur)
            moved |= take
        accepted += moved
        searching &= moved
    next_token = jax.vmap(lambda k, r: jax.random.categorical(k, jnp.log(r)))(final_keys, p_cur)
    return accepted, next_token.astype(jnp.int32), cur


def move_path(cache: KVCache, base: jnp.ndarray, path: jnp.ndarray) -> KVCache:
    """Copies the K/V of path nodes (slots base + path[:, j]) to slots base + j, every layer."""
    rows = jnp.arange(path.shape[0])[:, None]
    src = base[:, None] + path
    dst = base[:, None] + jnp.arange(path.shape[1])[None, :]
    if isinstance(cache.k, tuple):  # one array per layer
        move = lambda a: a.at[rows, dst].set(a[rows, src], mode="drop")  # noqa: E731
        return cache.replace(k=tuple(map(move, cache.k)), v=tuple(map(move, cache.v)))
    move = lambda a: a.at[:, rows, dst].set(a[:, rows, src], mode="drop")  # noqa: E731  # stacked
    return cache.replace(k=move(cache.k), v=move(cache.v))
