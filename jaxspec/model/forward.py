"""Llama-family decoder as pure JAX functions over a weights pytree: layers unrolled over separate
arrays on accelerators, scanned over stacked ones on the CPU (see model.weights.Weights).

Einsum legend: b batch, t query, s key slot, d model, h query heads, n kv heads, g queries per kv
head, k head dim, f ffn, v vocab.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from jaxspec.errors import InputError
from jaxspec.model.cache import KVCache, cache_specs
from jaxspec.model.config import ModelConfig
from jaxspec.model.quantize import Quantized, stored_values, to_weight_layout
from jaxspec.model.rope import apply_rope, inverse_frequencies, rope_tables
from jaxspec.model.sharding import TP, local_config
from jaxspec.model.weights import LayerWeights, Weights, weight_specs
from pallas_kernels import rms_norm as rms_norm_kernel
from pallas_kernels.causal_attention import causal_attention
from pallas_kernels.experts import experts_mlp
from pallas_kernels.router import router_topk
from pallas_kernels.matmul import matmul
from pallas_kernels.matvec import matvec
from pallas_kernels.tree_attention import BLOCK_K, tree_attention


def _interpret() -> bool:
    return jax.default_backend() == "cpu"  # the CPU runs Pallas kernels only in interpret mode


@dataclasses.dataclass(frozen=True)
class DeterministicParts:
    """Deterministic mode with some of its parts run as the default mode runs them, to measure what
    each part costs (scripts/gpu_probes/deterministic_cost.py). Pass it as forward's `attention`:
    "deterministic" is DeterministicParts(), every part on. A part turned off is no longer
    deterministic, except split_k (tiles without k splits are fixed by (k, n) too)."""
    norms: bool = True  # RMS norms through the norm kernel (off: XLA)
    projections: bool = True  # the layers' projections through the matmul kernel (off: XLA)
    head: bool = True  # the LM head through the matmul kernel (off: XLA)
    split_k: bool = True  # the matmul kernel splits k as pallas_kernels.matmul.tiling picks (off: no k splits)


DETERMINISTIC = DeterministicParts()


def deterministic_parts(mode) -> DeterministicParts | None:
    """The deterministic parts of forward's `attention` or of a `deterministic` flag (True, or a
    DeterministicParts); None in the default mode."""
    if isinstance(mode, DeterministicParts):
        return mode
    if isinstance(mode, str):
        return DETERMINISTIC if mode == "deterministic" else None
    return DETERMINISTIC if mode else None


def rms_norm(x: jnp.ndarray, weight: jnp.ndarray, eps: float,
             deterministic: bool | DeterministicParts | None = False) -> jnp.ndarray:
    # As HF: normalise in float32, cast back to the activation dtype, then scale.
    parts = deterministic_parts(deterministic)
    if parts and parts.norms:  # the kernel's sum of squares has one order for any number of rows
        if weight.ndim > 1:  # a weight per row (q/k norms): the kernel's rows times one (exact), then theirs
            ones = jnp.ones(x.shape[-1], x.dtype)
            return weight.astype(x.dtype) * rms_norm_kernel.rms_norm(x, ones, eps, interpret=_interpret())
        return rms_norm_kernel.rms_norm(x, weight.astype(x.dtype), eps, interpret=_interpret())
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


# "deterministic": every row's result depends on that row alone (issue 25; docs/deterministic.md):
# projections, norms and attention run kernels whose sums have one order for any number of rows,
# any batch neighbours and any chunk a token comes in. Chains only (a tree's nodes are not at
# their final positions). forward also takes a DeterministicParts there.
ATTENTION_IMPLS = ("xla", "pallas", "deterministic")
PALLAS_MAX_CHUNK = 64  # the fused kernel serves decode/verify chunks; prefill stays on XLA


def _einsum(spec: str, a, b, **kwargs):
    """jnp.einsum with IEEE float32 products for float32 operands on every backend: JAX's default
    on NVIDIA GPUs is TF32, which put float32 logits 1.7e-3 off HF's on an H200 (torch keeps TF32
    off for matmuls by default). Other dtypes keep the backend's default."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jnp.einsum(spec, a, b, precision=precision, **kwargs)


# 8-bit weights on accelerators, by rows: (most rows, kernel) in order, the first that holds.
# H200, the 8B projections (docs/quantization.md): one row of fp8 the multiply-and-reduce kernel
# (matvec); from two rows XLA's own GEMM with the conversion fused in beat the matmul kernel for
# fp8 at every row count measured (2-32: a K=3 verify pass 3.74 -> 2.78 ms) and for int8 at 2-8
# (the kernel at 16-64); one row of int8 matvec since its conversion went to PTX (2.71 ms a step
# against 2.96 on the matmul kernel: the same projection times, plus matvec's fused norms);
# prefills XLA. Deterministic mode runs the matmul kernel at every row count.
QUANTIZED_KERNELS = ("matvec", "matmul", "xla")
DEFAULT_ROW_RULES = {
    "int8": ((1, "matvec"), (8, "xla"), (64, "matmul"), (None, "xla")),
    "fp8": ((1, "matvec"), (None, "xla")),
}
# Another rule, to measure it end to end (scripts/gpu_probes/bench_rows_rule.py): rules separated
# by ";" in this variable, read when jaxspec is imported.
ROWS_RULE_ENV = "JAXSPEC_ROWS_RULE"


