"""Suffix drafting from the job's own text (draft="suffix"): n-gram lookup in the row's text and in
a shared corpus of the call's prompts and finished outputs, as suffix decoding (Arctic Inference)
drafts from earlier requests.

Jobs repeat themselves across records (the same JSON keys, boilerplate, function bodies), so the
continuation of a row's last tokens is often in another record's output. The corpus is a bounded
buffer of the most recent `corpus_tokens` tokens (documents separated by -1), with a hash index
of its n-grams at each of CORPUS_DEPTHS: per depth a table from the hash of the n tokens ending at
a position to the most recent such position. The runner adds each request's prompt and output to
it as the request finishes, between returns to the host; the host rebuilds the tables (numpy)
and the loop, one compiled shape, reads them. Each round a row looks up its last 16, 8, 4, 3 and
2 tokens (a few gathers, whatever the corpus' size) and checks the deepest hit token by token (a
hash collision is a miss, never a wrong proposal); in its own text it searches as n-gram lookup
does (ngram_min to ngram_max tokens, 1 to 3 by default). The longer match is proposed, the row's
own on a tie; with branches > 1 the other source's continuation is among the tree's branches.
Proposals are point masses, so acceptance is exact as for n-gram lookup.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.checks import check_int
from jaxspec.decoding.drafting import DrafterKind, Round
from jaxspec.decoding.ngram import CANDIDATES_PER_BRANCH, Ngram, NgramDrafter, distinct, ranked_continuations
from jaxspec.model.sharding import replicate

SEPARATOR = -1  # between the corpus' documents (never inside a match: a row's own tokens are >= 0)
# n-gram lengths indexed in the corpus, deepest first. Measured on renamed near-duplicates (the
# second of each pair, 10 pairs, 64 tokens, K = 3): (16, 8, 4) 2.29 tokens per target step,
# with 3 and 2 too 2.37, in-row n-gram lookup 1.67; the short ones pick a continuation back up
# right after a renamed identifier.
CORPUS_DEPTHS = (16, 8, 4, 3, 2)
HASH_MULTIPLIER = 0x01000193  # FNV's prime: hash = sum(token[e - j] * M**j) mod 2**32
_POWERS = np.array([pow(HASH_MULTIPLIER, j, 1 << 32) for j in range(max(CORPUS_DEPTHS))], np.uint64)


def _table_size(corpus_tokens: int) -> int:
    return 1 << (2 * corpus_tokens - 1).bit_length()  # a power of two >= 2x the positions: few collisions


def hash_index(tokens: np.ndarray, table_size: int) -> np.ndarray:
    """[len(CORPUS_DEPTHS), table_size] int32: per depth, the most recent position e whose
    n-gram tokens[e - n + 1 .. e] hashes to each bucket (separator-free, and followed by a token
    to propose), else -1."""
    tables = np.full((len(CORPUS_DEPTHS), table_size), -1, np.int32)
    size = len(tokens)
    for d, depth in enumerate(CORPUS_DEPTHS):
        if size <= depth:
            continue
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], depth)  # ends depth-1 .. size-2
        ends = np.arange(depth - 1, size - 1)
        ok = (windows >= 0).all(axis=1) & (tokens[ends + 1] >= 0)
        hashes = (windows[:, ::-1].astype(np.uint64) * _POWERS[:depth]).sum(axis=1) & 0xFFFFFFFF
        np.maximum.at(tables[d], (hashes[ok] & (table_size - 1)).astype(np.int64), ends[ok].astype(np.int32))
    return tables


@jax.tree_util.register_pytree_node_class
class SuffixCorpus:
    """The corpus and its hash index, host side and on the device: `tokens` [corpus_tokens] int32
    (the newest text at the end, SEPARATOR where empty) and `tables` (hash_index). `add` appends
    documents, dropping the oldest tokens past the bound; the loop reads the device arrays (pytree
    leaves: each call passes the current ones)."""

    def __init__(self, tokens, tables, place=None):
        self.tokens, self.tables, self.place = tokens, tables, place

    @classmethod
    def empty(cls, size: int, place=None) -> "SuffixCorpus":
        return cls(None, None, place)._set(np.full(size, SEPARATOR, np.int32))

    @property
    def size(self) -> int:
        return len(self.host)

    def _set(self, host: np.ndarray) -> "SuffixCorpus":
        self.host = host
        put = self.place or jnp.asarray
        self.tokens, self.tables = put(host), put(hash_index(host, _table_size(len(host))))
        return self

    def add(self, documents) -> None:
        """Appends each token list (a prompt, a prompt and its output) followed by SEPARATOR."""
        parts = [np.asarray(list(d) + [SEPARATOR], np.int32) for d in documents if len(d)]
        if parts:
            self._set(np.concatenate([self.host, *parts])[-self.size:])

    def tree_flatten(self):
        return (self.tokens, self.tables), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)


def corpus_match(corpus: SuffixCorpus, history: jnp.ndarray, n: jnp.ndarray, k: int):
    """The deepest CORPUS_DEPTHS n-gram of each row's text that the corpus holds: (the k tokens
    after its most recent occurrence [b, 1, k] (SEPARATOR past a document's end), found [b, 1],
    its length [b] (0: none))."""
    b, width = history.shape
    size, table = corpus.tokens.shape[0], corpus.tables.shape[1]
    tokens, found, length = jnp.zeros((b, k), jnp.int32), jnp.zeros((b,), bool), jnp.zeros((b,), jnp.int32)
    for d, depth in reversed(list(enumerate(CORPUS_DEPTHS))):  # shallowest first: deeper hits overwrite
        at = n[:, None] - 1 - jnp.arange(depth)[None, :]  # [b, depth]: the row's last tokens, newest first
        last = jnp.take_along_axis(history, jnp.clip(at, 0, width - 1), axis=1)
        h = jnp.sum(last.astype(jnp.uint32) * jnp.asarray(_POWERS[:depth].astype(np.uint32))[None, :], axis=1,
                    dtype=jnp.uint32)
        end = corpus.tables[d][(h & (table - 1)).astype(jnp.int32)]  # [b]
        seen = corpus.tokens[jnp.clip(end[:, None] - jnp.arange(depth)[None, :], 0, size - 1)]
        hit = (end >= 0) & (n >= depth) & jnp.all(seen == last, axis=1)
        follow = corpus.tokens[jnp.clip(end[:, None] + 1 + jnp.arange(k)[None, :], 0, size - 1)]
        follow = jnp.where(end[:, None] + 1 + jnp.arange(k)[None, :] < size, follow, SEPARATOR)
        tokens = jnp.where(hit[:, None], follow, tokens)
        found, length = found | hit, jnp.where(hit, depth, length)
    return tokens[:, None, :], found[:, None], length


@dataclasses.dataclass(frozen=True)
class SuffixDrafter(NgramDrafter):
    """n-gram lookup (its history state and commit) in the row, and the corpus' index."""

    def propose(self, corpus: SuffixCorpus, history: jnp.ndarray, r: Round):
        c = 1 if self.branches == 1 else CANDIDATES_PER_BRANCH * self.branches
        row, row_found, row_length = ranked_continuations(history, r.n, self.ngram_min, self.ngram_max, self.k, c)
        other, other_found, other_length = corpus_match(corpus, history, r.n, self.k)
        first = (other_length > row_length[:, 0])[:, None, None]  # the corpus' match is longer
        tokens = jnp.where(first, jnp.concatenate([other, row], 1), jnp.concatenate([row, other], 1))
        found = jnp.where(first[..., 0], jnp.concatenate([other_found, row_found], 1),
                          jnp.concatenate([row_found, other_found], 1))
        # A continuation that runs past a corpus document's end repeats the row's last token there.
        tokens = jnp.where(tokens >= 0, tokens, r.last[:, None, None])
        branches = distinct(tokens, found, self.branches).reshape(tokens.shape[0], -1)
        return jnp.concatenate([r.last[:, None], branches], axis=1), None, history


@dataclasses.dataclass(frozen=True)
class Suffix:
    """`generate(draft=Suffix(...))` (or draft="suffix"): suffix drafting settings: n-gram lookup's
    in the row (jaxspec.ngram.Ngram's, checked the same) and `corpus_tokens`, the bound on the
    shared corpus (device memory: 4 bytes a token for the text, 40 to 80 for its index; the
    lookup per round does not grow with it)."""

    ngram_min: int = 1
    ngram_max: int = 3
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
