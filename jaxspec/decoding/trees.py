"""Static draft-tree topologies.

A tree is a tuple `parents` of length t: node 0 is the last committed token (parent -1) and every
other node's parent comes before it. A chain of K drafts is parents = (-1, 0, 1, ..., K-1).
Trees are static (compile-time) values, so each topology compiles one graph.
"""

from __future__ import annotations

import numpy as np

from jaxspec.errors import InputError

Tree = tuple[int, ...]


def check_tree(parents) -> Tree:
    """Validates a parents array; returns it as a tuple of ints."""
    try:
        parents = tuple(int(p) for p in parents)
    except (TypeError, ValueError):
        raise InputError(f"tree must be a sequence of parent indices; got {parents!r}") from None
    if not parents or parents[0] != -1:
        raise InputError("tree[0] must be -1: node 0 is the last committed token, the root")
    for i, p in enumerate(parents[1:], 1):
        if not 0 <= p < i:
            raise InputError(f"tree[{i}] = {p}: a node's parent must be an earlier node (0 <= parent < {i})")
    return parents


def chain(k: int) -> Tree:
    """The root followed by k drafts in a line."""
    return (-1,) + tuple(range(k))


def balanced_tree(branching: int, depth: int) -> Tree:
    """Every node down to `depth` has `branching` children (breadth-first numbering)."""
    parents, frontier = [-1], [0]
    for _ in range(depth):
        nxt = []
        for node in frontier:
            for _ in range(branching):
                parents.append(node)
                nxt.append(len(parents) - 1)
        frontier = nxt
    return tuple(parents)


def tree_from_choices(choices) -> Tree:
    """Medusa/EAGLE-style sparse tree: each choice is a path of child ranks from the root, e.g.
    (0,) = the draft's top token, (0, 1) = the second-best child of that. Every prefix of a
    path must be present too."""
    paths = sorted({tuple(int(c) for c in path) for path in choices}, key=lambda p: (len(p), p))
    index = {(): 0}
    parents = [-1]
    for path in paths:
        if not path:
            continue
        if path[:-1] not in index:
            raise InputError(f"tree choice {path} lacks its parent path {path[:-1]}")
        index[path] = len(parents)
        parents.append(index[path[:-1]])
    return tuple(parents)


# A sparse tree shaped like the Medusa / EAGLE "choices": wide near the root, one deep spine.
SPARSE_CHOICES = (
    (0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0),
    (0, 0, 0, 0), (0, 0, 0, 0, 0),
)


def depths(parents: Tree) -> np.ndarray:
    """[t] depth of each node (root 0): the position offset used for its RoPE."""
    d = np.zeros(len(parents), np.int32)
    for i, p in enumerate(parents[1:], 1):
        d[i] = d[p] + 1
    return d


def ancestor_mask(parents: Tree) -> np.ndarray:
    """[t, t] bool: mask[i, j] iff node j is node i or one of its ancestors."""
    t = len(parents)
    mask = np.eye(t, dtype=bool)
    for i, p in enumerate(parents[1:], 1):
        mask[i] |= mask[p]
    return mask


MAX_TREE_NODES = 64  # verify chunks beyond this stop paying and leave the fused kernel's range

NAMED_TREES = {
    "chain-3": chain(3),
    "chain-7": chain(7),
    "binary-3": balanced_tree(2, 3),  # 15 nodes
    "sparse": tree_from_choices(SPARSE_CHOICES),  # 13 nodes
}


def resolve_tree(tree) -> Tree:
    """A name from NAMED_TREES or a parents array -> a validated parents tuple."""
    if isinstance(tree, str):
        if tree not in NAMED_TREES:
            raise InputError(f"tree {tree!r} is unknown; named trees: {', '.join(NAMED_TREES)}")
        return NAMED_TREES[tree]
    parents = check_tree(tree)
    if not 2 <= len(parents) <= MAX_TREE_NODES:
        raise InputError(f"tree must have 2 to {MAX_TREE_NODES} nodes (root included); got {len(parents)}")
    return parents
