"""Llama-family decoder as pure JAX functions over a weights pytree: layers unrolled over separate
arrays on accelerators, scanned over stacked ones on the CPU (see Weights).

Einsum legend: b batch, t query, s key slot, d model, h query heads, n kv heads, g queries per kv
head, k head dim, f ffn, v vocab.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from flax import struct

from jax.sharding import Mesh, PartitionSpec

from jaxspec.cache import KVCache
from jaxspec.config import ModelConfig
from jaxspec.sharding import CACHE_AXES, TP, kv_repeats, local_config, named, put, serving_config, spec, split_axes
from jaxspec.rope import apply_rope, inverse_frequencies, rope_tables


@struct.dataclass
class LayerWeights:
    """One decoder layer's weights, q/k/v and gate/up fused (one matmul each instead of three and
    two: fewer, larger weight reads per decode step). Optional fields are None when absent.

    The fused q/k/v axis is laid out per kv head (its g query heads, then its key, then its
    value), so splitting axis n over devices splits q, k and v consistently."""

    attn_norm: jnp.ndarray  # [d]
    wqkv: jnp.ndarray  # [d, n, g + 2, k]
    wo: jnp.ndarray  # [h, k, d]
    mlp_norm: jnp.ndarray  # [d]
    w_gate_up: jnp.ndarray | tuple  # [d, 2, f] (gate, up) fused; ([d, f], [d, f]) on the CPU: see fuse_mlp
    w_down: jnp.ndarray  # [f, d]
    bqkv: jnp.ndarray | None = None  # [n, g + 2, k]
    bo: jnp.ndarray | None = None  # [d]
    q_norm: jnp.ndarray | None = None  # [k]
    k_norm: jnp.ndarray | None = None  # [k]
    b_gate_up: jnp.ndarray | tuple | None = None  # [2, f], or ([f], [f]) as w_gate_up
    b_down: jnp.ndarray | None = None  # [d]


@struct.dataclass
class Weights:
    """On accelerators the layers are a tuple of separate arrays, run unrolled: XLA on GPUs copies
    a stacked array's layer slice before each matmul (cuBLAS wants its own buffer), which made an
    8B decode step read its weights about three times (11.5 ms against 4.3 ms per step on an
    H200). On the CPU they stay one LayerWeights stacked over a leading layer axis, run by a
    lax.scan: there the unrolled graph made a speculative round about 1.5x slower (see
    scan_layers)."""

    embed: jnp.ndarray  # [v, d]
    layers: tuple[LayerWeights, ...] | LayerWeights  # per layer, or stacked [L, ...] (scan_layers)
    final_norm: jnp.ndarray  # [d]
    lm_head: jnp.ndarray | None = None  # [d, v]; None when tied to embed
    # The "tp" mesh the arrays are split over (jaxspec.sharding); None: whole on each device.
    mesh: Mesh | None = struct.field(pytree_node=False, default=None)


# Logical axes of the engine-layout arrays (jaxspec.sharding maps them to the mesh); the split
# gate/up of the CPU layout (fuse_mlp) drops the fused pair's axis.
LAYER_AXES = {
    "attn_norm": (None,), "wqkv": (None, "kv_heads", None, None), "wo": ("heads", None, None),
    "mlp_norm": (None,), "w_gate_up": (None, None, "ffn"), "w_down": ("ffn", None),
    "bqkv": ("kv_heads", None, None), "bo": (None,), "q_norm": (None,), "k_norm": (None,),
    "b_gate_up": (None, "ffn"), "b_down": (None,),
}
SPLIT_MLP_AXES = {"w_gate_up": (None, "ffn"), "b_gate_up": ("ffn",)}
TOP_AXES = {"embed": ("vocab", None), "final_norm": (None,), "lm_head": (None, "vocab")}


def weight_specs(weights: Weights, config: ModelConfig) -> Weights:
    """A PartitionSpec for every array of `weights` (a Weights of specs, for shard_map), split over
    weights.mesh."""
    stacked = not isinstance(weights.layers, tuple)
    tp = 1 if weights.mesh is None else weights.mesh.size
    split = lambda axes: split_axes(axes, config, tp)  # noqa: E731

    def layer_specs(layer: LayerWeights) -> LayerWeights:
        out = {}
        for f in dataclasses.fields(LayerWeights):
            value = getattr(layer, f.name)
            if isinstance(value, tuple):
                out[f.name] = tuple(spec(split(SPLIT_MLP_AXES[f.name]), stacked) for _ in value)
            elif value is not None:
                out[f.name] = spec(split(LAYER_AXES[f.name]), stacked)
        return LayerWeights(**out)

    top = {name: spec(split(axes)) for name, axes in TOP_AXES.items() if getattr(weights, name) is not None}
    layers = layer_specs(weights.layers) if stacked else tuple(map(layer_specs, weights.layers))
    return Weights(layers=layers, mesh=weights.mesh, **top)


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One weight, declared once for conversion, validation and random init."""

    field: str  # "embed" or "layers.wq": where it lives in Weights
    hf_name: str  # HF tensor name; "{i}" stands for the layer index
    hf_shape: tuple[int, ...]
    shape: tuple[int, ...]  # engine shape (per layer for layers.*)
    transpose: bool  # HF stores [out, in]; we keep [in, out]
    axes: tuple = ()  # logical axes of `shape` (jaxspec.sharding); () replicated

    @property
    def per_layer(self) -> bool:
        return self.field.startswith("layers.")


