"""An EAGLE-3 head as drafter (jaxspec.model.eagle): a chain of K steps of one decoder layer that
reads the target's own hidden states, or a static tree filled level by level, with its own
one-layer KV cache.

Bookkeeping, with n committed tokens s[0..n) (s[n-1] pending in the target): the head's cache
entry i holds the pair (h_i, s[i+1]) at position i, where h_i = fc(target features of s[i]).
The target has run s[0..n-2], so pairs up to i = n - 2 are known; the ones the head has not
read yet wait in the state (`pending`: their features and next tokens, up to D + 1 of them: a
round's accepted tokens). Each round:
  propose: one pass over the pending pairs writes their entries; the output at the last one
    (i = n - 2) gives the first draft, s[n]; each further draft step reads the pair (the head's
    own last output, the last draft) at the next position;
  commit: the verify pass's features of the accepted path and the committed tokens become the
    pending pairs (positions n - 1 .. n' - 2); entries the drafts wrote past them are
    overwritten next round.
A tree's node i (depth >= 1) is the pair (the head's output at its parent, its token) at position
n - 2 + depth(i) (the root's output: the last pending pair's); each level's pass reruns every
node under the ancestor mask, and the children of that level's parents come from their outputs.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxspec.decoding.draft_model import _pick, pick_children
from jaxspec.decoding.drafting import DrafterKind, Round
from jaxspec.decoding.tree_verify import TreePlan
from jaxspec.decoding.trees import Tree, ancestor_mask, chain
from jaxspec.model.cache import KVCache
from jaxspec.model.eagle import EagleConfig, EagleHead, fuse_features, head_cache, head_forward


@struct.dataclass
class EagleState:
    cache: KVCache  # the head's: entries 0 .. n - 2 - count are final
    features: jnp.ndarray  # [b, T, 3 * target hidden] pending pairs' target features
    tokens: jnp.ndarray  # [b, T] the token after each
    count: jnp.ndarray  # [b] how many pending pairs are real (the rest is padding)


@dataclasses.dataclass(frozen=True)
class EagleDrafter:
    """params: (EagleWeights, the target's embedding table)."""

    config: EagleConfig
    tree: Tree
    feature_layers: tuple[int, ...]  # the target layers whose inputs the loop hands over

    def init(self, params, batch, capacity: int, max_out: int, first: jnp.ndarray, features=None) -> EagleState:
        """Reads the prompt's pairs (its features from the target's prefill, `features` [b, P, F]);
        the last one, (features of the last prompt token, first), waits for the first round."""
        w, embed = params
        b, P = batch.tokens.shape
        rows = jnp.arange(b)
        last = jnp.maximum(batch.prompt_lens - 1, 0)
        nxt = jnp.concatenate([batch.tokens[:, 1:], jnp.zeros((b, 1), jnp.int32)], axis=1).at[rows, last].set(first)
        cache = head_cache(self.config, b, capacity, w.fc.dtype)
        _, _, cache = head_forward(w, self.config, embed, nxt, fuse_features(w, features), cache,
                                   logits_at=last[:, None])
        T = TreePlan.of(self.tree).max_depth + 1  # a round commits at most D + 1 tokens
        pending_f = jnp.zeros((b, T, features.shape[-1]), features.dtype).at[:, 0].set(features[rows, last])
        pending_t = jnp.zeros((b, T), jnp.int32).at[:, 0].set(first)
        return EagleState(cache, pending_f, pending_t, jnp.where(batch.prompt_lens > 0, 1, 0).astype(jnp.int32))

    def propose(self, params, s: EagleState, r: Round):
        w, embed = params
        K = len(self.tree) - 1
        rows = jnp.arange(r.n.shape[0])
        start = r.n - 1 - s.count  # the first pending pair's position
        at = jnp.maximum(s.count - 1, 0)[:, None]
        logits, hidden, cache = head_forward(w, self.config, embed, s.tokens, fuse_features(w, s.features),
                                             s.cache.replace(lengths=start), logits_at=at)
        h = hidden[rows, at[:, 0]]
        cache = cache.replace(lengths=r.n - 1)
        if self.tree != chain(K):
            return self._tree(w, embed, logits, h, cache, r, s)
        state = None if r.constraint is None else r.constraint.state
        token, q = self._pick(w, self._masked(w, logits[:, 0], r, state), r, 0)
        tokens, qs = [token], [q]
        for i in range(1, K):
            logits, hidden, cache = head_forward(w, self.config, embed, token[:, None], h[:, None], cache)
            cache = cache.replace(lengths=cache.lengths + 1)
            h = hidden[:, 0]
            state = None if r.constraint is None else r.constraint.advance(state, token)
            token, q = self._pick(w, self._masked(w, logits[:, 0], r, state), r, i)
            tokens.append(token)
            qs.append(q)
        drafts = jnp.stack([r.last] + tokens, axis=1)
        return drafts, None if r.greedy_only else jnp.stack(qs, axis=1), s.replace(cache=cache)

    def _tree(self, w, embed, root_logits, root_hidden, cache, r: Round, s: EagleState):
        """Fills the tree level by level from the root's logits [b, 1, V_d] and output [b, d]."""
        plan = TreePlan.of(self.tree)
        b, t = r.n.shape[0], plan.size
        parents_of = np.asarray(plan.parents)
        mask = jnp.asarray(ancestor_mask(plan.parents)[1:, 1:])
        positions = (r.n - 2)[:, None] + jnp.asarray(plan.depth[1:], jnp.int32)[None, :]
        tokens = jnp.zeros((b, t), jnp.int32).at[:, 0].set(r.last)
        q_all = None if r.greedy_only else jnp.zeros((b, t - 1, self.config.layer.vocab_size), jnp.float32)
        outputs = jnp.zeros((b, t, root_hidden.shape[-1]), root_hidden.dtype).at[:, 0].set(root_hidden)
        logits, parents = root_logits, np.zeros(1, np.int32)
        states = None if r.constraint is None else jnp.zeros((b, t), jnp.int32).at[:, 0].set(r.constraint.state)
        for d in range(1, plan.max_depth + 1):
            nodes = plan.level(d)
            if d > 1:  # rerun nodes 1 .. t - 1, reading their parents' outputs; logits at level d - 1
                parents = np.unique(parents_of[nodes])
                logits, hidden, cache = head_forward(
                    w, self.config, embed, tokens[:, 1:], outputs[:, parents_of[1:]], cache, positions,
                    jnp.broadcast_to(jnp.asarray(parents - 1, jnp.int32), (b, parents.size)), mask)
                outputs = outputs.at[:, 1:].set(hidden)
            if states is not None:
                logits = self._masked(w, logits, r, states[:, parents])
            chosen, q = pick_children(logits, parents, plan, nodes, r.sampling, r.keys, r.greedy_only)
            tokens = tokens.at[:, nodes].set(w.d2t[chosen])
            if states is not None:
                states = states.at[:, nodes].set(r.constraint.advance(states[:, parents_of[nodes]], w.d2t[chosen]))
            if q is not None:
                q_all = q_all.at[:, nodes - 1].set(self._to_target(w, q))
        return tokens, q_all, s.replace(cache=cache)

    def _masked(self, w, logits, r: Round, states):
        """Draft-vocabulary logits [b, ..., V_d] under the rows' constraints from states [b, ...]
        (none: as they are). A row whose constraint allows none of the head's tokens keeps its
        logits: its draft is then rejected, as any forbidden draft is."""
        if r.constraint is None:
            return logits
        ok = r.constraint.allowed(states)[..., w.d2t]
        return jnp.where(ok | ~jnp.any(ok, axis=-1, keepdims=True), logits, -jnp.inf)

    def _to_target(self, w, q):
        """A distribution over the draft vocabulary [..., V_d] -> over the target's [..., V]."""
        return jnp.zeros(q.shape[:-1] + (self.config.layer.vocab_size,), q.dtype).at[..., w.d2t].set(q)

    def _pick(self, w, logits, r: Round, i: int):
        """Draft i from draft-vocabulary logits: (target ids [b], its distribution over the
        target's vocabulary [b, V] or None)."""
        token, q = _pick(logits, r.sampling, r.keys[:, i], r.greedy_only)
        return w.d2t[token], None if q is None else self._to_target(w, q)

    def commit(self, params, s: EagleState, r: Round, path, emitted, kept, features=None) -> EagleState:
        """The accepted path's target features [b, D+1, F] and the committed tokens wait as the
        next round's pending pairs."""
        return s.replace(features=features.astype(s.features.dtype), tokens=emitted, count=kept)


def _build(method, head, target):
    """The head's drafter, and its arrays: its weights and the target's embedding."""
    drafter = EagleDrafter(head.config, method.parents, head.config.layers_for(target.config))
    return drafter, (head.weights, target.weights.embed)


KIND = DrafterKind("eagle", "eagle", takes=EagleHead, trees=True, needs=EagleHead, needs_text="an EAGLE-3 head",
                   build=_build, name=lambda method: f"eagle K={method.k}", tree_prefix="eagle ")
