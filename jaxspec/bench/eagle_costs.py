"""The `eagle` part of `jaxspec bench --shape`: what an EAGLE-3 head costs at a real shape (random
weights at the published heads' sizes, jaxspec.bench.shapes.random_head).

Rows: the head's one-token step (against the floor of the bytes it reads: its layer, final norm
and draft-vocabulary head; the token's embedding row is the target's), its first pass of a round
(fc over the K + 1 accepted pairs, then the layer), and rounds of K drafts through `generate`
against their parts, with the speedup projected at given tokens per round (random weights
accept nothing)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxspec.bench.common import best_seconds
from jaxspec.model.eagle import FEATURES, EagleHead, fuse_features, head_cache, head_forward


@functools.partial(jax.jit, static_argnames=("config", "steps", "fused"), donate_argnames=("cache",))
def _head_loop(weights, embed, cache, tokens, hidden, *, config, steps, fused):
    """`steps` head passes of the same shape (tokens change per pass so nothing is hoisted);
    fused: `hidden` is target features, through fc first (a round's first pass)."""
    def body(i, carry):
        cache, acc = carry
        h = fuse_features(weights, hidden) if fused else hidden
        logits, _, cache = head_forward(weights, config, embed, (tokens + i) % config.layer.vocab_size, h, cache)
        return cache, acc + logits[:, 0, 0]
    return jax.lax.fori_loop(0, steps, body, (cache, jnp.zeros(tokens.shape[:1], jnp.float32)))


def head_ms(head: EagleHead, embed, prefix: int, t: int, fused: bool, steps: int, repeats: int) -> float:
    """ms of one head pass of t tokens (batch 1) over a `prefix`-entry cache."""
    c = head.config
    width = FEATURES * c.target_hidden_size if fused else c.layer.hidden_size
    hidden = jnp.ones((1, t, width), head.dtype) * 0.01
    tokens = jnp.ones((1, t), jnp.int32)
    state = {"cache": head_cache(c, 1, prefix + t + 64, head.dtype).replace(lengths=jnp.full((1,), prefix, jnp.int32))}

    def run():
        state["cache"], acc = _head_loop(head.weights, embed, state["cache"], tokens, hidden, config=c, steps=steps,
                                         fused=fused)
        acc.block_until_ready()

    return 1000 * best_seconds(run, repeats) / steps


def head_step_bytes(head: EagleHead) -> int:
    """Bytes a one-token head step reads: everything but fc (a round's first pass only) and d2t."""
    w = head.weights
    return sum(a.nbytes for a in jax.tree.leaves((w.embed_norm, w.layer, w.final_norm, w.lm_head)))