def param_specs(c: ModelConfig) -> list[ParamSpec]:
    d, f, v, h, n, k = (
        c.hidden_size, c.intermediate_size, c.vocab_size, c.num_heads, c.num_kv_heads, c.head_dim,
    )
    p = "model.layers.{i}."
    specs = [
        ParamSpec("embed", "model.embed_tokens.weight", (v, d), (v, d), False, ("vocab", None)),
        ParamSpec("final_norm", "model.norm.weight", (d,), (d,), False),
        ParamSpec("layers.attn_norm", p + "input_layernorm.weight", (d,), (d,), False),
        ParamSpec("layers.wq", p + "self_attn.q_proj.weight", (h * k, d), (d, h, k), True, (None, "heads", None)),
        ParamSpec("layers.wk", p + "self_attn.k_proj.weight", (n * k, d), (d, n, k), True, (None, "kv_heads", None)),
        ParamSpec("layers.wv", p + "self_attn.v_proj.weight", (n * k, d), (d, n, k), True, (None, "kv_heads", None)),
        ParamSpec("layers.wo", p + "self_attn.o_proj.weight", (d, h * k), (h, k, d), True, ("heads", None, None)),
        ParamSpec("layers.mlp_norm", p + "post_attention_layernorm.weight", (d,), (d,), False),
        ParamSpec("layers.w_gate", p + "mlp.gate_proj.weight", (f, d), (d, f), True, (None, "ffn")),
        ParamSpec("layers.w_up", p + "mlp.up_proj.weight", (f, d), (d, f), True, (None, "ffn")),
        ParamSpec("layers.w_down", p + "mlp.down_proj.weight", (d, f), (f, d), True, ("ffn", None)),
    ]
    if not c.tie_word_embeddings:
        specs.append(ParamSpec("lm_head", "lm_head.weight", (v, d), (d, v), True, (None, "vocab")))
    if c.qkv_bias:
        specs += [
            ParamSpec("layers.bq", p + "self_attn.q_proj.bias", (h * k,), (h, k), False, ("heads", None)),
            ParamSpec("layers.bk", p + "self_attn.k_proj.bias", (n * k,), (n, k), False, ("kv_heads", None)),
            ParamSpec("layers.bv", p + "self_attn.v_proj.bias", (n * k,), (n, k), False, ("kv_heads", None)),
        ]
    if c.o_bias:
        specs.append(ParamSpec("layers.bo", p + "self_attn.o_proj.bias", (d,), (d,), False))
    if c.qk_norm:
        specs += [
            ParamSpec("layers.q_norm", p + "self_attn.q_norm.weight", (k,), (k,), False),
            ParamSpec("layers.k_norm", p + "self_attn.k_norm.weight", (k,), (k,), False),
        ]
    if c.mlp_bias:
        specs += [
            ParamSpec("layers.b_gate", p + "mlp.gate_proj.bias", (f,), (f,), False, ("ffn",)),
            ParamSpec("layers.b_up", p + "mlp.up_proj.bias", (f,), (f,), False, ("ffn",)),
            ParamSpec("layers.b_down", p + "mlp.down_proj.bias", (d,), (d,), False),
        ]
    return specs


