"""8-bit weights: the projections (q/k/v, o, gate/up, down, a mixture-of-experts layer's experts
and an untied lm_head) stored as int8 or fp8 e4m3fn with one float32 scale per output channel
(each expert its own); embeddings, norms and routers stay in the model's dtype. A decode step
reads every weight once, so 8 bits per weight halve what it reads; the matmul kernel
(pallas_kernels/matmul.py) converts them in registers.

fp8 is e4m3fn on every backend, kept as its uint8 bits: the kernel decodes them with integer
operations, so it needs neither fp8 hardware nor Triton's fp8 casts (ROCm's MI300 computes in
e4m3fnuz, which the weights never need to be).
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxspec.errors import InputError

SCHEMES = ("int8", "fp8")
LIMITS = {"int8": 127.0, "fp8": 448.0}  # the largest magnitude each stores
# Projections and how many leading axes of each the matmul sums over (their inputs' trailing axes).
CONTRACTED = {"wqkv": 1, "wo": 2, "w_gate_up": 1, "w_down": 1, "lm_head": 1, "experts_gate_up": 1,
              "experts_down": 1}
# Projections with leading axes before the contracted ones (past a stacked layer axis): the expert
# axis of an MoE layer's [E, d, 2, f] and [E, f, d], each expert with its own scales.
LEAD = {"experts_gate_up": 1, "experts_down": 1}
# The same projections in a converted checkpoint's layout (model.weights.param_specs), whose scales
# are stored beside them under the field's name + SCALE; per-channel scales survive the fusing of
# q/k/v, gate/up and the experts (it only concatenates and stacks output channels). An expert's
# fields carry its number (layers.e_gate0, ...): checkpoint_contracted finds them.
CHECKPOINT_CONTRACTED = {"layers.wq": 1, "layers.wk": 1, "layers.wv": 1, "layers.wo": 2, "layers.w_gate": 1,
                         "layers.w_up": 1, "layers.w_down": 1, "lm_head": 1, "layers.e_gate": 1, "layers.e_up": 1,
                         "layers.e_down": 1}
SCALE = ".scale"
STORED_DTYPES = {"int8": np.dtype(np.int8), "fp8": np.dtype(np.uint8)}  # fp8: e4m3fn bits


def checkpoint_contracted(field: str) -> int | None:
    """How many leading axes of a checkpoint field (layers stacked) the matmul sums over; None for
    a field that is no projection (embeddings, norms, routers, biases)."""
    return CHECKPOINT_CONTRACTED.get(re.sub(r"^(layers\.e_(?:gate|up|down))\d+$", r"\1", field))


@struct.dataclass
class Quantized:
    """One projection in 8 bits: weight = values * scale, in the engine's layout.

    The weight is [contracted axes..., output axes...] (the first `contract` axes are summed over).
    values hold its transpose, [output axes..., contracted axes...], int8 or fp8 e4m3fn bits
    (uint8): each output channel's weights are contiguous, as in Hugging Face's files, which the
    matmul kernel reads a quarter faster at decode rows than the weight's own layout (H200,
    scripts/gpu_probes/matmul_sweep.py). scale: [output axes...] float32. Stacked layers lead both,
    then the `lead` axes (LEAD: an MoE layer's experts, [E, d, 2, f] -> values [E, 2, f, d],
    scale [E, 2, f]), which stay in front."""

    values: jnp.ndarray
    scale: jnp.ndarray
    fmt: str = struct.field(pytree_node=False)  # "int8" or "fp8"
    contract: int = struct.field(pytree_node=False)
    lead: int = struct.field(pytree_node=False, default=0)


def to_channels_first(w: jnp.ndarray, contract: int, lead: int = 0) -> jnp.ndarray:
    """[lead..., contracted..., output...] -> [lead..., output..., contracted...]."""
    axes = list(range(w.ndim))
    return jnp.transpose(w, axes[:lead] + axes[lead + contract :] + axes[lead : lead + contract])


def to_weight_layout(values: jnp.ndarray, contract: int, lead: int = 0) -> jnp.ndarray:
    """The inverse of to_channels_first."""
    axes = list(range(values.ndim))
    return jnp.transpose(values, axes[:lead] + axes[values.ndim - contract :] + axes[lead : values.ndim - contract])


def check_scheme(scheme: str | None, field: str = "quantize") -> str | None:
    if scheme is not None and scheme not in SCHEMES:
        raise InputError(f"{field} must be one of {', '.join(SCHEMES)} (or None: the model's dtype); got {scheme!r}")
    return scheme


@functools.partial(jax.jit, static_argnames=("contract", "fmt", "stacked", "lead"))
def quantize(w: jnp.ndarray, contract: int, fmt: str, stacked: bool = False, lead: int = 0) -> Quantized:
    """w in `fmt` with symmetric per-output-channel scales (the largest magnitude over the
    `contract` axes maps to the format's largest value), on w's devices. stacked: w has a leading
    layer axis first, which keeps its own scales; lead: as many axes more before the contracted
    ones, alike (Quantized.lead)."""
    values, scale = quantize_in_weight_layout(w, contract, fmt, stacked, lead)
    return Quantized(to_channels_first(values, contract, int(stacked) + lead), scale, fmt, contract, lead)


@functools.partial(jax.jit, static_argnames=("contract", "fmt", "stacked", "lead"))
def quantize_in_weight_layout(w: jnp.ndarray, contract: int, fmt: str, stacked: bool = False, lead: int = 0):
    """quantize's (values in w's own layout, scales): a converted checkpoint's layout."""
    lead += 1 if stacked else 0
    w32 = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(w32), axis=tuple(range(lead, lead + contract)), keepdims=True)
    scale = jnp.where(amax > 0, amax / LIMITS[fmt], 1.0)
    if fmt == "int8":
        values = jnp.clip(jnp.round(w32 / scale), -127, 127).astype(jnp.int8)
    else:
        values = jax.lax.bitcast_convert_type((w32 / scale).astype(jnp.float8_e4m3fn), jnp.uint8)
    return values, jnp.squeeze(scale, tuple(range(lead, lead + contract)))


