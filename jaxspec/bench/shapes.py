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

from jaxspec.errors import InputError
from jaxspec.model import layout
from jaxspec.model.config import ModelConfig, config_from_hf
from jaxspec.model.eagle import FEATURES, EagleConfig, EagleHead, EagleWeights
from jaxspec.model.loading import Model
from jaxspec.model.sharding import (
    check_expert_parallel,
    check_tensor_parallel,
    make_mesh,
    named,
    serving_config,
    spec,
    split_axes,
)
from jaxspec.model.weights import (
    LAYER_AXES,
    SPLIT_MLP_AXES,
    TOP_AXES,
    LayerWeights,
    Weights,
    arrange_layers,
    fuse_layer,
    place,
    quantize_weights,
)

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
    # Mixtures of experts at their real widths, 8 of their layers (48 and 32): a whole model fits
    # neither the GPU machine's disk nor, for Mixtral, one GPU in bf16; costs are reported per layer.
    "qwen3-30b-a3b-8l": {
        "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
        "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
        "num_hidden_layers": 8, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960, "tie_word_embeddings": False,
    },
    "mixtral-8x7b-8l": {
        "model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
        "num_local_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 8, "num_attention_heads": 32,
        "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
    },
    "qwen3-0.6b": {
        "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072,
        "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960, "tie_word_embeddings": True,
    },
    # For tests of the benchmark itself: a Llama of a few hundred thousand parameters.
    "tiny": _llama3(64, 128, 2, 4, 2, tied=False) | {"vocab_size": 512, "max_position_embeddings": 4096},
    "tiny-moe": {"model_type": "qwen3_moe", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
                 "moe_intermediate_size": 32, "num_experts": 16, "num_experts_per_tok": 4, "norm_topk_prob": True,
                 "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                 "max_position_embeddings": 4096},
}


def shape_config(name: str) -> ModelConfig:
    if name not in SHAPES:
        raise InputError(f"shape {name!r} is unknown; named shapes: {', '.join(SHAPES)}")
    return dataclasses.replace(config_from_hf(SHAPES[name]), eos_token_ids=(), bos_token_id=None)


def projection_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(k, n) of each fused projection of one layer, and the LM head."""
    d, hd = config.hidden_size, config.head_dim
    return {"wqkv": (d, (config.num_heads + 2 * config.num_kv_heads) * hd), "wo": (config.num_heads * hd, d),
            "w_gate_up": (d, 2 * config.intermediate_size), "w_down": (config.intermediate_size, d),
            "lm_head": (d, config.vocab_size)}


def layer_shapes(c: ModelConfig, mlp: bool, sparse: bool) -> dict[str, tuple]:
    """The shapes of one layer's LayerWeights fields that this config uses (a tuple of shapes for
    gate/up kept apart: mlp=False, see model.fuse_mlp); sparse: a mixture of experts' layer."""
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
    if sparse:  # the experts replace the dense MLP
        e, fe = c.num_experts, c.moe_intermediate_size
        del shapes["w_gate_up"], shapes["w_down"]
        shapes |= {"router": (d, e), "experts_gate_up": (e, d, 2, fe), "experts_down": (e, fe, d)}
    return shapes


