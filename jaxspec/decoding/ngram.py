"""Prompt lookup (n-gram) drafting: no draft model, proposals copied from the row's own text.

Each round, per row, the last n committed tokens (n from ngram_max down to ngram_min) are looked
up in the row's prompt + generated tokens, held in a device buffer; the K tokens that followed
the most recent earlier occurrence of the longest matching suffix are proposed. Where that
continuation runs into the suffix itself (a repeating pattern), it repeats with the pattern's
period. With `branches` > 1 the continuations of up to that many more matches that differ from
the ones already taken fill a tree of `branches` chains of depth K from the root, verified in
one pass. No match: the last token repeated is proposed (the target's own token is still
committed). The search is a vectorised comparison over the buffer inside the loop: no host
round trip.

Proposals are point masses, so the loop's acceptance is exact with q one-hot: greedy accepts
while equal to the target's argmax; sampling accepts token x with probability p(x) and on
rejection draws from p with x removed (renormalised).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.checks import check_int
from jaxspec.decoding.drafting import DrafterKind, Round
from jaxspec.decoding.trees import Tree
from jaxspec.errors import InputError

CANDIDATES_PER_BRANCH = 4  # matches looked at per branch when picking distinct continuations


def ngram_tree(k: int, branches: int = 1) -> Tree:
    """`branches` chains of k nodes from the root; branch j's node i is 1 + j*k + i."""
    return (-1,) + tuple(0 if i == 0 else 1 + j * k + i - 1 for j in range(branches) for i in range(k))


def match_lengths(history: jnp.ndarray, n: jnp.ndarray, ngram_max: int) -> jnp.ndarray:
    """[b, L]: for each end position e, how many of the last ngram_max tokens of the row's
    history[:n] end there too (history[e - j] == history[n - 1 - j] for j < that count), 0 at
    and past n - 1 (no continuation to copy)."""
    b, L = history.shape
    e = jnp.arange(L)[None, :]
    run = jnp.ones((b, L), bool)
    length = jnp.zeros((b, L), jnp.int32)
    for j in range(ngram_max):
        shifted = jnp.pad(history, ((0, 0), (j, 0)), constant_values=-1)[:, :L]  # history[e - j]
        wanted = jnp.take_along_axis(history, jnp.maximum(n - 1 - j, 0)[:, None], axis=1)  # [b, 1]
        run &= (shifted == wanted) & (e - j >= 0) & (n[:, None] - 1 - j >= 0)
        length += run
    return jnp.where(e < n[:, None] - 1, length, 0)


def continuations(history, n, ngram_min: int, ngram_max: int, k: int, candidates: int):
    """The continuations of the `candidates` best matches (longest first, then most recent):
    (tokens [b, candidates, k], found [b, candidates] bool)."""
    return ranked_continuations(history, n, ngram_min, ngram_max, k, candidates)[:2]