def parse_rows_rule(text: str) -> tuple[str, tuple]:
    """"fp8=1:matvec,16:matmul,xla" -> ("fp8", ((1, "matvec"), (16, "matmul"), (None, "xla"))): up
    to MOST rows that KERNEL, the first step that holds; the last, without MOST, takes the rest."""
    fmt, sep, body = text.partition("=")
    if not sep or fmt not in DEFAULT_ROW_RULES:
        raise InputError(f"a rows rule must start with one of {', '.join(DEFAULT_ROW_RULES)} and '='; got {text!r}")
    steps = []
    for item in body.split(","):
        most, _, kernel = item.rpartition(":")
        if kernel not in QUANTIZED_KERNELS or (most and not most.isdigit()):
            raise InputError(f"a rows rule step must be MOST:KERNEL or KERNEL with KERNEL in "
                             f"{', '.join(QUANTIZED_KERNELS)}; got {item!r}")
        steps.append((int(most) if most else None, kernel))
    if steps[-1][0] is not None:
        raise InputError(f"a rows rule must end with a kernel for the remaining rows (no MOST); got {text!r}")
    return fmt, tuple(steps)


def row_rules(env: str) -> dict:
    """The engine's rules with those in `env` (ROWS_RULE_ENV's value) over them."""
    return {**DEFAULT_ROW_RULES, **dict(parse_rows_rule(t) for t in env.split(";") if t.strip())}


ROW_RULES = row_rules(os.environ.get(ROWS_RULE_ENV, ""))
# The 8-bit kernels that take the gated MLP's product and the residual adds into their epilogue,
# and those that take the RMS norm before a projection into their loop (pallas_kernels/fused.py):
# XLA fuses them into its own GEMMs, a Pallas call takes none. Never in deterministic mode.
# H200, 8B, B=1 (docs/quantization.md): fp8 2.97 -> 2.93 ms; int8 as before (its split-k sums
# had taken the residual adds already); the norm in the matmul kernel made int8 1.6x slower, and
# int8's normed projections through matvec (to fuse it there) 3.05 ms against 2.91.
FUSED_KERNELS = ("matvec", "matmul")
NORM_FUSED_IN = ("matvec",)


class Norm(NamedTuple):
    """An RMS norm to apply to a projection's input first (fused where a kernel can)."""
    weight: jnp.ndarray
    eps: float


def _quantized_kernel(rows: int, fmt: str, deterministic: bool | DeterministicParts | None) -> str:
    """Which of QUANTIZED_KERNELS computes `rows` rows of 8-bit weights (ROW_RULES)."""
    parts = deterministic_parts(deterministic)
    if parts:
        return "matmul" if parts.projections else "xla"
    if jax.default_backend() == "cpu":
        return "xla"
    return next(kernel for most, kernel in ROW_RULES[fmt] if most is None or rows <= most)


def _quantized(x, q: Quantized, out_dtype=None, deterministic: bool | DeterministicParts | None = False,
               norm: Norm | None = None, gated: bool = False, residual=None):
    """x [..., q's contracted axes] @ q -> [..., q's output axes] in out_dtype (default x's): float32
    sums of x times the 8-bit values (exact in x's dtype), then the scales. On accelerators the
    8-bit kernels or XLA on the converted values by rows (ROW_RULES; prefills are compute-bound:
    XLA), XLA on the CPU; deterministic: the matmul kernel for every row count, whose sums have
    one order (on the CPU in interpret mode).

    norm: x is RMS-normed first; gated: q is the fused gate/up ([d, 2, f]) and the result
    silu(gate) * up [..., f]; residual: added to the result. The kernels fuse them (NORM_FUSED_IN
    for the norm; pallas_kernels/fused.py) outside deterministic mode; XLA applies them around
    the product otherwise, as the unfused layer does."""
    out_axes = q.scale.shape
    n = math.prod(out_axes)
    k = q.values.size // n
    out_dtype = out_dtype or x.dtype
    lead = x.shape[: x.ndim - q.contract]
    kernel = _quantized_kernel(math.prod(lead), q.fmt, deterministic)
    fused = kernel in FUSED_KERNELS and not deterministic
    if norm is not None and not (fused and kernel in NORM_FUSED_IN):
        x, norm = rms_norm(x, norm.weight, norm.eps, deterministic), None
    x2 = x.reshape(-1, k)
    w = q.values.reshape(n, k)  # channels first (Quantized)
    kw = dict(fmt=q.fmt, out_dtype=out_dtype, interpret=_interpret())
    parts = deterministic_parts(deterministic)
    if parts and not parts.split_k:
        kw |= dict(split_k=1)
    if fused:
        kw |= dict(residual=None if residual is None else residual.reshape(x2.shape[0], -1), gated=gated)
        kw |= {} if norm is None else dict(norm=norm.weight.astype(x.dtype), eps=norm.eps)
    if kernel == "matvec":
        out = matvec(x2, w, q.scale.reshape(n), **kw)
    elif kernel == "matmul":
        out = matmul(x2, w, q.scale.reshape(n), w_nk=True, **kw)
    else:
        w = stored_values(q.replace(values=w)).astype(x.dtype)
        out = (_einsum("mk,nk->mn", x2, w, preferred_element_type=jnp.float32) * q.scale.reshape(n)).astype(out_dtype)
    if fused:
        return out.reshape(*lead, *(out_axes[1:] if gated else out_axes))
    return _epilogue(out.reshape(*lead, *out_axes), gated, residual)