@functools.lru_cache(maxsize=None)
def _maker(shape: tuple, dtype, norm: bool, sharding):
    """A jitted maker of one random array, written straight into its shards (a 70B model does not
    fit one device)."""
    def make(key):
        if norm:
            return jnp.ones(shape, dtype)
        return (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
    return jax.jit(make) if sharding is None else jax.jit(make, out_shardings=sharding)


def random_weights(c: ModelConfig, dtype, seed: int = 0, mesh=None, expert_parallel: bool = False) -> Weights:
    """Weights of config c (the serving config: kv heads already repeated for mesh), made on the
    default device, or split over `mesh` (expert_parallel: the experts by expert), one array at a
    time (no host copy)."""
    key = jax.random.PRNGKey(seed)
    tp = 1 if mesh is None else mesh.size

    def make(shape, axes, norm=False):
        nonlocal key
        key, sub = jax.random.split(key)
        return _maker(shape, jnp.dtype(dtype), norm, named(mesh, spec(split_axes(axes, c, tp, expert_parallel))))(sub)

    mlp = layout.fuse_mlp()

    def layer(i):
        out = {}
        for name, shape in layer_shapes(c, mlp, i in c.sparse_layers).items():
            if isinstance(shape[0], tuple):  # gate and up apart
                out[name] = tuple(make(s, SPLIT_MLP_AXES[name]) for s in shape)
            else:
                out[name] = make(shape, LAYER_AXES[name], norm=name.endswith("norm"))
        return LayerWeights(**out)

    layers = arrange_layers(c, tuple(layer(i) for i in range(c.num_layers)))
    d, v = c.hidden_size, c.vocab_size
    top = TOP_AXES
    head = None if c.tie_word_embeddings else make((d, v), top["lm_head"])
    weights = Weights(embed=make((v, d), top["embed"]), layers=layers, final_norm=make((d,), top["final_norm"], norm=True),
                      lm_head=head, expert_parallel=expert_parallel and mesh is not None)
    return place(weights, c, mesh)


def random_model(name: str, dtype="bfloat16", seed: int = 0, tensor_parallel: int = 1,
                 quantize: str | None = None, expert_parallel: bool = False) -> Model:
    """A named shape with random weights, split over tensor_parallel devices (quantize: its
    projections in 8 bits, expert_parallel: its experts by expert, as jaxspec.load gives them)."""
    config = shape_config(name)
    expert_parallel = check_expert_parallel(config, expert_parallel, name)
    tp = check_tensor_parallel(config, tensor_parallel, name, expert_parallel)
    config = serving_config(config, tp)
    mesh = make_mesh(tp) if tp > 1 else None
    dtype = jnp.dtype(dtype)
    weights = random_weights(config, dtype, seed, mesh, expert_parallel)
    if quantize is not None:
        weights = quantize_weights(weights, config, quantize)
    return Model(config, weights, None, name + (f"-{quantize}" if quantize else ""), Path(name), dtype, mesh,
                 quantize=quantize)


def random_head(target: ModelConfig, draft_vocab_size: int, intermediate_size: int | None = None,
                dtype="bfloat16", seed: int = 0, name: str = "eagle3") -> EagleHead:
    """An EAGLE-3 head of random weights at `target`'s width (the published heads' sizes: Llama
    3.1 8B's have a 32000-token draft vocabulary and the target's MLP width), made on the default
    device; the target's embedding table serves it."""
    # a Llama layer, as the published heads are (eagle.eagle_config), whatever the target's family:
    # no q/k norms, biases, sliding window or experts
    layer = dataclasses.replace(target, model_type="llama", num_layers=1,
                                intermediate_size=intermediate_size or target.intermediate_size, qkv_bias=False,
                                o_bias=False, mlp_bias=False, qk_norm=False, sliding_window=None, num_experts=0,
                                experts_per_token=0, moe_intermediate_size=0, norm_topk_prob=False)
    config = EagleConfig(layer, target.hidden_size, draft_vocab_size)
    d, f, nh, nkv, hd = layer.hidden_size, layer.intermediate_size, layer.num_heads, layer.num_kv_heads, layer.head_dim
    dtype = jnp.dtype(dtype)
    key = jax.random.PRNGKey(seed)

    def make(*shape, norm=False):
        nonlocal key
        key, sub = jax.random.split(key)
        return _maker(shape, dtype, norm, None)(sub)

    fields = {"attn_norm": make(d, norm=True), "mlp_norm": make(d, norm=True), "wq": make(2 * d, nh, hd),
              "wk": make(2 * d, nkv, hd), "wv": make(2 * d, nkv, hd), "wo": make(nh, hd, d), "w_gate": make(d, f),
              "w_up": make(d, f), "w_down": make(f, d)}
    weights = EagleWeights(fc=make(FEATURES * d, d), embed_norm=make(d, norm=True),
                           layer=LayerWeights(**fuse_layer(layer, fields, layout.fuse_mlp())),
                           final_norm=make(d, norm=True), lm_head=make(d, draft_vocab_size),
                           d2t=jnp.arange(draft_vocab_size, dtype=jnp.int32) * (target.vocab_size // draft_vocab_size))
    return EagleHead(config, weights, name, Path(name), dtype)


def weight_bytes(weights: Weights) -> int:
    return sum(a.nbytes for a in jax.tree.leaves(weights))


def step_weight_bytes(model: Model) -> int:
    """Weight bytes one decode step must read on each device: all, less an untied embedding table
    (a gather reads only the rows of the step's tokens), over the devices that split them."""
    untied_embed = 0 if model.config.tie_word_embeddings else model.weights.embed.nbytes
    return (weight_bytes(model.weights) - untied_embed) // model.tensor_parallel