def scan_layers() -> bool:
    """Whether this backend runs the layers as a lax.scan over stacked weights (the CPU) rather
    than unrolled over separate arrays. On the project's 2-core EPYC (JAX 0.10.2) the unrolled
    graph ran a K=3 speculative round of the embedded pair in 18.9 ms against 12.3 with the scan,
    plain steps about the same (4.8 against 5.2 ms): its gate/up matmuls took 307 against 115 us
    each, the scan's slice copy having just pulled the weights into cache."""
    return jax.default_backend() == "cpu"


def arrange_layers(layers: tuple[LayerWeights, ...]) -> tuple[LayerWeights, ...] | LayerWeights:
    """Per-layer weights as this backend runs them: kept apart, or stacked (scan_layers)."""
    return jax.tree.map(lambda *xs: jnp.stack(xs), *layers) if scan_layers() else layers


def fuse_mlp() -> bool:
    """Whether gate and up are one [d, 2, f] matrix on this backend. On GPUs one wider matmul per
    step is one weight read and one kernel; on the CPU the fused matrix outgrows the cache and ran
    1.6-2x slower than two (embedded target's layer, 2-core EPYC, JAX 0.10.2: 189 vs 84 us at 4
    tokens), so there they stay apart."""
    return jax.default_backend() != "cpu"


def fuse_layer(c: ModelConfig, f: dict, mlp: bool) -> dict:
    """One layer's fields as param_specs names them ("wq", "bk", ...) -> LayerWeights fields;
    mlp: fuse gate and up too (see fuse_mlp). Host or (sharded) device arrays in, device arrays
    out: split by kv heads, q/k/v stay split the same way. Fields may come a group at a time
    (FUSED_GROUPS)."""
    n, g, k = c.num_kv_heads, c.queries_per_kv, c.head_dim
    out = {name: f[name] for name in ("attn_norm", "wo", "mlp_norm", "w_down", "bo", "q_norm", "k_norm", "b_down")
           if name in f}
    if "wq" in f:
        out["wqkv"] = jnp.concatenate(
            [f["wq"].reshape(-1, n, g, k), f["wk"][:, :, None], f["wv"][:, :, None]], axis=2)
    if "w_gate" in f:
        out["w_gate_up"] = jnp.stack([f["w_gate"], f["w_up"]], axis=1) if mlp else (f["w_gate"], f["w_up"])
    if "bq" in f:
        out["bqkv"] = jnp.concatenate([f["bq"].reshape(n, g, k), f["bk"][:, None], f["bv"][:, None]], axis=1)
    if "b_gate" in f:
        out["b_gate_up"] = jnp.stack([f["b_gate"], f["b_up"]]) if mlp else (f["b_gate"], f["b_up"])
    return out


def field_shardings(config: ModelConfig, mesh: Mesh | None) -> dict:
    """field -> where a checkpoint-layout array goes (None: the default device)."""
    tp = 1 if mesh is None else mesh.size
    return {p.field: named(mesh, spec(split_axes(p.axes or (None,) * len(p.shape), config, tp), p.per_layer))
            for p in param_specs(config)}


def place(weights: Weights, config: ModelConfig, mesh: Mesh | None) -> Weights:
    """Weights with every array on its shards of `mesh` (a no-op where already there), and the
    mesh recorded when it splits them (more than one device). config: the one they run with
    (serving_config: kv heads already repeated)."""
    if mesh is None:
        return weights
    weights = weights.replace(mesh=mesh if mesh.size > 1 else None)
    specs = weight_specs(weights, config)
    return jax.tree.map(lambda a, p: put(a, named(mesh, p)), weights, specs)


