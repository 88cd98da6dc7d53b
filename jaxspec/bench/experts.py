"""What a mixture-of-experts step reads (issue 51): the experts its tokens choose, the bytes that
makes, and the locality bound (every token choosing the same experts) for random-weight shapes."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import jaxspec.model.forward as fwd
from jaxspec.bench.shapes import step_weight_bytes
from jaxspec.model.cache import KVCache
from jaxspec.model.loading import Model

ROUTINGS = ("random", "same")
_forward = jax.jit(fwd.forward, static_argnums=1, static_argnames=("routing",))


def context_tokens(vocab: int, batch: int, length: int) -> np.ndarray:
    """The random prefix that timed passes and expert counts see in their caches (the same one, so
    a pass is timed on the experts it is counted on)."""
    return np.random.default_rng(1).integers(1, vocab, (batch, length))


def filled_cache(model: Model, batch: int, length: int, capacity: int, mesh=None) -> KVCache:
    """A cache of `capacity` positions holding the K/V of context_tokens (length of them). A
    verify pass timed over an empty cache routes as if its tokens had no context, and on random
    weights its tokens then spread over more experts than the same tokens after a prefix: before
    2026-12-07 the bench's passes were timed so but their floors counted after a prefix
    (docs/moe.md)."""
    c = model.config
    cache = KVCache.create(c, batch, capacity, model.dtype, stacked=not isinstance(model.weights.layers, tuple),
                           mesh=mesh)
    if not length:
        return cache
    prefix = jnp.asarray(context_tokens(c.vocab_size, batch, length), jnp.int32)
    _, filled = _forward(model.weights, c, prefix, cache)
    filled = jax.tree.map(lambda a, was: jax.device_put(a, was.sharding), filled, cache)  # (placed as created)
    return filled.replace(lengths=jnp.full((batch,), length, jnp.int32, device=cache.lengths.sharding))


def unique_experts(model: Model, tokens: np.ndarray, cache_len: int, passes: int = 1) -> float:
    """Mean over sparse layers of the distinct experts that `tokens` [b, t] choose after the
    cache_len tokens of context_tokens (forward's routing); with passes > 1, also mean over the
    tokens + i (i < passes, modulo the vocabulary) that a timed loop's passes run."""
    b, t = tokens.shape
    cache = filled_cache(model, b, cache_len, cache_len + t)
    counts = []
    for i in range(passes):
        shifted = jnp.asarray((tokens + i) % model.config.vocab_size, jnp.int32)
        *_, routing = _forward(model.weights, model.config, shifted, cache, routing=True)
        counts += [len(np.unique(layer)) for layer in np.asarray(routing)]  # [L, b, t, k]: a layer each
    return float(np.mean(counts))


def one_expert_bytes(model: Model) -> int:
    """One expert's gate, up and down (8-bit: values and scales), from the weights themselves."""
    layers = model.weights.layers
    layers = layers if isinstance(layers, tuple) else (layers,)  # (stacked: a leading layer axis)
    leaves = jax.tree.leaves([(w.experts_gate_up, w.experts_down) for w in layers])
    return sum(a.nbytes for a in leaves) // (len(model.config.sparse_layers) * model.config.num_experts)


def active_weight_bytes(model: Model, experts_per_layer: float) -> float:
    """Weight bytes a step reads per device when each layer reads `experts_per_layer` distinct
    experts: step_weight_bytes with every expert counted, less the experts not read."""
    c = model.config
    unread = len(c.sparse_layers) * (c.num_experts - experts_per_layer) * one_expert_bytes(model) / model.tensor_parallel
    return step_weight_bytes(model) - unread


def same_routing(model: Model) -> Model:
    """The model with every router zeroed: all experts tie, so every token chooses the same
    experts_per_token (top_k's first), the locality bound of a verify pass (its K + 1 tokens read
    what one token reads)."""
    zero = lambda layer: layer if layer.router is None else dataclasses.replace(  # noqa: E731
        layer, router=jnp.zeros_like(layer.router))
    layers = model.weights.layers
    layers = tuple(zero(w) for w in layers) if isinstance(layers, tuple) else zero(layers)
    return dataclasses.replace(model, weights=dataclasses.replace(model.weights, layers=layers),
                               name=model.name + "-same-routing", graphs=type(model.graphs)())


def with_routing(model: Model, routing: str) -> Model:
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}; got {routing!r}")
    return same_routing(model) if routing == "same" and model.config.is_moe else model

