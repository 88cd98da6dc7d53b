"""An EAGLE-3 head as drafter (jaxspec.model.eagle): a chain of K steps of one decoder layer that
reads the target's own hidden states, with its own one-layer KV cache.

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
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import struct

from jaxspec.decoding.draft_model import _pick
from jaxspec.decoding.drafting import Round
from jaxspec.decoding.trees import Tree
from jaxspec.model.cache import KVCache
from jaxspec.model.eagle import EagleConfig, fuse_features, head_cache, head_forward


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
        T = len(self.tree)
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
        token, q = self._pick(w, logits[:, 0], r, 0)
        tokens, qs = [token], [q]
        cache = cache.replace(lengths=r.n - 1)
        for i in range(1, K):
            logits, hidden, cache = head_forward(w, self.config, embed, token[:, None], h[:, None], cache)
            cache = cache.replace(lengths=cache.lengths + 1)
            h = hidden[:, 0]
            token, q = self._pick(w, logits[:, 0], r, i)
            tokens.append(token)
            qs.append(q)
        drafts = jnp.stack([r.last] + tokens, axis=1)
        return drafts, None if r.greedy_only else jnp.stack(qs, axis=1), s.replace(cache=cache)

    def _pick(self, w, logits, r: Round, i: int):
        """Draft i from draft-vocabulary logits: (target ids [b], its distribution over the
        target's vocabulary [b, V] or None)."""
        token, q = _pick(logits, r.sampling, r.keys[:, i], r.greedy_only)
        token = w.d2t[token]
        if q is not None:
            q = jnp.zeros((q.shape[0], self.config.layer.vocab_size), q.dtype).at[:, w.d2t].set(q)
        return token, q

    def commit(self, params, s: EagleState, r: Round, path, emitted, kept, features=None) -> EagleState:
        """The accepted path's target features [b, D+1, F] and the committed tokens wait as the
        next round's pending pairs."""
        return s.replace(features=features.astype(s.features.dtype), tokens=emitted, count=kept)
