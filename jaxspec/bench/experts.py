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


def unique_experts(model: Model, tokens: np.ndarray, cache_len: int) -> float:
    """Mean over sparse layers of the distinct experts that `tokens` [b, t] choose after a prefix of
    cache_len random tokens (forward's routing)."""
    b = tokens.shape[0]
    prefix = np.random.default_rng(1).integers(1, model.config.vocab_size, (b, cache_len))
    cache = KVCache.create(model.config, b, cache_len + tokens.shape[1], model.dtype,
                           stacked=not isinstance(model.weights.layers, tuple))
    *_, routing = fwd.forward(model.weights, model.config, jnp.asarray(np.concatenate([prefix, tokens], 1), jnp.int32),
                              cache, routing=True)
    chosen = np.asarray(routing)[:, :, -tokens.shape[1]:]  # [L, b, t, k]
    return float(np.mean([len(np.unique(layer)) for layer in chosen]))


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

