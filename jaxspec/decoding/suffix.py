"""Suffix drafting from the job's own text (draft="suffix"): n-gram lookup over the row's text and
a shared corpus of the call's prompts and finished outputs, as suffix decoding (Arctic Inference)
drafts from earlier requests.

Jobs repeat themselves across records (the same JSON keys, boilerplate, function bodies), so the
continuation of a row's last tokens is often in another record's output. The corpus is a bounded
buffer of the most recent `corpus_tokens` tokens (documents separated by -1), on the device; the
runner adds each request's prompt and output to it as the request finishes, between returns to
the host, so the compiled loop keeps one shape. Each round looks the row's last n tokens up in its
own text and the corpus together: the longest match wins, the row's own text on a tie (so with
nothing in common it proposes what in-row n-gram lookup proposes), and its continuation is
proposed. Proposals are point masses, so acceptance is exact as for n-gram lookup.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.checks import check_int
from jaxspec.decoding.drafting import DrafterKind, Round
from jaxspec.decoding.ngram import CANDIDATES_PER_BRANCH, Ngram, NgramDrafter, continuations, distinct
from jaxspec.model.sharding import replicate

SEPARATOR = -1  # between the corpus' documents (never matches: a row's own tokens are >= 0)


@jax.tree_util.register_pytree_node_class
class SuffixCorpus:
    """The corpus, host side and on the device: `tokens` [corpus_tokens] int32, the newest text at
    the end, SEPARATOR-filled where empty. `add` appends documents, dropping the oldest tokens
    past the bound; the loop reads `tokens` (a pytree leaf: each call passes the current array)."""

    def __init__(self, tokens, place=None):
        self.tokens, self.place = tokens, place

    @classmethod
    def empty(cls, size: int, place=None) -> "SuffixCorpus":
        return cls(None, place)._set(np.full(size, SEPARATOR, np.int32))

    def _set(self, host: np.ndarray) -> "SuffixCorpus":
        self.host = host
        self.tokens = self.place(host) if self.place is not None else jnp.asarray(host)
        return self

    @property
    def size(self) -> int:
        return len(self.host)

    def add(self, documents) -> None:
        """Appends each token list (a prompt, a prompt and its output) followed by SEPARATOR."""
        parts = [np.asarray(list(d) + [SEPARATOR], np.int32) for d in documents if len(d)]
        if parts:
            size = len(self.host)
            self._set(np.concatenate([self.host, *parts])[-size:])

    def tree_flatten(self):
        return (self.tokens,), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0])


@dataclasses.dataclass(frozen=True)
class SuffixDrafter(NgramDrafter):
    """n-gram lookup (its history state and commit) over the row's text after the shared corpus."""

    def propose(self, corpus: SuffixCorpus, history: jnp.ndarray, r: Round):
        b, size = history.shape[0], corpus.tokens.shape[0]
        # The corpus first, then the row: a tie in match length goes to the later end, the row's own.
        text = jnp.concatenate([jnp.broadcast_to(corpus.tokens[None, :], (b, size)), history], axis=1)
        c = 1 if self.branches == 1 else CANDIDATES_PER_BRANCH * self.branches
        tokens, found = continuations(text, r.n + size, self.ngram_min, self.ngram_max, self.k, c)
        # A continuation that runs past a corpus document's end repeats the row's last token there.
        tokens = jnp.where(tokens >= 0, tokens, r.last[:, None, None])
        branches = distinct(tokens, found, self.branches).reshape(b, -1)
        return jnp.concatenate([r.last[:, None], branches], axis=1), None, history


@dataclasses.dataclass(frozen=True)
class Suffix:
    """`generate(draft=Suffix(...))` (or draft="suffix"): suffix drafting settings: n-gram lookup's
    (jaxspec.ngram.Ngram's, checked the same) and `corpus_tokens`, the bound on the shared corpus
    (device memory: 4 bytes a token; lookup work per round grows with it)."""

    ngram_min: int = 1
    ngram_max: int = 8  # longer than n-gram lookup's 3: a long match in another record beats a short one in the row
    branches: int = 1
    corpus_tokens: int = 16384
    name: str = "suffix"

    def __post_init__(self):
        Ngram(self.ngram_min, self.ngram_max, self.branches)  # the same checks, naming the same fields
        check_int(self.corpus_tokens, "corpus_tokens", 16, 1 << 22)

    def drafter(self, k: int) -> SuffixDrafter:
        return SuffixDrafter(k, self.branches, self.ngram_min, self.ngram_max)

    @staticmethod
    def add_cli_args(parser) -> None:
        g = parser.add_argument_group("suffix drafting (--draft suffix): n-gram lookup (the --ngram-* flags) in the "
                                      "row's text and the job's earlier prompts and outputs")
        g.add_argument("--suffix-corpus-tokens", type=int, default=16384,
                       help="tokens of the job's text kept to draft from, the most recent (default 16384)")

    @classmethod
    def from_cli(cls, args) -> "Suffix":
        return cls(args.ngram_min, args.ngram_max, args.ngram_branches, corpus_tokens=args.suffix_corpus_tokens)


def _build(method, draft, target):
    mesh = target.mesh
    return method.settings.drafter(method.k), SuffixCorpus.empty(method.settings.corpus_tokens,
                                                                 lambda a: replicate(jnp.asarray(a), mesh))


def _name(method) -> str:
    branches = method.settings.branches
    return f"suffix K={method.k}" + (f" x{branches}" if branches > 1 else "")


KIND = DrafterKind(
    "suffix", "suffix", takes=Suffix, settings=Suffix, watches_acceptance=False,  # proposals cost no model pass
    build=_build, name=_name, parents=lambda method: method.settings.drafter(method.k).tree,
)