def repeat_kv_heads(a, r: int):
    """Fused q/k/v [..., n, g + 2, k] -> [..., n * r, g / r + 2, k]: each kv head r times, each
    copy with the next g / r of its queries (the order of wo's heads is unchanged)."""
    if r == 1:
        return a
    *lead, n, j, k = a.shape
    g = j - 2
    q = a[..., :g, :].reshape(*lead, n, r, g // r, k)
    kv = jnp.broadcast_to(a[..., None, g:, :], (*lead, n, r, 2, k))
    return jnp.concatenate([q, kv], axis=-2).reshape(*lead, n * r, g // r + 2, k)


FUSED_GROUPS = (("wq", "wk", "wv", "bq", "bk", "bv"), ("w_gate", "w_up", "b_gate", "b_up"))


def weights_from_fields(config: ModelConfig, fields: dict, dtype, mesh: Mesh | None = None) -> Weights:
    """{"embed": ..., "layers.wq": [L, ...], ...} (checkpoint layout, layers stacked; host arrays,
    or device arrays already on their shards) -> Weights in `dtype`, split over `mesh` (None: on
    the default device; the weights then run with serving_config(config, mesh.size)). Each device
    only ever receives its own shards.

    Consumes `fields`: each stacked field is dropped once its layers are cut from it, a fused
    group at a time, so a device holds at most its weights plus one group (gate and up of a 70B
    split two ways: 38 GB beside its 70 GB)."""
    r = kv_repeats(config, 1 if mesh is None else mesh.size)
    shardings = field_shardings(config, mesh)
    mlp = fuse_mlp()
    take = lambda name: put(fields.pop(name), shardings[name]).astype(dtype)  # noqa: E731
    top = {name: take(name) for name in list(fields) if not name.startswith("layers.")}
    names = [name.split(".", 1)[1] for name in fields]
    groups = list(FUSED_GROUPS) + [(n,) for n in names if not any(n in g for g in FUSED_GROUPS)]
    layers = [{} for _ in range(config.num_layers)]
    for group in groups:
        stacked = {n: take("layers." + n) for n in group if "layers." + n in fields}
        for i, layer in enumerate(layers if stacked else ()):
            layer |= fuse_layer(config, {n: a[i] for n, a in stacked.items()}, mlp)
        del stacked  # frees the stacked arrays: the layers hold their own slices
    for layer in layers:
        layer |= {name: repeat_kv_heads(layer[name], r) for name in ("wqkv", "bqkv") if name in layer}
    layers = arrange_layers(tuple(LayerWeights(**layer) for layer in layers))
    return place(Weights(layers=layers, **top), serving_config(config, 1 if mesh is None else mesh.size), mesh)


def rms_norm(x: jnp.ndarray, weight: jnp.ndarray, eps: float) -> jnp.ndarray:
    # As HF: normalise in float32, cast back to the activation dtype, then scale.
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def _add(x: jnp.ndarray, bias: jnp.ndarray | None) -> jnp.ndarray:
    return x if bias is None else x + bias


def attention_mask(
    cache_lengths: jnp.ndarray,  # [b]
    positions: jnp.ndarray,  # [b, t]
    capacity: int,
    chunk_mask: jnp.ndarray,  # [t, t] bool: query i may see new token j
    sliding_window: int | None,
) -> jnp.ndarray:
    """[b, t, s] bool: the committed prefix, plus the new tokens chunk_mask allows."""
    slots = jnp.arange(capacity)
    rel = slots[None, :] - cache_lengths[:, None]  # [b, s]: index into the new chunk
    t = positions.shape[1]
    in_prefix = rel < 0
    in_chunk = (rel >= 0) & (rel < t)
    rel_c = jnp.clip(rel, 0, t - 1)
    chunk_allowed = jnp.moveaxis(chunk_mask[:, rel_c], 0, 1)  # [b, t, s]
    mask = in_prefix[:, None, :] | (in_chunk[:, None, :] & chunk_allowed)
    if sliding_window is not None:
        key_pos = jnp.where(in_prefix, slots[None, :], jnp.take_along_axis(positions, rel_c, axis=1))
        mask &= (positions[:, :, None] - key_pos[:, None, :]) < sliding_window
    return mask


ATTENTION_IMPLS = ("xla", "pallas")
PALLAS_MAX_CHUNK = 64  # the fused kernel serves decode/verify chunks; prefill stays on XLA


def _einsum(spec: str, a, b, **kwargs):
    """jnp.einsum with IEEE float32 products for float32 operands on every backend: JAX's default
    on NVIDIA GPUs is TF32, which put float32 logits 1.7e-3 off HF's on an H200 (torch keeps TF32
    off for matmuls by default). Other dtypes keep the backend's default."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jnp.einsum(spec, a, b, precision=precision, **kwargs)


def _project(spec: str, x, w, pad_one_row: bool, **kwargs):
    """A weight matmul of activations x [b, t, ...]. pad_one_row (the accelerators' layout): XLA's
    GPU simplifier rewrites a vector-matrix product with a matrix under 10M elements into
    multiply + reduce kernels, which ran the 1B draft's q/k/v and o projections far below the
    memory bandwidth (a one-token pass took 1.24 ms against 1.01 ms for two, H200). A zero row
    keeps a one-row product on the GEMM path; the barrier stops the simplifier from seeing
    through it."""
    if not (pad_one_row and x.shape[0] * x.shape[1] == 1):
        return _einsum(spec, x, w, **kwargs)
    padded = lax.optimization_barrier(jnp.pad(x, [(0, 0), (0, 1)] + [(0, 0)] * (x.ndim - 2)))
    return _einsum(spec, padded, w, **kwargs)[:, :1]


def use_pallas(attention: str, config: ModelConfig, chunk: int, capacity: int) -> bool:
    """Whether this forward runs the fused Pallas tree-attention kernel."""
    from pallas_kernels.tree_attention import BLOCK_K

    return (
        attention == "pallas" and config.sliding_window is None and chunk <= PALLAS_MAX_CHUNK
        and capacity % BLOCK_K == 0
    )


def _xla_attention(c: ModelConfig, q, keys, values, mask):
    b, t = q.shape[:2]
    qg = q.reshape(b, t, c.num_kv_heads, c.queries_per_kv, c.head_dim)
    scores = _einsum("btngk,bsnk->bngts", qg, keys, preferred_element_type=jnp.float32)
    scores = scores * (c.head_dim ** -0.5)
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(values.dtype)
    return _einsum("bngts,bsnk->btngk", probs, values).reshape(b, t, c.num_heads, c.head_dim)


def _gate_up(h, w, bias, pad_one_row: bool):
    """(gate, up) [b, t, f] from fused or separate weights (see fuse_mlp)."""
    if isinstance(w, tuple):
        return tuple(_add(_project("btd,df->btf", h, wi, pad_one_row), bi) for wi, bi in zip(w, bias or (None, None)))
    gate_up = _add(_project("btd,dcf->btcf", h, w, pad_one_row), bias)
    return gate_up[:, :, 0], gate_up[:, :, 1]


def _write(cache, layer, rows, slots, new):
    """Writes new [b, t, n, k] at slots (each row's are consecutive); -> (cache, this layer's
    [b, s, n, k]). cache is one layer's array (layer None) or the stacked cache of a scan.

    One row into a per-layer cache (the accelerators' layout) is a slice update: the scatter
    (which drops writes out of bounds) cost XLA a second kernel per write on the GPU, to select
    between new and old values. Every engine loop keeps a running row's writes inside the cache,
    and one row stops its loop when it finishes. (In the CPU's scan a slice update of the stacked
    cache made plain decoding 2x slower: it stays a scatter there.)"""
    new = new.astype(cache.dtype)
    if layer is None:
        if new.shape[0] == 1:
            cache = lax.dynamic_update_slice(cache, new, (0, slots[0, 0], 0, 0))
        else:
            cache = cache.at[rows, slots].set(new, mode="drop")
        return cache, cache
    cache = cache.at[layer, rows, slots].set(new, mode="drop")
    return cache, cache[layer]


def _layer(c: ModelConfig, inv_freq, mask, positions, chunk_mask, pallas: bool, pad_one_row: bool, axis, lengths,
           w: LayerWeights, x, cache_k, cache_v, layer=None):
    """One decoder layer: x [b, t, d] -> (x, cache_k, cache_v). The caches are this layer's
    [b, s, n, k] arrays, or the stacked [L, b, s, n, k] ones with the scan's `layer` index.
    pad_one_row: see _project. axis: the mesh axis when this runs on one shard of the heads and
    ffn columns (c is then the shard's config): the o and down products are summed over it."""
    total = (lambda y: y) if axis is None else (lambda y: lax.psum(y, axis))  # noqa: E731
    b, t, _ = x.shape
    g = c.queries_per_kv

    h = rms_norm(x, w.attn_norm, c.rms_norm_eps)
    qkv = _add(_project("btd,dnjk->btnjk", h, w.wqkv, pad_one_row), w.bqkv)  # j: g queries, key, value
    q = qkv[:, :, :, :g].reshape(b, t, c.num_heads, c.head_dim)
    k, v = qkv[:, :, :, g], qkv[:, :, :, g + 1]
    if c.qk_norm:
        q = rms_norm(q, w.q_norm, c.rms_norm_eps)
        k = rms_norm(k, w.k_norm, c.rms_norm_eps)
    cos, sin = rope_tables(positions, inv_freq, x.dtype)
    q = apply_rope(q, cos, sin)
    k = apply_rope(k, cos, sin)

    # Write the new keys/values beside the committed prefix, then attend over the whole cache.
    slots = lengths[:, None] + jnp.arange(t)[None, :]
    rows = jnp.arange(b)[:, None]
    cache_k, keys = _write(cache_k, layer, rows, slots, k)
    cache_v, values = _write(cache_v, layer, rows, slots, v)

    if pallas:
        from pallas_kernels.tree_attention import tree_attention

        # Prefix = slots < lengths; the chunk's own keys come in beside it under chunk_mask.
        k_new, v_new = k.astype(keys.dtype), v.astype(values.dtype)
        interpret = jax.default_backend() == "cpu"  # the CPU runs Pallas only in interpret mode
        attn = tree_attention(q.astype(keys.dtype), keys, values, k_new, v_new, lengths, chunk_mask,
                              interpret=interpret)
    else:
        attn = _xla_attention(c, q, keys, values, mask)
    x = x + _add(total(_project("bthk,hkd->btd", attn, w.wo, pad_one_row)), w.bo)

    h = rms_norm(x, w.mlp_norm, c.rms_norm_eps)
    gate, up = _gate_up(h, w.w_gate_up, w.b_gate_up, pad_one_row)
    act = jax.nn.silu(gate) * up
    x = x + _add(total(_project("btf,fd->btd", act, w.w_down, pad_one_row)), w.b_down)
    return x, cache_k, cache_v


def forward(
    weights: Weights,
    config: ModelConfig,
    tokens: jnp.ndarray,  # [b, t] int32
    cache: KVCache,
    positions: jnp.ndarray | None = None,  # [b, t]; default lengths + arange(t)
    chunk_mask: jnp.ndarray | None = None,  # [t, t] bool; default causal
    attention: str = "xla",  # "xla", or "pallas": the fused kernel for chunks of <= 64 tokens
    logits_at: jnp.ndarray | None = None,  # [b] or [b, m] int32: the positions whose logits are wanted
) -> tuple[jnp.ndarray, KVCache]:
    """Runs t new tokens per row; returns (logits [b, t, v] float32 (or [b, m, v] at `logits_at`),
    cache with their K/V written).

    The cache's lengths are not advanced: the caller commits what it keeps. The layers run
    unrolled over separate arrays, or as a lax.scan over stacked ones: see Weights. Weights split
    over a mesh (weights.mesh) run per shard under shard_map; the cache is split by kv heads.
    """
    b, t = tokens.shape
    if positions is None:
        positions = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    if chunk_mask is None:
        chunk_mask = jnp.tril(jnp.ones((t, t), bool))
    inputs = (tokens, positions, chunk_mask, logits_at)
    if weights.mesh is None:
        return _forward(config, attention, None, weights, cache, *inputs)
    tp = weights.mesh.size
    run = jax.shard_map(
        functools.partial(_forward, local_config(config, tp), attention, TP),
        mesh=weights.mesh,
        in_specs=(weight_specs(weights, config), cache_specs(cache)) + (PartitionSpec(),) * 4,
        out_specs=(PartitionSpec(), cache_specs(cache)),
        check_vma=False,  # the Pallas kernel's outputs carry no replication annotations
    )
    return run(weights, cache, *inputs)


def cache_specs(cache: KVCache) -> KVCache:
    """The cache split by kv heads (jaxspec.sharding.CACHE_AXES), lengths whole."""
    if isinstance(cache.k, tuple):
        per_layer = tuple(spec(CACHE_AXES) for _ in cache.k)
        return KVCache(k=per_layer, v=per_layer, lengths=PartitionSpec())
    return KVCache(k=spec(CACHE_AXES, stacked=True), v=spec(CACHE_AXES, stacked=True), lengths=PartitionSpec())


def _embed(table, tokens, axis, vocab_size: int):
    """Rows of the embedding. Split by vocabulary over `axis`, each shard gives the rows it holds
    and zeros elsewhere, and the sum over shards puts every row together."""
    if axis is None or table.shape[0] == vocab_size:  # whole on each device
        return table[tokens]
    rows = table.shape[0]
    local = tokens - lax.axis_index(axis) * rows
    held = (local >= 0) & (local < rows)
    return lax.psum(jnp.where(held[..., None], table[jnp.clip(local, 0, rows - 1)], 0), axis)


def _forward(config, attention, axis, weights, cache, tokens, positions, chunk_mask, logits_at):
    """forward on whole weights (axis None), or on one shard of them (config: the shard's)."""
    t = tokens.shape[1]
    pallas = use_pallas(attention, config, t, cache.capacity)
    mask = None if pallas else attention_mask(
        cache.lengths, positions, cache.capacity, chunk_mask, config.sliding_window
    )
    inv_freq = inverse_frequencies(config.rope, config.head_dim)

    x = _embed(weights.embed, tokens, axis, config.vocab_size)
    unrolled = isinstance(weights.layers, tuple)  # the accelerators' layout (see Weights)
    layer = functools.partial(_layer, config, inv_freq, mask, positions, chunk_mask, pallas, unrolled, axis,
                              cache.lengths)
    if unrolled:  # unrolled over separate arrays
        new_k, new_v = [], []
        for i, (w, cache_k, cache_v) in enumerate(zip(weights.layers, cache.k, cache.v)):
            with jax.named_scope(f"layer{i}"):
                x, cache_k, cache_v = layer(w, x, cache_k, cache_v)
            new_k.append(cache_k)
            new_v.append(cache_v)
        new_k, new_v = tuple(new_k), tuple(new_v)
    else:  # stacked, scanned (scan_layers)
        def body(carry, xs):
            x, cache_k, cache_v = carry
            w, i = xs
            return layer(w, x, cache_k, cache_v, i), None

        (x, new_k, new_v), _ = jax.lax.scan(
            body, (x, cache.k, cache.v), (weights.layers, jnp.arange(config.num_layers)))

    if logits_at is not None:  # e.g. a prefill's last prompt token: skip the head for the rest
        at = logits_at[:, None] if logits_at.ndim == 1 else logits_at
        x = jnp.take_along_axis(x, at[:, :, None], axis=1)
    x = rms_norm(x, weights.final_norm, config.rms_norm_eps)
    if weights.lm_head is None:
        logits = _project("btd,vd->btv", x, weights.embed, unrolled, preferred_element_type=jnp.float32)
    else:
        logits = _project("btd,dv->btv", x, weights.lm_head, unrolled, preferred_element_type=jnp.float32)
    if axis is not None and logits.shape[-1] != config.vocab_size:  # split by vocabulary
        logits = lax.all_gather(logits, axis, axis=2, tiled=True)
    return logits, cache.replace(k=new_k, v=new_v)