def _epilogue(out, gated: bool, residual):
    """The gated MLP's product (out [..., 2, f]: gate, up) and the residual add, unfused."""
    if gated:
        out = jax.nn.silu(out[..., 0, :]) * out[..., 1, :]
    return out if residual is None else residual + out


def _kernel_project(spec: str, x, w, out_dtype=None, split_k: bool = True):
    """The einsum `spec` of a projection ("bt<contracted>,<w's axes>-><out>") through the matmul
    kernel, whose sums have one order for any number of rows: w's contracted axes lead it
    ([k, n]) or trail it ([n, k]: a tied embedding). split_k False: one program sums all of k."""
    xs, ws = spec.split("->")[0].split(",")
    contracted = xs[2:]
    nc = len(contracted)
    w_nk = not ws.startswith(contracted)
    k = math.prod(x.shape[2:])
    out_axes = w.shape[: w.ndim - nc] if w_nk else w.shape[nc:]
    out = matmul(x.reshape(-1, k), w.reshape(-1, k) if w_nk else w.reshape(k, -1), out_dtype=out_dtype, w_nk=w_nk,
                 interpret=_interpret(), **({} if split_k else dict(split_k=1)))
    return out.reshape(*x.shape[:2], *out_axes)


# XLA's GPU simplifier rewrites a dot with a vector operand into multiply + reduce kernels when the
# sizes of its unbatched operand matrices sum to under this many elements (its
# IsMatrixMultiplicationTooSmallForRewriting threshold, 10M in the JAX 0.10-0.12 releases): only
# those one-row products need _project's zero row. Larger ones (every projection of the 8B, Qwen3-
# 30B-A3B's q/k/v) stay GEMMs without it, and the pad, its barrier and the slice are saved: on an
# H100 (2026-12-07, bench plain at batch 1, alternating) the 8B's step took 5.576 ms against 5.606
# padding all (three pairs), the 1B's 1.243 against 1.261 (two). JAXSPEC_PAD_ONE_ROW=all pads every
# one-row product, as before, to compare.
XLA_DOT_REWRITE_BELOW = 10_000_000
PAD_ONE_ROW_ENV = "JAXSPEC_PAD_ONE_ROW"


def _pad_one_row_rule(value: str) -> str:
    if value not in ("", "small", "all"):
        raise InputError(f"{PAD_ONE_ROW_ENV} must be small or all (or unset); got {value!r}")
    return value or "small"


PAD_ONE_ROW = _pad_one_row_rule(os.environ.get(PAD_ONE_ROW_ENV, ""))


def _gets_zero_row(x, w) -> bool:
    """Whether the one-row product x [1, 1, k...] @ w is padded: every one under PAD_ONE_ROW
    "all", else those XLA would turn into multiply + reduce."""
    return PAD_ONE_ROW == "all" or math.prod(x.shape[2:]) + w.size < XLA_DOT_REWRITE_BELOW


def _project(spec: str, x, w, pad_one_row: bool, deterministic: bool | DeterministicParts | None = False,
             norm: Norm | None = None, gated: bool = False, residual=None, **kwargs):
    """A weight matmul of activations x [b, t, ...] (8-bit weights: _quantized, whose contracted
    axes lead w's as in every projection's spec), with _quantized's norm, gated and residual
    (fused only there). pad_one_row (the accelerators' layout): XLA's GPU simplifier rewrites a
    vector-matrix product with a matrix under 10M elements into multiply + reduce kernels, which
    ran the 1B draft's q/k/v and o projections far below the memory bandwidth (a one-token pass
    took 1.24 ms against 1.01 ms for two, H200). A zero row keeps a one-row product on the GEMM
    path; the barrier stops the simplifier from seeing through it. Only products small enough
    for that rewrite are padded (XLA_DOT_REWRITE_BELOW). deterministic: True or a
    DeterministicParts (its projections off: the default mode's XLA path)."""
    if isinstance(w, Quantized):
        return _quantized(x, w, kwargs.get("preferred_element_type"), deterministic, norm, gated, residual)
    if norm is not None:
        x = rms_norm(x, norm.weight, norm.eps, deterministic)
    parts = deterministic_parts(deterministic)
    if parts and parts.projections:
        out = _kernel_project(spec, x, w, kwargs.get("preferred_element_type"), parts.split_k)
    elif not (pad_one_row and x.shape[0] * x.shape[1] == 1 and _gets_zero_row(x, w)):
        out = _einsum(spec, x, w, **kwargs)
    else:
        padded = lax.optimization_barrier(jnp.pad(x, [(0, 0), (0, 1)] + [(0, 0)] * (x.ndim - 2)))
        out = _einsum(spec, padded, w, **kwargs)[:, :1]
    return _epilogue(out, gated, residual)


def use_pallas(attention: str, config: ModelConfig, chunk: int, capacity: int) -> bool:
    """Whether this forward runs the fused Pallas tree-attention kernel."""
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


def _gate_up(h, w, bias, pad_one_row: bool, deterministic: bool | DeterministicParts | None):
    """(gate, up) [b, t, f] from fused or separate weights (see fuse_mlp)."""
    if isinstance(w, tuple):
        return tuple(_add(_project("btd,df->btf", h, wi, pad_one_row, deterministic), bi)
                     for wi, bi in zip(w, bias or (None, None)))
    gate_up = _add(_project("btd,dcf->btcf", h, w, pad_one_row, deterministic), bias)
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


