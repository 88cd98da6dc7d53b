"""How a request is decoded, as one value: plain, or a drafter kind with K, the tree and the kind's
own settings nested in it. Built once at the edge (generate, run_job, the CLI, the canary), checked
there, and passed down; it builds its drafter and names itself for logs and summaries.

The drafter kinds are rows of one registry (DRAFTERS): a new drafter is one file in decoding/
(its Drafter and its DrafterKind row) plus its row here."""

from __future__ import annotations

import dataclasses

from jaxspec.checks import check_int
from jaxspec.decoding import draft_model, eagle, ngram, suffix
from jaxspec.decoding.drafting import DrafterKind
from jaxspec.decoding.plain import PlainLoop
from jaxspec.decoding.speculative import SpeculativeLoop
from jaxspec.decoding.tree_verify import TreePlan
from jaxspec.decoding.trees import MAX_TREE_NODES, Tree, chain, resolve_tree
from jaxspec.errors import InputError
from jaxspec.model.loading import Model

# The registry of drafter kinds, by DecodeMethod.kind.
DRAFTERS: dict[str, DrafterKind] = {k.kind: k for k in (draft_model.KIND, ngram.KIND, eagle.KIND, suffix.KIND)}

DEFAULT_NUM_DRAFT = 3  # drafted tokens per round when none is given: generate, the CLI and batch jobs
MAX_DRAFT_TOKENS = 32  # one static graph per K; past this a chain only wastes verify work
KINDS = ("plain", *DRAFTERS)


@dataclasses.dataclass(frozen=True)
class DecodeMethod:
    """kind: "plain" or a DRAFTERS kind. k: tokens drafted per round (a chain's length, an n-gram
    branch's; for a tree, its depth; 0 for plain). tree: a static tree instead of a chain, a name
    from jaxspec.trees.NAMED_TREES or a parents array (kinds that take one). settings: the kind's
    own settings value (jaxspec.ngram.Ngram for "ngram"; its defaults when None)."""

    kind: str = "plain"
    k: int = DEFAULT_NUM_DRAFT
    tree: str | Tree | None = None
    settings: object = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise InputError(f"decode method kind must be one of {', '.join(KINDS)}; got {self.kind!r}")
        if self.kind == "plain":
            if self.tree is not None:
                raise InputError("tree needs a draft model: pass draft=... (or drop tree for plain decoding)")
            object.__setattr__(self, "k", 0)
            object.__setattr__(self, "settings", None)
            return
        check_int(self.k, "num_draft_tokens", 1, MAX_DRAFT_TOKENS)
        row = DRAFTERS[self.kind]
        if row.settings is not None:
            settings = self.settings if self.settings is not None else row.settings()
            if not isinstance(settings, row.settings):
                raise InputError(f"{self.kind} settings must be a {row.settings.__name__}; got {settings!r}")
            object.__setattr__(self, "settings", settings)
        elif self.settings is not None:
            raise InputError(f"{self.kind} takes no settings; got {self.settings!r}")
        if self.tree is not None:
            if not row.trees:
                raise InputError(f"tree is for a draft model or an EAGLE-3 head; {self.kind} builds its own")
            parents = resolve_tree(self.tree)
            if not isinstance(self.tree, str):
                object.__setattr__(self, "tree", parents)  # hashable, checked
            object.__setattr__(self, "k", TreePlan.of(parents).max_depth)
        if len(self.parents) > MAX_TREE_NODES:
            raise InputError(f"a round drafts at most {MAX_TREE_NODES - 1} tokens; {self.name} drafts "
                             f"{len(self.parents) - 1}")

    @classmethod
    def of(cls, draft, k: int = DEFAULT_NUM_DRAFT, tree=None, settings=None) -> "DecodeMethod":
        """The method a draft implies: None -> plain, else the kind whose row takes it (a Model ->
        a draft model's chain of k or `tree`, an EAGLE-3 head, an Ngram -> lookup with it)."""
        if draft is None:
            return cls("plain", tree=tree)
        if isinstance(draft, str):
            draft = named_draft(draft)
        for row in DRAFTERS.values():
            if isinstance(draft, row.takes):
                if row.settings is not None and isinstance(draft, row.settings):
                    settings = draft
                return cls(row.kind, k, tree, settings)
        raise InputError(f"draft must be a model from jaxspec.load, {NAMED} or None; got {draft!r}")

    @property
    def row(self) -> DrafterKind | None:
        return DRAFTERS.get(self.kind)

    @property
    def speculative(self) -> bool:
        return self.kind != "plain"

    @property
    def watches_acceptance(self) -> bool:
        """Each draft costs a pass of a model (a draft model or an EAGLE-3 head), so a low
        acceptance rate is a warning sign; lookup proposals cost none."""
        return self.speculative and self.row.watches_acceptance

    @property
    def drafter_kind(self) -> str | None:
        """"model", "ngram", "eagle" or None (plain), as summaries and logs report it."""
        return self.row.label if self.speculative else None

    @property
    def parents(self) -> Tree:
        """The static tree drafted each round (a chain of k unless a tree was given)."""
        if self.tree is not None:
            return resolve_tree(self.tree)
        if self.speculative and self.row.parents is not None:
            return self.row.parents(self)
        return chain(self.k)

    @property
    def name(self) -> str:
        """"plain", "speculative K=3" (a draft model's chain), "tree sparse" (a named draft tree),
        "ngram K=4" or "ngram K=4 x3" (n-gram lookup, a tree of 3 branches), "eagle K=3"."""
        if not self.speculative:
            return "plain"
        if self.tree is not None:
            tree = f"tree {self.tree}" if isinstance(self.tree, str) else f"tree of {len(self.tree)} nodes"
            return f"{self.row.tree_prefix}{tree}"
        return self.row.name(self)

    def drafter(self, draft, target: Model):
        """(the static drafter, its arrays) for the speculative loop; `draft` is checked to be
        what the kind runs (check_pair in generate and run_job has checked that it fits the target)."""
        row = self.row
        if row.needs is not None and not isinstance(draft, row.needs):
            raise InputError(f"decode method {self.name!r} needs {row.needs_text}; got {draft!r}")
        return row.build(self, draft, target)

    def loop(self, target: Model, draft):
        """(the decode Loop for `target`, its params: the drafter's arrays or None)."""
        if not self.speculative:
            return PlainLoop(target.config), None
        drafter, params = self.drafter(draft, target)
        return SpeculativeLoop(target.config, drafter), params