def ranked_continuations(history, n, ngram_min: int, ngram_max: int, k: int, candidates: int):
    """continuations' (tokens, found) and each match's length [b, candidates] (0: none)."""
    L = history.shape[1]
    length = match_lengths(history, n, ngram_max)
    score = jnp.where(length >= ngram_min, length * L + jnp.arange(L)[None, :], -1)
    best, end = jax.lax.top_k(score, candidates)  # [b, c]
    found = best >= 0
    end = jnp.where(found, end, n[:, None] - 2)  # no match: repeat the last token
    period = n[:, None, None] - 1 - end[..., None]  # >= 1
    at = end[..., None] + 1 + jnp.arange(k)[None, None, :] % period  # [b, c, k], all < n
    tokens = jnp.take_along_axis(history[:, None, :], jnp.clip(at, 0, L - 1), axis=2)
    return tokens, found, jnp.where(found, best // L, 0)


def distinct(tokens: jnp.ndarray, found: jnp.ndarray, branches: int) -> jnp.ndarray:
    """[b, branches, k]: the first continuation, then each found one unlike all taken before,
    in order; slots left over repeat the first (a duplicate branch is verified and wasted,
    never wrong)."""
    b, c, k = tokens.shape
    taken = jnp.broadcast_to(tokens[:, :1], (b, branches, k))
    count = jnp.ones((b,), jnp.int32)
    for m in range(1, c):
        new = found[:, m] & (count < branches) & jnp.all(jnp.any(taken != tokens[:, m, None], axis=2), axis=1)
        slot = new[:, None] & (jnp.arange(branches)[None, :] == count[:, None])
        taken = jnp.where(slot[..., None], tokens[:, m, None], taken)
        count += new
    return taken


@dataclasses.dataclass(frozen=True)
class NgramDrafter:
    """State: the history buffer [b, cache capacity] (prompt, then committed tokens, then -1)."""

    k: int  # tokens proposed per branch
    branches: int = 1
    ngram_min: int = 1
    ngram_max: int = 3

    @property
    def tree(self) -> Tree:
        return ngram_tree(self.k, self.branches)

    def with_k(self, k: int) -> "NgramDrafter":
        """The same lookup proposing k tokens per branch (adaptive K's loops)."""
        return dataclasses.replace(self, k=k)

    def init(self, params, batch, capacity: int, max_out: int, first: jnp.ndarray) -> jnp.ndarray:
        # As wide as the cache (>= prompt + max_out), so batches of any prompt bucket share one shape.
        b, p = batch.tokens.shape
        history = jnp.pad(batch.tokens, ((0, 0), (0, capacity - p)))
        # Mask the padding past each prompt: it must never match.
        history = jnp.where(jnp.arange(capacity)[None, :] < batch.prompt_lens[:, None], history, -1)
        return history.at[jnp.arange(b), batch.prompt_lens].set(first)

    def propose(self, params, history: jnp.ndarray, r: Round):
        c = 1 if self.branches == 1 else CANDIDATES_PER_BRANCH * self.branches
        tokens, found = continuations(history, r.n, self.ngram_min, self.ngram_max, self.k, c)
        branches = distinct(tokens, found, self.branches).reshape(tokens.shape[0], -1)
        return jnp.concatenate([r.last[:, None], branches], axis=1), None, history

    def commit(self, params, history, r: Round, path, emitted, kept) -> jnp.ndarray:
        j = jnp.arange(emitted.shape[1])[None, :]
        at = jnp.where(j < kept[:, None], r.n[:, None] + j, history.shape[1])  # past the end: dropped
        return history.at[jnp.arange(history.shape[0])[:, None], at].set(emitted, mode="drop")


@dataclasses.dataclass(frozen=True)
class Ngram:
    """`generate(draft=Ngram(...))` (or draft="ngram"): n-gram lookup settings, checked here."""

    ngram_min: int = 1
    ngram_max: int = 3
    branches: int = 1
    name: str = "ngram"

    def __post_init__(self):
        for field in ("ngram_min", "ngram_max", "branches"):
            check_int(getattr(self, field), field, 1, 16)
        if self.ngram_min > self.ngram_max:
            raise InputError(f"ngram_min ({self.ngram_min}) must not exceed ngram_max ({self.ngram_max})")

    def drafter(self, k: int) -> NgramDrafter:
        return NgramDrafter(k, self.branches, self.ngram_min, self.ngram_max)

    @staticmethod
    def add_cli_args(parser) -> None:
        g = parser.add_argument_group("n-gram lookup (--draft ngram): proposals copied from the prompt and output")
        g.add_argument("--ngram-max", type=int, default=3, help="longest suffix looked up (default 3)")
        g.add_argument("--ngram-min", type=int, default=1, help="shortest suffix looked up (default 1)")
        g.add_argument("--ngram-branches", type=int, default=1,
                       help="verify up to this many distinct continuations as a tree (default 1: a chain)")

    @classmethod
    def from_cli(cls, args) -> "Ngram":
        return cls(args.ngram_min, args.ngram_max, args.ngram_branches)


def _name(method) -> str:
    branches = method.settings.branches
    return f"ngram K={method.k}" + (f" x{branches}" if branches > 1 else "")


KIND = DrafterKind(
    "ngram", "ngram", takes=Ngram, settings=Ngram, watches_acceptance=False,  # proposals cost no model pass
    build=lambda method, draft, target: (method.settings.drafter(method.k), None),
    name=_name, parents=lambda method: method.settings.drafter(method.k).tree,
)
