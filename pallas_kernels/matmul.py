"""Weight matmul with a fixed reduction order (Pallas, Triton lowering: runs on ROCm and CUDA):
activations times bf16, int8 or fp8 weights, float32 accumulation, per-output-channel scales in
the epilogue.

Layout:
  x      [m, k]  activations (bf16 or float32)
  w      [k, n]  weights: x's dtype, int8, or fp8 e4m3fn given as its uint8 bits (FORMATS)
  scale  [n]     float32 per output channel (None: no scaling)
  -> out [m, n]  in x's dtype (or out_dtype: float32 for logits)

Grid (n / block_n, m / block_m, rows padded to block_m): each program owns one block_m x block_n
output tile and reduces over all of k in blocks of block_k, in order, with one float32
accumulator. The tiles depend on (k, n) only, so every output element is summed in the same
order whatever m is and whatever the other rows hold: a row gives the same bits alone, in a
batch, or in a verify pass of K+1 rows (issue 25). At decode row counts the kernel is bound by
reading w, which 8-bit weights halve (issue 26).

8-bit weights become x's dtype in registers. int8 converts exactly. fp8 e4m3fn is decoded from its
bits without fp8 hardware or Triton's fp8 casts (absent for ROCm's e4m3fnuz in Pallas): its
exponent and mantissa, shifted left by 7 beside its sign, are a float16 of the same value / 2^8
(normal and subnormal alike; fp8 NaN is never stored), and the 2^8 joins the scale. So one
stored format runs on MI300 and H200 alike.

Backend notes (DESIGN.md): compiler_params are always plt.CompilerParams; Triton wants
power-of-two tiles and dot tiles >= 16; MI300 has 64 KB of shared memory per CU, which the
default tiles (block_k 128: at most 16 KB of weights and 4 KB of activations per stage) respect.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

FORMATS = ("float", "int8", "fp8")  # w as x's float dtype, int8, or fp8 e4m3fn bits (uint8)
BLOCK_M = 16  # output rows per program: the smallest dot tile, so decode rows waste least
FP8_SHIFT = 2.0 ** 8  # the float16 decode of fp8 bits is the value / 2^8


def _largest_pow2_divisor(size: int, at_most: int, name: str) -> int:
    block = at_most
    while block >= 16 and size % block:
        block //= 2
    if block < 16:
        raise ValueError(f"matmul {name} {size} must be a multiple of 16 (Triton's smallest dot tile)")
    return block


def tiling(k: int, n: int, block_k: int = 128, block_n: int = 64) -> tuple[int, int]:
    """(block_k, block_n): the largest powers of two up to the given ones that divide k and n.
    They depend on the weight's shape only (never on the rows), which keeps the order fixed."""
    return _largest_pow2_divisor(k, block_k, "k"), _largest_pow2_divisor(n, block_n, "n")


def _fp8_bits_to_f16(bits):
    """fp8 e4m3fn bits (uint8) -> float16 of the value / 2^8 (see the module docstring)."""
    b = bits.astype(jnp.int32)
    half = ((b & 0x7F) << 7) | ((b & 0x80) << 8)
    return lax.bitcast_convert_type(half.astype(jnp.uint16), jnp.float16)


def _weights_as(w, fmt: str, dtype):
    if fmt == "fp8":
        return _fp8_bits_to_f16(w).astype(jnp.float32).astype(dtype)
    if fmt == "int8":
        return w.astype(jnp.float32).astype(dtype)
    return w


def _dot(a, b):
    """a [M, K] . b [K, N] -> float32; IEEE float32 for float32 inputs (Triton would use tf32)."""
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=lax.Precision.HIGHEST,
                           preferred_element_type=jnp.float32)


def _matmul_kernel(x_ref, w_ref, *rest, block_k: int, fmt: str, scaled: bool):
    scale_ref, o_ref = rest if scaled else (None, rest[0])
    k = x_ref.shape[1]

    def step(i, acc):
        at = pl.multiple_of(i * block_k, block_k)
        x = x_ref[:, pl.ds(at, block_k)]
        w = _weights_as(w_ref[pl.ds(at, block_k), :], fmt, x.dtype)
        return acc + _dot(x, w)

    acc = lax.fori_loop(0, k // block_k, step, jnp.zeros(o_ref.shape, jnp.float32))
    if scaled:
        acc = acc * scale_ref[...][None, :]
    o_ref[...] = acc.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("fmt", "out_dtype", "block_k", "block_n", "num_warps", "num_stages",
                                             "interpret"))
def matmul(x, w, scale=None, *, fmt: str = "float", out_dtype=None, block_k: int = 128, block_n: int = 64,
           num_warps: int = 4, num_stages: int = 2, interpret: bool = False):
    """x [m, k] @ w [k, n] (times scale [n]) -> [m, n] in out_dtype (default x's); see the
    module docstring."""
    if fmt not in FORMATS:
        raise ValueError(f"matmul fmt must be one of {', '.join(FORMATS)}; got {fmt!r}")
    m, k = x.shape
    if w.shape[0] != k or w.ndim != 2:
        raise ValueError(f"matmul w must be [k={k}, n]; got {list(w.shape)}")
    expected = {"int8": jnp.int8, "fp8": jnp.uint8}.get(fmt, x.dtype)
    if w.dtype != expected:
        raise ValueError(f"matmul w for fmt {fmt!r} must be {jnp.dtype(expected).name}; got {w.dtype}")
    n = w.shape[1]
    block_k, block_n = tiling(k, n, block_k, block_n)
    rows = -(-m // BLOCK_M) * BLOCK_M
    xp = x if rows == m else jnp.pad(x, ((0, rows - m), (0, 0)))
    scaled = scale is not None or fmt == "fp8"
    args = [xp, w]
    in_specs = [pl.BlockSpec((BLOCK_M, k), lambda j, i: (i, 0)), pl.BlockSpec((k, block_n), lambda j, i: (0, j))]
    if scaled:
        s = jnp.ones((n,), jnp.float32) if scale is None else scale.astype(jnp.float32)
        args.append(s * FP8_SHIFT if fmt == "fp8" else s)
        in_specs.append(pl.BlockSpec((block_n,), lambda j, i: (j,)))
    out = pl.pallas_call(
        functools.partial(_matmul_kernel, block_k=block_k, fmt=fmt, scaled=scaled),
        grid=(n // block_n, rows // BLOCK_M),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((BLOCK_M, block_n), lambda j, i: (i, j)),
        out_shape=jax.ShapeDtypeStruct((rows, n), out_dtype or x.dtype),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"matmul_{fmt}",
    )(*args)
    return out if rows == m else out[:m]


def matmul_reference(x, w, scale=None, fmt: str = "float"):
    """Plain-JAX float32 reference, written independently of the kernel: fp8 bits through JAX's
    own float8_e4m3fn type."""
    if fmt == "fp8":
        w = lax.bitcast_convert_type(w, jnp.float8_e4m3fn)
    out = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32), precision=lax.Precision.HIGHEST)
    return out if scale is None else out * scale.astype(jnp.float32)[None, :]
