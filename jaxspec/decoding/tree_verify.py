"""Tree verification: a drafter fills a static tree, the target verifies every node in one pass
(positions = depth, mask = committed prefix + ancestors), the longest accepted root-to-leaf path
is committed, and its K/V entries move into place in the caches.

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
    current p. The emitted tokens are distributed exactly as the target's sampling. With point
    masses (q one-hot: fixed candidates, as n-gram lookup proposes) this is: accept child c with
    probability p(c), else remove c from p and renormalise.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.decoding.trees import Tree, ancestor_mask, depths
from jaxspec.model.cache import KVCache


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
    """Recursive rejection down the tree. tokens [b, t]; q [b, t-1, v] (node i's token was drawn
    from q[:, i-1]), or None for point masses; p [b, t, v] target distributions at each node;
    uniforms [b, t-1] (node i's at i-1); final_keys [b, 2].
    -> (accepted depth [b], next token [b], last accepted node [b])."""
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
            node = jnp.maximum(child, 1)
            tok = tokens[rows, node]
            if q is None:  # a point mass at tok
                take = try_it & (uniforms[rows, node - 1] < p_cur[rows, tok])
                residual = p_cur.at[rows, tok].set(0.0)
            else:
                q_node = q[rows, node - 1]  # [b, v]
                take = try_it & (uniforms[rows, node - 1] * q_node[rows, tok] < p_cur[rows, tok])
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