def _total(axis, deterministic: bool | DeterministicParts | None):
    """The sum of a split product over the mesh axis (identity without one). Deterministic: the
    shards' parts gathered and added in shard order, whatever algorithm the all-reduce picks
    for this size."""
    if axis is None:
        return lambda y: y
    if not deterministic:
        return lambda y: lax.psum(y, axis)

    def ordered(y):
        parts = lax.all_gather(y, axis)
        out = parts[0]
        for i in range(1, parts.shape[0]):
            out = out + parts[i]
        return out
    return ordered


def self_attention(c: ModelConfig, inv_freq, mask, positions, chunk_mask, impl: str, pad_one_row: bool, axis,
               lengths, w: LayerWeights, h, cache_k, cache_v, layer=None, norm: Norm | None = None, residual=None):
    """Self-attention of normed inputs h [b, t, d_in] -> (its output projection [b, t, d], the
    caches with the new keys and values written). impl: "xla", "pallas" (the tree-attention
    kernel), "deterministic" (ATTENTION_IMPLS) or a DeterministicParts. norm: h is not normed yet
    (the projection norms it); residual: added to the output. See _layer for the other arguments."""
    det = deterministic_parts(impl)
    b, t, _ = h.shape
    g = c.queries_per_kv
    qkv = _add(_project("btd,dnjk->btnjk", h, w.wqkv, pad_one_row, det, norm), w.bqkv)  # j: g queries, key, value
    v = qkv[:, :, :, g + 1]
    cos, sin = rope_tables(positions, inv_freq, qkv.dtype)
    qk = qkv[:, :, :, : g + 1]  # each kv head's g queries and its key
    if c.qk_norm:  # each head normed by its own weight (Qwen3), queries and keys in one norm
        # (the per-row weights as a select, which XLA fuses into the norm: a concatenated table was
        # a kernel of its own in every layer of every step, 1.7 us on an H100)
        per_row = jnp.where(jnp.arange(g + 1)[:, None] < g, w.q_norm[None], w.k_norm[None])
        qk = rms_norm(qk, per_row, c.rms_norm_eps, det)
    # queries and keys in one rotation (one kernel on GPUs, not two)
    qk = apply_rope(qk.reshape(b, t, -1, c.head_dim), cos, sin).reshape(b, t, c.num_kv_heads, g + 1, c.head_dim)
    q, k = qk[:, :, :, :g].reshape(b, t, c.num_heads, c.head_dim), qk[:, :, :, g]
    # The rotated queries and keys beside the values: one kernel makes all the Pallas kernel reads
    # (the projection's output is read once, not by a rotation and the kernel).
    fused = jnp.concatenate([qk, qkv[:, :, :, g + 1:]], axis=3)

    if impl == "pallas":
        # The kernel reads q, k and v where the projection left them and writes the chunk's keys
        # and values into the cache itself: no slice or scatter kernels around it. Prefix =
        # slots < lengths; the chunk's own keys come in beside it under chunk_mask.
        layer_k, layer_v = (cache_k, cache_v) if layer is None else (cache_k[layer], cache_v[layer])
        attn, layer_k, layer_v = tree_attention(
            fused, layer_k, layer_v, fused, fused, lengths, chunk_mask, groups=g, k_index=g, v_index=g + 1,
            write_cache=True, interpret=_interpret())
        if layer is None:
            cache_k, cache_v = layer_k, layer_v
        else:
            cache_k, cache_v = cache_k.at[layer].set(layer_k), cache_v.at[layer].set(layer_v)
    else:  # write the new keys/values beside the committed prefix, then attend over the whole cache
        slots = lengths[:, None] + jnp.arange(t)[None, :]
        rows = jnp.arange(b)[:, None]
        cache_k, keys = _write(cache_k, layer, rows, slots, k)
        cache_v, values = _write(cache_v, layer, rows, slots, v)
        if det:  # the chunk's keys are in the cache already: each token sees slots up to its own
            attn = causal_attention(q.astype(keys.dtype), keys, values, lengths, sliding_window=c.sliding_window,
                                    interpret=_interpret())
        else:
            attn = _xla_attention(c, q, keys, values, mask)
    return _summed_projection("bthk,hkd->btd", attn, w.wo, w.bo, pad_one_row, axis, det, residual), cache_k, cache_v


def gated_mlp(w: LayerWeights, h, pad_one_row: bool, axis, deterministic: bool | DeterministicParts | None = False,
              norm: Norm | None = None, residual=None):
    """The gated MLP of normed inputs h [b, t, d] -> [b, t, d] (summed over axis). norm: h is not
    normed yet (the projection norms it); residual: added to the output."""
    if isinstance(w.w_gate_up, tuple) or w.b_gate_up is not None:  # separate (the CPU's) or biased: unfused
        if norm is not None:
            h = rms_norm(h, norm.weight, norm.eps, deterministic)
        gate, up = _gate_up(h, w.w_gate_up, w.b_gate_up, pad_one_row, deterministic)
        act = jax.nn.silu(gate) * up
    else:  # silu(gate) * up: the 8-bit kernels' epilogue
        act = _project("btd,dcf->btcf", h, w.w_gate_up, pad_one_row, deterministic, norm, gated=True)
    return _summed_projection("btf,fd->btd", act, w.w_down, w.b_down, pad_one_row, axis, deterministic, residual)


