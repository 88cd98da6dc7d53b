"""The drafter protocol: what the speculative loop asks of anything that proposes tokens.

A drafter is a frozen (hashable, static) object holding its settings and the static tree it
fills each round; its array state (a draft model's KV cache, an n-gram history) is a pytree
that rides in the loop state. The loop calls, with `params` the drafter's arrays (a draft
model's weights; None for drafters without any):

    state = drafter.init(params, batch, capacity, max_out, first)
    tokens, q, state = drafter.propose(params, state, round)
    state = drafter.commit(params, state, round, path, emitted, kept)

propose fills every node of `drafter.tree` (tokens [b, t], tokens[:, 0] = the last committed
token) and says what each proposed node was drawn from: q [b, t-1, v], the distribution of
node i at q[:, i-1], or None for point masses (deterministic proposals, as n-gram lookup's).
Where a row has a structured-output constraint (round.constraint), a drafter that draws from a
distribution draws from the constrained one (RowConstraints.masked, with the state its node's
path reaches), so q is what it sampled from; point masses need nothing (a forbidden one is
rejected).
The target verifies the tree, the loop commits the accepted path (path [b, D+1], node at each
depth) and its tokens (emitted [b, D+1], the first kept[b] of them appended), and commit lets
the drafter follow. Losslessness does not depend on the drafter: the acceptance rule is exact
for any q.

A drafter with a non-empty `feature_layers` (an EAGLE-3 head) also reads the target's hidden
states entering those layers: init gets the prompt's (features=[b, P, F], from the prefill) and
commit the accepted path's (features=[b, D+1, F], from the verify pass).

Drafters: jaxspec.draft_model.ModelDrafter (a draft model: chain or tree),
jaxspec.ngram.NgramDrafter (prompt lookup), jaxspec.decoding.eagle.EagleDrafter (an EAGLE-3 head).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Protocol

import jax.numpy as jnp
from flax import struct

from jaxspec.decoding.constraints import RowConstraints
from jaxspec.decoding.sampling import SamplingArrays
from jaxspec.decoding.trees import Tree


@struct.dataclass
class Round:
    """What a drafter knows at the start of a round, per row."""

    n: jnp.ndarray  # [b] committed tokens (prompt included); s[n-1] is pending in every cache
    prev: jnp.ndarray  # [b] s[n-2]
    last: jnp.ndarray  # [b] s[n-1]
    keys: jnp.ndarray  # [b, t-1, 2] one PRNG key per proposed node
    sampling: SamplingArrays
    greedy_only: bool = struct.field(pytree_node=False)
    attention: str = struct.field(pytree_node=False)
    constraint: RowConstraints | None = None  # the rows' structured-output constraints, if any row has one


class Drafter(Protocol):
    tree: Tree  # static parents array of the nodes proposed each round

    def init(self, params, batch, capacity: int, max_out: int, first: jnp.ndarray): ...

    def propose(self, params, state, r: Round): ...

    def commit(self, params, state, r: Round, path: jnp.ndarray, emitted: jnp.ndarray, kept: jnp.ndarray): ...


@dataclasses.dataclass(frozen=True)
class DrafterKind:
    """One row of the registry of drafter kinds (jaxspec.decoding.method.DRAFTERS): what a
    DecodeMethod of this kind runs and how it is named. Each drafter's file defines its row."""

    kind: str  # DecodeMethod.kind: "draft", "ngram", "eagle"
    label: str  # how summaries and logs name the drafter: "model", "ngram", "eagle"
    takes: type  # the values of generate's `draft` that mean this kind
    build: Callable  # (method, draft, target Model) -> (its Drafter, the drafter's arrays or None)
    name: Callable  # method -> the display name of a chain ("speculative K=3")
    tree_prefix: str = ""  # before a tree's name ("eagle tree sparse")
    trees: bool = False  # takes tree= (a static tree instead of a chain)
    watches_acceptance: bool = True  # each draft costs a model pass: warn when few are accepted
    settings: type | None = None  # the kind's own settings value (DecodeMethod.settings), if any
    parents: Callable | None = None  # method -> the tree it drafts when no tree= is given (else a chain)
    needs: type | None = None  # what `draft` must be when the loop is built
    needs_text: str = ""  # that, in words