def stored_values(q: Quantized) -> jnp.ndarray:
    """The 8-bit values as numbers (int8, or float8_e4m3fn from their bits)."""
    return jax.lax.bitcast_convert_type(q.values, jnp.float8_e4m3fn) if q.fmt == "fp8" else q.values


def dequantize(q: Quantized, dtype=jnp.float32, stacked: bool = False) -> jnp.ndarray:
    """The weight q stands for, in its own layout and `dtype`."""
    scale = jnp.expand_dims(q.scale, tuple(range(q.scale.ndim, q.values.ndim)))  # over the contracted axes
    return to_weight_layout((stored_values(q).astype(jnp.float32) * scale).astype(dtype), q.contract,
                            int(stacked) + q.lead)


@functools.partial(jax.jit, static_argnames=("fmt", "stacked"))
def quantize_layer(layer, fmt: str, stacked: bool):
    """A LayerWeights (one layer's, or stacked over layers) with its projections (CONTRACTED) in
    `fmt`, the CPU layout's separate (gate, up) pair each: one compiled graph for every layer."""
    def one(name, w):
        if name not in CONTRACTED or w is None:
            return w
        if isinstance(w, tuple):
            return tuple(quantize(part, CONTRACTED[name], fmt, stacked) for part in w)
        return quantize(w, CONTRACTED[name], fmt, stacked, LEAD.get(name, 0))
    return layer.replace(**{f.name: one(f.name, getattr(layer, f.name)) for f in dataclasses.fields(layer)})


def quantize_checkpoint(fields: dict, fmt: str) -> dict:
    """Checkpoint-layout host fields (layers stacked) with the projections in `fmt`: the 8-bit
    values under each field's name, float32 scales under name + SCALE; a layer at a time."""
    out = dict(fields)
    for name, w in fields.items():
        contract = checkpoint_contracted(name)
        if contract is None:
            continue
        if name.startswith("layers."):  # a layer at a time: never a float32 copy of a whole field
            parts = [quantize_in_weight_layout(w[i], contract, fmt) for i in range(len(w))]
            out[name] = np.stack([np.asarray(values) for values, _ in parts])
            out[name + SCALE] = np.stack([np.asarray(scale) for _, scale in parts])
        else:
            out[name], out[name + SCALE] = map(np.asarray, quantize_in_weight_layout(w, contract, fmt))
    return out


def block_grid(shape: tuple, block: tuple) -> tuple:
    """The shape of the scale grid of a `shape` weight scaled by `block` blocks: one scale per
    block, the last one on each axis partial where the block does not divide the axis."""
    return tuple(-(-size // b) for size, b in zip(shape, block))


def expand_block_scales(scale, shape: tuple, block: tuple):
    """One scale per element of a `shape` weight from its block-wise grid (numpy or jnp, as
    `scale`): each block's scale repeated over its block, cut to the weight where the last block
    is partial. A block size of 1 leaves that axis as it is (already one scale per row or column)."""
    xp = np if isinstance(scale, np.ndarray) else jnp
    for axis, (size, b) in enumerate(zip(shape, block)):
        scale = xp.repeat(scale, b, axis=axis)[(slice(None),) * axis + (slice(size),)]
    return scale


def dequantize_blocks(values, scale_inv, block: tuple):
    """The float32 weight of fp8 e4m3fn `values` (or their uint8 bits) scaled block-wise, as
    Qwen3-*-FP8 and DeepSeek-V3 store them: weight[i, j] = values[i, j] * scale_inv[i // b0, j // b1]
    (numpy or jnp, as `values`)."""
    xp = np if isinstance(values, np.ndarray) else jnp
    if values.dtype == np.uint8:
        values = values.view(jnp.float8_e4m3fn) if xp is np else jax.lax.bitcast_convert_type(values, jnp.float8_e4m3fn)
    return values.astype(np.float32) * expand_block_scales(scale_inv.astype(np.float32), values.shape, block)


def as_quantized(values, scale, fmt: str, contract: int, scale_has_contracted_axes: bool = False, lead: int = 0):
    """Quantized from values in the weight's layout and their scales (a pair of each for the CPU's
    separate gate/up); scale_has_contracted_axes: the scales still carry the contracted axes as
    size-1 ones. lead: Quantized.lead."""
    if isinstance(values, tuple):
        return tuple(as_quantized(v, s, fmt, contract, scale_has_contracted_axes, lead) for v, s in zip(values, scale))
    if scale_has_contracted_axes:
        scale = jnp.squeeze(scale, tuple(range(lead, lead + contract)))
    return Quantized(to_channels_first(values, contract, lead), scale, fmt, contract, lead)