# Which path a mixture-of-experts layer's experts take (expert_path). The grouped expert kernel
# (pallas_kernels/experts.py) reads each chosen expert once, in place: on accelerators from 1 up to
# KERNEL_MAX_TOKENS tokens, and always in deterministic mode (its sums have one order per token).
# Measured on an H200 (JAX 0.11.2, bf16, 8 layers, docs/moe.md): Qwen3-30B-A3B one token 0.87 ms a
# step with the kernel against 1.47 gathered, and one layer's experts 61 us against 118 gathered
# and 315 by ragged_dot; Mixtral-8x7B one token 223 us against 641 gathered (its 2 chosen experts
# are 704 MB: gathering copies them). On an H100, verify passes of 2 / 4 / 6 Qwen3 tokens 2.48 /
# 2.59 / 2.97 ms against 2.36 / 3.38 / 4.34 by XLA's rule, decode at batch 8 2.79 against 4.28.
# Past that (prefills) and on the CPU (no Pallas outside interpret mode) XLA's paths: each
# (token, expert) pair's weights gathered while those copies are small, else jax.lax.ragged_dot,
# which costs about 0.3-0.55 ms a layer even for one token.
EXPERT_PATHS = ("kernel", "gather", "ragged_dot")
KERNEL_MAX_TOKENS = 64
GATHER_MAX_PAIRS = 48
GATHER_MAX_BYTES = 512 * 2**20
# One path for every call, or "xla" (XLA's two by the rule below, no kernel), to measure them end
# to end (scripts/gpu_probes/moe_costs.py): read when jaxspec is imported.
EXPERT_PATH_ENV = "JAXSPEC_EXPERT_PATH"


def _forced_expert_path(value: str) -> str | None:
    if value and value not in EXPERT_PATHS + ("xla",):
        raise InputError(f"{EXPERT_PATH_ENV} must be one of {', '.join(EXPERT_PATHS)}, xla (or unset); got {value!r}")
    return value or None


FORCED_EXPERT_PATH = _forced_expert_path(os.environ.get(EXPERT_PATH_ENV, ""))


def expert_path(tokens: int, pairs: int, expert_bytes: int, deterministic) -> str:
    """The path of one call's experts (see EXPERT_PATHS): tokens, the (token, expert) pairs they
    make, one expert's bytes."""
    if deterministic:
        return "kernel"
    if FORCED_EXPERT_PATH in EXPERT_PATHS:
        return FORCED_EXPERT_PATH
    if jax.default_backend() != "cpu" and tokens <= KERNEL_MAX_TOKENS and FORCED_EXPERT_PATH != "xla":
        return "kernel"
    if tokens == 1 or (pairs <= GATHER_MAX_PAIRS and pairs * expert_bytes <= GATHER_MAX_BYTES):
        return "gather"
    return "ragged_dot"


# The router (norm aside: product, softmax, top-k, renormalization) by XLA's kernels, or by two
# Pallas kernels (pallas_kernels/router.py). Measured through jaxspec bench on an H100 (Qwen3-30B-
# A3B, 8 layers, docs/moe.md): a step at batch 1 took 0.898 ms with the kernels against 0.921 by
# XLA's, at batch 8 2.158 against 2.079, at 64 4.85 against 4.54 (a session apart). So "auto" (the
# default) runs the kernels for one token on accelerators and XLA's elsewhere; JAXSPEC_ROUTER=kernel
# or xla forces one (read when jaxspec is imported). Deterministic mode keeps its own (the matmul kernel's product).
ROUTER_PATHS = ("auto", "xla", "kernel")
ROUTER_ENV = "JAXSPEC_ROUTER"
ROUTER_KERNEL_MAX_TOKENS = 1


def _router_path(value: str) -> str:
    if value and value not in ROUTER_PATHS:
        raise InputError(f"{ROUTER_ENV} must be one of {', '.join(ROUTER_PATHS)} (or unset); got {value!r}")
    return value or "auto"


ROUTER_PATH = _router_path(os.environ.get(ROUTER_ENV, ""))


def _router_kernel(tokens: int) -> bool:
    if ROUTER_PATH == "auto":
        return jax.default_backend() != "cpu" and tokens <= ROUTER_KERNEL_MAX_TOKENS
    return ROUTER_PATH == "kernel"


def route(c: ModelConfig, h, router, deterministic):
    """The router's choices for the normed tokens h [b, t, d]: (weights [b, t, k] float32,
    experts [b, t, k] int32), the softmax's top experts_per_token, renormalized when
    norm_topk_prob."""
    k = c.experts_per_token
    b, t, d = h.shape
    if _router_kernel(b * t) and not deterministic and router.dtype == h.dtype:
        weights, experts = router_topk(h.reshape(b * t, d), router, k=k, normalize=c.norm_topk_prob,
                                       interpret=_interpret())
        return weights.reshape(b, t, k), experts.reshape(b, t, k)
    return _route_xla(c, h, router, deterministic)


def _route_xla(c: ModelConfig, h, router, deterministic):
    # (top_k of the logits then a softmax of the k, the same weights with one kernel fewer, ran a
    # Qwen3-30B-A3B step at batch 64 in 8.93 ms against 4.85 by the router's kernels on an H100,
    # 2026-12-07; the softmax first was 4.54 a session before: so the softmax stays first)
    probs = jax.nn.softmax(_router_logits(h, router, deterministic), axis=-1)
    weights, experts = jax.lax.top_k(probs, c.experts_per_token)
    if c.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts


