"""How a request is decoded, as one value: plain, a draft model's chain or tree, or n-gram lookup,
with K and the tree. Built once at the edge (generate, run_job, the CLI, the canary), checked
there, and passed down; it builds its drafter and names itself for logs and summaries."""

from __future__ import annotations

import dataclasses

from jaxspec.checks import check_int
from jaxspec.decoding.draft_model import ModelDrafter
from jaxspec.decoding.eagle import EagleDrafter
from jaxspec.decoding.ngram import Ngram
from jaxspec.decoding.plain import PlainLoop
from jaxspec.decoding.speculative import SpeculativeLoop
from jaxspec.decoding.tree_verify import TreePlan
from jaxspec.decoding.trees import MAX_TREE_NODES, Tree, chain, resolve_tree
from jaxspec.errors import InputError
from jaxspec.model.eagle import EagleHead
from jaxspec.model.loading import Model

DEFAULT_NUM_DRAFT = 3  # drafted tokens per round when none is given: generate, the CLI and batch jobs
MAX_DRAFT_TOKENS = 32  # one static graph per K; past this a chain only wastes verify work
# the target alone; a draft model; n-gram lookup in the prompt and output; an EAGLE-3 head
KINDS = ("plain", "draft", "ngram", "eagle")


@dataclasses.dataclass(frozen=True)
class DecodeMethod:
    """kind: one of KINDS. k: tokens drafted per round (a chain's length, an n-gram branch's; for a
    tree, its depth; 0 for plain). tree: a draft model's static tree instead of a chain, a name
    from jaxspec.trees.NAMED_TREES or a parents array. ngram: the lookup settings (kind "ngram")."""

    kind: str = "plain"
    k: int = DEFAULT_NUM_DRAFT
    tree: str | Tree | None = None
    ngram: Ngram | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise InputError(f"decode method kind must be one of {', '.join(KINDS)}; got {self.kind!r}")
        if self.kind == "plain":
            if self.tree is not None:
                raise InputError("tree needs a draft model: pass draft=... (or drop tree for plain decoding)")
            object.__setattr__(self, "k", 0)
            object.__setattr__(self, "ngram", None)
            return
        check_int(self.k, "num_draft_tokens", 1, MAX_DRAFT_TOKENS)
        if self.kind == "ngram":
            if self.tree is not None:
                raise InputError("tree is for a draft model; n-gram lookup builds its own (ngram_branches)")
            ngram = self.ngram if self.ngram is not None else Ngram()
            object.__setattr__(self, "ngram", ngram)
            if len(ngram.drafter(self.k).tree) > MAX_TREE_NODES:
                raise InputError(f"ngram_branches x num_draft_tokens must be at most {MAX_TREE_NODES - 1}; "
                                 f"got {ngram.branches} x {self.k}")
        elif self.tree is not None:
            parents = resolve_tree(self.tree)
            if not isinstance(self.tree, str):
                object.__setattr__(self, "tree", parents)  # hashable, checked
            object.__setattr__(self, "k", TreePlan.of(parents).max_depth)

    @classmethod
    def of(cls, draft, k: int = DEFAULT_NUM_DRAFT, tree=None, ngram: Ngram | None = None) -> "DecodeMethod":
        """The method a draft implies: None -> plain, an Ngram -> lookup, a Model -> a draft model's
        chain of k (or `tree`)."""
        if draft is None:
            return cls("plain", tree=tree)
        if isinstance(draft, Ngram):
            return cls("ngram", k, tree, draft)
        if isinstance(draft, Model):
            return cls("draft", k, tree)
        if isinstance(draft, EagleHead):
            return cls("eagle", k, tree)
        raise InputError(f'draft must be a model from jaxspec.load, "ngram" or None; got {draft!r}')

    @property
    def speculative(self) -> bool:
        return self.kind != "plain"

    @property
    def watches_acceptance(self) -> bool:
        """Each draft costs a pass of a model (a draft model or an EAGLE-3 head), so a low
        acceptance rate is a warning sign; lookup proposals cost none."""
        return self.kind in ("draft", "eagle")

    @property
    def drafter_kind(self) -> str | None:
        """"model", "ngram", "eagle" or None (plain), as summaries and logs report it."""
        return {"draft": "model", "ngram": "ngram", "eagle": "eagle"}.get(self.kind)

    @property
    def parents(self) -> Tree:
        """The static tree drafted each round (a chain of k unless a tree was given)."""
        if self.kind == "ngram":
            return self.ngram.drafter(self.k).tree
        return resolve_tree(self.tree) if self.tree is not None else chain(self.k)

    @property
    def name(self) -> str:
        """"plain", "speculative K=3" (a draft model's chain), "tree sparse" (a named draft tree),
        "ngram K=4" or "ngram K=4 x3" (n-gram lookup, a tree of 3 branches)."""
        if self.kind == "ngram":
            return f"ngram K={self.k}" + (f" x{self.ngram.branches}" if self.ngram.branches > 1 else "")
        if self.kind == "eagle" and self.tree is None:
            return f"eagle K={self.k}"
        if self.tree is not None:
            tree = f"tree {self.tree}" if isinstance(self.tree, str) else f"tree of {len(self.tree)} nodes"
            return f"eagle {tree}" if self.kind == "eagle" else tree
        return f"speculative K={self.k}" if self.k else "plain"

    def drafter(self, draft, target: Model):
        """(the static drafter, its arrays) for the speculative loop: n-gram lookup (no arrays),
        `draft`'s chain or tree (its weights), or an EAGLE-3 head's chain or tree (its weights and
        the target's embedding)."""
        if self.kind == "ngram":
            return self.ngram.drafter(self.k), None
        if self.kind == "eagle":  # check_pair (generate, run_job) has checked that it fits the target
            layers = draft.config.layers_for(target.config)
            return EagleDrafter(draft.config, self.parents, layers), (draft.weights, target.weights.embed)
        if not isinstance(draft, Model):
            raise InputError(f"decode method {self.name!r} needs a draft model; got {draft!r}")
        return ModelDrafter(draft.config, self.parents), draft.weights

    def loop(self, target: Model, draft):
        """(the decode Loop for `target`, its params: the drafter's arrays or None)."""
        if not self.speculative:
            return PlainLoop(target.config), None
        drafter, params = self.drafter(draft, target)
        return SpeculativeLoop(target.config, drafter), params
