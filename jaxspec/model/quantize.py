"""8-bit weights: the projections (q/k/v, o, gate/up, down and an untied lm_head) stored as int8 or
fp8 e4m3fn with one float32 scale per output channel; embeddings and norms stay in the model's
dtype. A decode step reads every weight once, so 8 bits per weight halve what it reads; the
matmul kernel (pallas_kernels/matmul.py) converts them in registers.

fp8 is e4m3fn on every backend, kept as its uint8 bits: the kernel decodes them with integer
operations, so it needs neither fp8 hardware nor Triton's fp8 casts (ROCm's MI300 computes in
e4m3fnuz, which the weights never need to be).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxspec.errors import InputError

SCHEMES = ("int8", "fp8")
LIMITS = {"int8": 127.0, "fp8": 448.0}  # the largest magnitude each stores
# Projections and how many leading axes of each the matmul sums over (their inputs' trailing axes).
CONTRACTED = {"wqkv": 1, "wo": 2, "w_gate_up": 1, "w_down": 1, "lm_head": 1}
# The same projections in a converted checkpoint's layout (model.weights.param_specs), whose scales
# are stored beside them under the field's name + SCALE; per-channel scales survive the fusing of
# q/k/v and gate/up (it only concatenates output channels).
CHECKPOINT_CONTRACTED = {"layers.wq": 1, "layers.wk": 1, "layers.wv": 1, "layers.wo": 2, "layers.w_gate": 1,
                         "layers.w_up": 1, "layers.w_down": 1, "lm_head": 1}
SCALE = ".scale"
STORED_DTYPES = {"int8": np.dtype(np.int8), "fp8": np.dtype(np.uint8)}  # fp8: e4m3fn bits


@struct.dataclass
class Quantized:
    """One projection in 8 bits. values: the weight's shape, int8 or fp8 e4m3fn bits (uint8);
    scale [the weight's axes past the `contract` leading ones] float32: weight = values * scale."""

    values: jnp.ndarray
    scale: jnp.ndarray
    fmt: str = struct.field(pytree_node=False)  # "int8" or "fp8"
    contract: int = struct.field(pytree_node=False)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape


def check_scheme(scheme: str | None, field: str = "quantize") -> str | None:
    if scheme is not None and scheme not in SCHEMES:
        raise InputError(f"{field} must be one of {', '.join(SCHEMES)} (or None: the model's dtype); got {scheme!r}")
    return scheme


@functools.partial(jax.jit, static_argnames=("contract", "fmt", "stacked"))
def quantize(w: jnp.ndarray, contract: int, fmt: str, stacked: bool = False) -> Quantized:
    """w in `fmt` with symmetric per-output-channel scales (the largest magnitude over the
    `contract` leading axes maps to the format's largest value), on w's devices. stacked: w has a
    leading layer axis first, which keeps its own scales."""
    lead = 1 if stacked else 0
    w32 = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(w32), axis=tuple(range(lead, lead + contract)), keepdims=True)
    scale = jnp.where(amax > 0, amax / LIMITS[fmt], 1.0)
    if fmt == "int8":
        values = jnp.clip(jnp.round(w32 / scale), -127, 127).astype(jnp.int8)
    else:
        values = jax.lax.bitcast_convert_type((w32 / scale).astype(jnp.float8_e4m3fn), jnp.uint8)
    return Quantized(values, jnp.squeeze(scale, tuple(range(lead, lead + contract))), fmt, contract)


def stored_values(q: Quantized) -> jnp.ndarray:
    """The 8-bit values as numbers (int8, or float8_e4m3fn from their bits)."""
    return jax.lax.bitcast_convert_type(q.values, jnp.float8_e4m3fn) if q.fmt == "fp8" else q.values


def dequantize(q: Quantized, dtype=jnp.float32, stacked: bool = False) -> jnp.ndarray:
    """The weight q stands for, in `dtype` (the scales broadcast over the contracted axes)."""
    values = stored_values(q)
    lead = 1 if stacked else 0
    scale = jnp.expand_dims(q.scale, tuple(range(lead, lead + q.contract)))
    return (values.astype(jnp.float32) * scale).astype(dtype)


@functools.partial(jax.jit, static_argnames=("fmt", "stacked"))
def quantize_layer(layer, fmt: str, stacked: bool):
    """A LayerWeights (one layer's, or stacked over layers) with its projections (CONTRACTED) in
    `fmt`, the CPU layout's separate (gate, up) pair each: one compiled graph for every layer."""
    def one(name, w):
        if name not in CONTRACTED or w is None:
            return w
        if isinstance(w, tuple):
            return tuple(quantize(part, CONTRACTED[name], fmt, stacked) for part in w)
        return quantize(w, CONTRACTED[name], fmt, stacked)
    return layer.replace(**{f.name: one(f.name, getattr(layer, f.name)) for f in dataclasses.fields(layer)})


def quantize_checkpoint(fields: dict, fmt: str) -> dict:
    """Checkpoint-layout host fields (layers stacked) with the projections in `fmt`: the 8-bit
    values under each field's name, float32 scales under name + SCALE; a layer at a time."""
    out = dict(fields)
    for name, contract in CHECKPOINT_CONTRACTED.items():
        if name not in fields:
            continue
        w = fields[name]
        if name.startswith("layers."):  # a layer at a time: never a float32 copy of a whole field
            parts = [quantize(w[i], contract, fmt) for i in range(len(w))]
            out[name] = np.stack([np.asarray(q.values) for q in parts])
            out[name + SCALE] = np.stack([np.asarray(q.scale) for q in parts])
        else:
            q = quantize(w, contract, fmt)
            out[name], out[name + SCALE] = np.asarray(q.values), np.asarray(q.scale)
    return out


def as_quantized(values, scale, fmt: str, contract: int, scale_has_contracted_axes: bool = False):
    """Quantized from fused values and scales (a pair of each for the CPU's separate gate/up);
    scale_has_contracted_axes: the scales still carry the contracted axes as size-1 ones."""
    if isinstance(values, tuple):
        return tuple(as_quantized(v, s, fmt, contract, scale_has_contracted_axes) for v, s in zip(values, scale))
    if scale_has_contracted_axes:
        scale = jnp.squeeze(scale, tuple(range(contract)))
    return Quantized(values, scale, fmt, contract)