def _router_logits(h, router, deterministic):
    """[b, t, E] float32. Deterministic: through the matmul kernel (its sums one order per row),
    the experts padded to its 16-column tiles."""
    if not (deterministic and deterministic.projections):
        return jnp.einsum("btd,de->bte", h, router, preferred_element_type=jnp.float32)
    e = router.shape[1]
    padded = jnp.pad(router, ((0, 0), (0, -e % 16)))
    return _kernel_project("btd,de->bte", h, padded, jnp.float32, deterministic.split_k)[..., :e]


def _expert_kernel_args(gate_up, down) -> dict:
    """experts_mlp's weight arguments: float experts as they are; 8-bit ones (Quantized) as their
    channels-first values with their scales."""
    if not isinstance(gate_up, Quantized):
        return dict(gate_up=gate_up, down=down)
    return dict(gate_up=gate_up.values, down=down.values, fmt=gate_up.fmt, gate_up_scale=gate_up.scale,
                down_scale=down.scale)


def _gathered_product(spec: str, x, w, experts):
    """einsum(spec, x, each (token, expert) pair's weights w[experts]) -> float32. 8-bit experts:
    the gathered values converted to x's dtype (exact) in the weight's layout, each pair's scales
    applied to the float32 sums (they factor out of the sums over the contracted axis)."""
    if not isinstance(w, Quantized):
        return jnp.einsum(spec, x, w[experts], preferred_element_type=jnp.float32)
    values = stored_values(w.replace(values=w.values[experts])).astype(x.dtype)
    values = to_weight_layout(values, w.contract, experts.ndim)
    return jnp.einsum(spec, x, values, preferred_element_type=jnp.float32) * w.scale[experts]


def _grouped_product(x, w, sizes, rows_expert):
    """ragged_dot of x [P, k] (rows grouped by expert, sizes [E] of them) with every expert's
    [E, k, n] -> float32 [P, n]. 8-bit experts: all of them converted to x's dtype (exact) and
    back to the weight layout, then each row's sums times its expert's scales (rows_expert [P]).
    The conversion writes every expert in x's dtype once per call, twice the 8-bit bytes beside
    the weights' own read; this path runs prefills (many tokens, most experts chosen), where
    that cost is shared by the tokens."""
    if not isinstance(w, Quantized):  # (gate/up's [E, d, 2, f] as [E, d, 2f])
        return jax.lax.ragged_dot(x, w.reshape(w.shape[0], x.shape[1], -1), sizes, preferred_element_type=jnp.float32)
    e, k = w.values.shape[0], w.values.shape[-1]
    values = to_weight_layout(stored_values(w).astype(x.dtype), w.contract, w.lead).reshape(e, k, -1)
    out = jax.lax.ragged_dot(x, values, sizes, preferred_element_type=jnp.float32)
    return out * w.scale.reshape(e, -1)[rows_expert]


def moe_mlp(c: ModelConfig, w: LayerWeights, x, axis, deterministic, norm: Norm, residual):
    """A mixture-of-experts MLP (Qwen3-MoE's and Mixtral's): the softmax router's top
    experts_per_token experts per token (renormalized when norm_topk_prob), each a SwiGLU, their
    outputs weighted and summed per token, by the path expert_path picks: the grouped expert
    kernel; each pair's expert weights gathered and applied; or the pairs sorted by expert and
    run as grouped matmuls (jax.lax.ragged_dot). Under tensor parallelism the experts' ffn
    columns are split, or under expert parallelism the experts themselves (w holds E/N of them,
    this device's share along `axis`): every device routes every token (router and inputs are
    whole), runs the pairs whose expert it holds, and the down products are summed over `axis`
    either way. 8-bit experts (Quantized: each expert's own per-channel scales) take every path:
    their values become the activations' dtype exactly and the scales multiply the float32 sums,
    as in the dense projections.
    x [b, t, d] -> (x + the MLP's output, the experts each token chose [b, t, k])."""
    b, t, d = x.shape
    k, e = c.experts_per_token, c.num_experts
    h = rms_norm(x, norm.weight, norm.eps, deterministic)
    weights, experts = route(c, h, w.router, deterministic)  # [b, t, k]
    leaves = jax.tree.leaves((w.experts_gate_up, w.experts_down))  # (8-bit: values and scales)
    held = leaves[0].shape[0]  # experts on this device: all, or E/N under expert parallelism
    first = 0 if held == e else lax.axis_index(axis) * held
    local = experts - first
    mine = (local >= 0) & (local < held)  # the pairs this device runs (all of them but under expert parallelism)
    local = jnp.where(mine, local, 0)  # another device's pairs point at expert 0 here, their outputs dropped
    pairs = b * t * k
    expert_bytes = sum(a.nbytes for a in leaves) // held
    path = expert_path(b * t, pairs, expert_bytes, deterministic)
    if path == "kernel":
        y = experts_mlp(h.reshape(b * t, d), experts.reshape(b * t, k), weights.reshape(b * t, k),
                        **_expert_kernel_args(w.experts_gate_up, w.experts_down),
                        first_expert=None if held == e else first,
                        interpret=_interpret())
        y = y.astype(x.dtype).reshape(b, t, d)
    elif path == "gather":
        gate_up = _gathered_product("btd,btkdcf->btkcf", h, w.experts_gate_up, local).astype(x.dtype)
        act = jax.nn.silu(gate_up[..., 0, :]) * gate_up[..., 1, :]
        out = _gathered_product("btkf,btkfd->btkd", act, w.experts_down, local)
        y = jnp.sum(jnp.where(mine[..., None], out * weights[..., None], 0), axis=2).astype(x.dtype)
    else:
        # The (token, expert) pairs by expert, another device's in a last bin past every group:
        # the group sizes count this device's pairs only, and the rows past them are dropped.
        bins = jnp.where(mine, local, held).reshape(-1)
        order = jnp.argsort(bins, stable=True)
        token = order // k
        rows_expert = jnp.minimum(bins[order], held - 1)  # (8-bit: each row's scales; the dropped ones any)
        sizes = jnp.bincount(bins, length=held + 1)[:held]
        xs = h.reshape(b * t, d)[token]
        gate_up = _grouped_product(xs, w.experts_gate_up, sizes, rows_expert).astype(x.dtype)
        f = gate_up.shape[1] // 2
        act = jax.nn.silu(gate_up[:, :f]) * gate_up[:, f:]
        out = _grouped_product(act, w.experts_down, sizes, rows_expert)
        out = jnp.where(mine.reshape(-1)[order][:, None], out * weights.reshape(-1)[order][:, None], 0)
        y = jnp.zeros((b * t, d), jnp.float32).at[token].add(out).astype(x.dtype).reshape(b, t, d)
    return residual + _total(axis, deterministic)(y), experts


