"""The public path of draft trees (`from jaxspec.trees import NAMED_TREES, balanced_tree, ...`); they
live in jaxspec.decoding.trees."""

from jaxspec.decoding.trees import (
    MAX_TREE_NODES,
    NAMED_TREES,
    SPARSE_CHOICES,
    Tree,
    ancestor_mask,
    balanced_tree,
    chain,
    check_tree,
    depths,
    resolve_tree,
    tree_from_choices,
)

__all__ = [
    "MAX_TREE_NODES", "NAMED_TREES", "SPARSE_CHOICES", "Tree", "ancestor_mask", "balanced_tree", "chain", "check_tree",
    "depths", "resolve_tree", "tree_from_choices",
]