# The kinds that draft without a model, named by a string: draft="ngram", "suffix".
NAMED_KINDS = tuple(k for k, row in DRAFTERS.items() if row.settings is not None and row.takes is row.settings)
NAMED = ", ".join(f"\"{k}\"" for k in NAMED_KINDS)


def named_draft(name: str, settings=None):
    """draft="ngram" / "suffix" -> that kind's settings (`settings` when given, else its defaults)."""
    if name not in NAMED_KINDS:
        raise InputError(f"draft must be a model from jaxspec.load, {NAMED} or None; got {name!r}")
    return settings if settings is not None else DRAFTERS[name].settings()


def add_cli_args(parser, tree: bool = True) -> None:
    """The method's command-line flags (K, the tree, and each drafter kind's own settings); the
    draft itself (--draft) is the command's to declare."""
    parser.add_argument("--num-draft-tokens", type=int, default=DEFAULT_NUM_DRAFT,
                        help=f"draft tokens K per target pass (default {DEFAULT_NUM_DRAFT})")
    if tree:
        parser.add_argument("--tree", help="a named draft tree instead of a chain of K (binary-3, sparse, chain-3, "
                                           "chain-7)")
    for row in DRAFTERS.values():
        if row.settings is not None:
            row.settings.add_cli_args(parser)


def settings_from_cli(args, kind: str):
    """A drafter kind's own settings from add_cli_args' flags (None for kinds without any)."""
    row = DRAFTERS[kind]
    return row.settings.from_cli(args) if row.settings is not None else None