def _summed_projection(spec: str, x, w, bias, pad_one_row: bool, axis, deterministic: bool | DeterministicParts | None,
                       residual):
    """A layer's output projection: summed over the mesh axis, plus bias, plus residual (None:
    none), which joins the projection itself where nothing comes between (no axis, no bias)."""
    fuse = axis is None and bias is None
    out = _project(spec, x, w, pad_one_row, deterministic, residual=residual if fuse else None)
    out = _add(_total(axis, deterministic)(out), bias)
    return out if fuse or residual is None else residual + out


def _layer(c: ModelConfig, inv_freq, mask, positions, chunk_mask, impl: str, pad_one_row: bool, axis, lengths,
           w: LayerWeights, x, cache_k, cache_v, layer=None):
    """One decoder layer: x [b, t, d] -> (x, cache_k, cache_v, the experts each token chose [b, t, k],
    None in a dense layer). The caches are this layer's
    [b, s, n, k] arrays, or the stacked [L, b, s, n, k] ones with the scan's `layer` index.
    pad_one_row: see _project. axis: the mesh axis when this runs on one shard of the heads and
    ffn columns (c is then the shard's config): the o and down products are summed over it.
    Each norm goes to the projection it feeds, each residual add to the one before it: the
    8-bit kernels fuse them (_quantized)."""
    det = deterministic_parts(impl)
    x, cache_k, cache_v = self_attention(c, inv_freq, mask, positions, chunk_mask, impl, pad_one_row, axis, lengths,
                                         w, x, cache_k, cache_v, layer, norm=Norm(w.attn_norm, c.rms_norm_eps),
                                         residual=x)
    if w.router is not None:
        x, experts = moe_mlp(c, w, x, axis, det, Norm(w.mlp_norm, c.rms_norm_eps), residual=x)
    else:
        x = gated_mlp(w, x, pad_one_row, axis, det, norm=Norm(w.mlp_norm, c.rms_norm_eps), residual=x)
        experts = None
    return x, cache_k, cache_v, experts


def forward(
    weights: Weights,
    config: ModelConfig,
    tokens: jnp.ndarray,  # [b, t] int32
    cache: KVCache,
    positions: jnp.ndarray | None = None,  # [b, t]; default lengths + arange(t)
    chunk_mask: jnp.ndarray | None = None,  # [t, t] bool; default causal
    attention: str | DeterministicParts = "xla",  # "xla", "pallas" (the fused kernel for chunks of
    # <= 64 tokens) or "deterministic" (ATTENTION_IMPLS; causal chunks only), or a DeterministicParts
    # (deterministic mode with some parts as the default mode runs them: measurements only)
    logits_at: jnp.ndarray | None = None,  # [b] or [b, m] int32: the positions whose logits are wanted
    features_at: tuple[int, ...] = (),  # layers whose input (the residual stream) is also returned;
    # num_layers: the last layer's output (before the final norm)
    routing: bool = False,  # also return the experts each token chose in each layer (mixtures of experts)
):
    """Runs t new tokens per row; returns (logits [b, t, v] float32 (or [b, m, v] at `logits_at`),
    cache with their K/V written), and with features_at a third item: the hidden states entering
    those layers, concatenated, [b, t, len(features_at) * d] (every token's: what an EAGLE-3
    head reads, jaxspec.model.eagle); with routing, a last item: the experts each token chose in
    each sparse layer [len(config.sparse_layers), b, t, k] ([L, b, t, 0] for a dense model).

    The cache's lengths are not advanced: the caller commits what it keeps. The layers run
    unrolled over separate arrays, or as a lax.scan over stacked ones: see Weights. Weights split
    over a mesh (weights.mesh) run per shard under shard_map; the cache is split by kv heads.
    """
    b, t = tokens.shape
    if deterministic_parts(attention) and (positions is not None or chunk_mask is not None):
        raise InputError("deterministic mode verifies chains only: a tree's nodes are not at their final positions "
                         "(pass no positions or chunk_mask)")
    if positions is None:
        positions = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    if chunk_mask is None:
        chunk_mask = jnp.tril(jnp.ones((t, t), bool))
    inputs = (tokens, positions, chunk_mask, logits_at)
    features_at = tuple(features_at)
    if weights.mesh is None:
        out = _forward(config, attention, None, features_at, weights, cache, *inputs)
    else:
        tp = weights.mesh.size
        run = jax.shard_map(
            functools.partial(_forward, local_config(config, tp), attention, TP, features_at),
            mesh=weights.mesh,
            in_specs=(weight_specs(weights, config), cache_specs(cache)) + (PartitionSpec(),) * 4,
            out_specs=(PartitionSpec(), cache_specs(cache), PartitionSpec(), PartitionSpec()),  # routing: the router is whole
            check_vma=False,  # the Pallas kernel's outputs carry no replication annotations
        )
        out = run(weights, cache, *inputs)
    return out[:2] + ((out[2],) if features_at else ()) + ((out[3],) if routing else ())

