"""Named real-model shapes with random weights made on the device, for benchmarks at real scale.

Each shape is the HF `config.json` of a public model (sizes, RoPE, biases, tied embeddings), so
the engine builds exactly the graph it would for the real checkpoint; only the weight values are
random (normal, std 0.02; norms 1). EOS is switched off so every row decodes its full budget.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxspec.config import ModelConfig, config_from_hf
from jaxspec.errors import InputError
from jaxspec.loading import Model
from jaxspec import model as engine_model
from jaxspec.model import LayerWeights, Weights

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}


def _llama3(hidden, inter, layers, heads, kv_heads, tied, rope_factor=8.0, head_dim=None):
    return {
        "model_type": "llama", "vocab_size": 128256, "hidden_size": hidden, "intermediate_size": inter,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": head_dim or hidden // heads, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": {**_LLAMA3_ROPE, "factor": rope_factor}, "max_position_embeddings": 131072,
        "tie_word_embeddings": tied,
    }


def _qwen25(vocab, hidden, inter, layers, heads, kv_heads, tied):
    return {
        "model_type": "qwen2", "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": inter,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 32768,
        "tie_word_embeddings": tied,
    }


SHAPES = {
    "llama3-8b": _llama3(4096, 14336, 32, 32, 8, tied=False),
    "llama3.2-1b": _llama3(2048, 8192, 16, 32, 8, tied=True, rope_factor=32.0, head_dim=64),
    "llama3.2-3b": _llama3(3072, 8192, 28, 24, 8, tied=True, rope_factor=32.0, head_dim=128),
    "llama3-70b": _llama3(8192, 28672, 80, 64, 8, tied=False),
    "qwen2.5-7b": _qwen25(152064, 3584, 18944, 28, 28, 4, tied=False),
    "qwen2.5-0.5b": _qwen25(151936, 896, 4864, 24, 14, 2, tied=True),
    # For tests of the benchmark itself: a Llama of a few hundred thousand parameters.
    "tiny": _llama3(64, 128, 2, 4, 2, tied=False) | {"vocab_size": 512, "max_position_embeddings": 4096},
}


def shape_config(name: str) -> ModelConfig:
    if name not in SHAPES:
        raise InputError(f"shape {name!r} is unknown; named shapes: {', '.join(SHAPES)}")
    return dataclasses.replace(config_from_hf(SHAPES[name]), eos_token_ids=(), bos_token_id=None)


def layer_shapes(c: ModelConfig, mlp: bool) -> dict[str, tuple]:
    """The shapes of one layer's LayerWeights fields that this config uses (a tuple of shapes for
    gate/up kept apart: mlp=False, see model.fuse_mlp)."""
    d, f, h, n, k, g = c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim, c.queries_per_kv
    shapes = {"attn_norm": (d,), "wqkv": (d, n, g + 2, k), "wo": (h, k, d), "mlp_norm": (d,),
              "w_gate_up": (d, 2, f) if mlp else ((d, f), (d, f)), "w_down": (f, d)}
    if c.qkv_bias:
        shapes["bqkv"] = (n, g + 2, k)
    if c.o_bias:
        shapes["bo"] = (d,)
    if c.qk_norm:
        shapes |= {"q_norm": (k,), "k_norm": (k,)}
    if c.mlp_bias:
        shapes |= {"b_gate_up": (2, f) if mlp else ((f,), (f,)), "b_down": (d,)}
    return shapes


@functools.partial(jax.jit, static_argnames=("shape", "dtype", "norm"))
def _random(key, *, shape, dtype, norm: bool):
    if norm:
        return jnp.ones(shape, dtype)
    return (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def random_weights(c: ModelConfig, dtype, seed: int = 0) -> Weights:
    """Weights of config c, made on the default device one array at a time (no host copy)."""
    key = jax.random.PRNGKey(seed)

    def make(shape, norm=False):
        nonlocal key
        if isinstance(shape[0], tuple):  # gate and up apart
            return tuple(make(s, norm) for s in shape)
        key, sub = jax.random.split(key)
        return _random(sub, shape=shape, dtype=jnp.dtype(dtype), norm=norm)

    shapes = layer_shapes(c, engine_model.fuse_mlp())
    layers = engine_model.arrange_layers(tuple(
        LayerWeights(**{name: make(shape, norm=name.endswith("norm")) for name, shape in shapes.items()})
        for _ in range(c.num_layers)
    ))
    d, v = c.hidden_size, c.vocab_size
    head = None if c.tie_word_embeddings else make((d, v))
    return Weights(embed=make((v, d)), layers=layers, final_norm=make((d,), norm=True), lm_head=head)


def random_model(name: str, dtype="bfloat16", seed: int = 0) -> Model:
    config = shape_config(name)
    dtype = jnp.dtype(dtype)
    return Model(config, random_weights(config, dtype, seed), None, name, Path(name), dtype)


def weight_bytes(weights: Weights) -> int:
    return sum(a.nbytes for a in jax.tree.leaves(weights))


def step_weight_bytes(model: Model) -> int:
    """Weight bytes one decode step must read: all, less an untied embedding table (a gather
    reads only the rows of the step's tokens)."""
    untied_embed = 0 if model.config.tie_word_embeddings else model.weights.embed.nbytes
    return weight_bytes(model.weights) - untied_embed