def _embed(table, tokens, axis, vocab_size: int):
    """Rows of the embedding. Split by vocabulary over `axis`, each shard gives the rows it holds
    and zeros elsewhere, and the sum over shards puts every row together."""
    if axis is None or table.shape[0] == vocab_size:  # whole on each device
        return table[tokens]
    rows = table.shape[0]
    local = tokens - lax.axis_index(axis) * rows
    held = (local >= 0) & (local < rows)
    return lax.psum(jnp.where(held[..., None], table[jnp.clip(local, 0, rows - 1)], 0), axis)


def _forward(config, attention, axis, features_at, weights, cache, tokens, positions, chunk_mask, logits_at):
    """forward on whole weights (axis None), or on one shard of them (config: the shard's):
    (logits, cache, features [b, t, len(features_at) * d], empty without features_at, the
    experts chosen [sparse layers, b, t, k])."""
    for i in features_at:
        if not 0 <= i <= config.num_layers:
            raise InputError(f"feature layers must be in [0, {config.num_layers}]; got {features_at}")
    t = tokens.shape[1]
    det = deterministic_parts(attention)
    impl = det if det else "pallas" if use_pallas(attention, config, t, cache.capacity) else "xla"
    mask = None if impl != "xla" else attention_mask(
        cache.lengths, positions, cache.capacity, chunk_mask, config.sliding_window
    )
    inv_freq = inverse_frequencies(config.rope, config.head_dim)

    x = _embed(weights.embed, tokens, axis, config.vocab_size)
    # the accelerators' layout (see Weights), or the CPU's for layers unalike (which then also pad
    # one-row products, _project's pad_one_row: a zero row more, the same numbers)
    unrolled = isinstance(weights.layers, tuple)
    layer = functools.partial(_layer, config, inv_freq, mask, positions, chunk_mask, impl, unrolled, axis,
                              cache.lengths)
    features = [None] * len(features_at)
    if unrolled:  # unrolled over separate arrays
        new_k, new_v, routed = [], [], []
        for i, (w, cache_k, cache_v) in enumerate(zip(weights.layers, cache.k, cache.v)):
            features = [x if at == i else f for f, at in zip(features, features_at)]
            with jax.named_scope(f"layer{i}"):
                x, cache_k, cache_v, experts = layer(w, x, cache_k, cache_v)
            new_k.append(cache_k)
            new_v.append(cache_v)
            routed += [] if experts is None else [experts]
        new_k, new_v = tuple(new_k), tuple(new_v)
        routed = jnp.stack(routed) if routed else jnp.zeros((config.num_layers,) + x.shape[:2] + (0,), jnp.int32)
        features = [x if at == config.num_layers else f for f, at in zip(features, features_at)]
    else:  # stacked, scanned (scan_layers)
        at = jnp.asarray(features_at, jnp.int32)

        def body(carry, xs):
            x, cache_k, cache_v, feats = carry
            w, i = xs
            feats = jnp.where((at == i)[:, None, None, None], x[None], feats)  # the layers' inputs, kept
            x, cache_k, cache_v, experts = layer(w, x, cache_k, cache_v, i)
            return (x, cache_k, cache_v, feats), jnp.zeros(x.shape[:2] + (0,), jnp.int32) if experts is None else experts

        feats = jnp.zeros((len(features_at),) + x.shape, x.dtype)
        (x, new_k, new_v, feats), routed = jax.lax.scan(
            body, (x, cache.k, cache.v, feats), (weights.layers, jnp.arange(config.num_layers)))
        feats = jnp.where((at == config.num_layers)[:, None, None, None], x[None], feats)
        features = list(feats)
    features = jnp.concatenate(features, axis=-1) if features_at else jnp.zeros(x.shape[:2] + (0,), x.dtype)

    if logits_at is not None:  # e.g. a prefill's last prompt token: skip the head for the rest
        at = logits_at[:, None] if logits_at.ndim == 1 else logits_at
        x = jnp.take_along_axis(x, at[:, :, None], axis=1)
    final_norm = Norm(weights.final_norm, config.rms_norm_eps)
    head = det and dataclasses.replace(det, projections=det.head)  # the LM head is a part of its own
    if weights.lm_head is None:
        logits = _project("btd,vd->btv", x, weights.embed, unrolled, head, final_norm,
                          preferred_element_type=jnp.float32)
    else:
        logits = _project("btd,dv->btv", x, weights.lm_head, unrolled, head, final_norm,
                          preferred_element_type=jnp.float32)
    if axis is not None and logits.shape[-1] != config.vocab_size:  # split by vocabulary
        logits = lax.all_gather(logits, axis, axis=2, tiled=True)
    return logits, cache.replace(k=new_k, v=new_v), features, routed
