"""A few rows times 8-bit weights by multiply-and-reduce (Pallas, Triton lowering): the decode
step of a batch of one, where a tensor-core tile of 16 rows would carry one real row.

Layout (as pallas_kernels/matmul.py with w_nk):
  x      [m, k]  activations (bf16 or float32), m <= MAX_ROWS
  w      [n, k]  int8, or fp8 e4m3fn given as its uint8 bits; each output channel contiguous
  scale  [n]     float32 per output channel
  -> out [m, n]  in out_dtype (default x's)

Grid (n / block_n, split_k): each program reads a [block_n, k / split_k] panel of w in
[block_n, block_k] tiles, converts each weight once to float32 in registers, sums each CHUNK
neighbouring products (meant to stay within a thread's own 16-byte load) and keeps those
float32 sums ([block_n, block_k / CHUNK] per row), reduced across k once at the end: no
tensor-core tile, no per-step cross-thread reduction. int8 forms each chunk's sum as a chain of
fused multiply-adds, fp8 as products summed pairwise (CHAINED). (A sum per weight position
instead took 80-122 registers a thread and a quarter to a third of the GPU's warps: 37.3 against
33.6 us for the 8B gate/up on the H200.) split_k > 1: float32 partials added in order after,
then the scales.

Fusions (pallas_kernels/fused.py): the RMS norm before the projection (x scaled as loaded, 1/rms
in the epilogue), the gated MLP's silu(gate) * up, the residual add.

The reduction order differs from the matmul kernel's, so a row's bits here are not its bits in a
larger batch: the default mode's decode path only; deterministic mode (docs/deterministic.md)
keeps the one-order matmul for every row count.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.fused import check_fusions, combine_partials, finish, given, inverse_rms
from pallas_kernels.matmul import FP8_SHIFT, NATIVE_FP8, _fp8_bits_to_f16, _largest_pow2_divisor, matmul_reference

MAX_ROWS = 4  # float32 sums per row in registers: registers bound the rows
CHUNK = 16  # neighbouring products summed in registers each step (16 bytes of 8-bit weights)
FORMATS = ("int8", "fp8")


INT8_MAGIC = 0x4B000080  # float32 bits of 2^23 + 128; the low byte holds an int8's bits xor 0x80
# The same trick in PTX, four weights (one 32-bit register) an instance: one xor flips the four
# sign bits, each prmt puts one byte under the bytes 00 00 4B, a subtraction makes it exact.
INT8_PTX = "\n".join(
    ["{", ".reg .b32 t;", "xor.b32 t, $4, 0x80808080;"]
    + [f"prmt.b32 ${i}, t, 0x4B000000, 0x754{i};" for i in range(4)]
    + [f"sub.f32 ${i}, ${i}, 0f4B000080;" for i in range(4)] + ["}"])
PTX_PLATFORMS = ("cuda",)  # where Triton takes inline PTX (int8's conversion above)


def _to_f32(w, fmt: str, native: bool):
    """8-bit weights as float32, exactly. int8: its bits xor 0x80 (v + 128) as the low mantissa
    byte of 2^23 + 128, minus 2^23 + 128 (integer and add work: on the H200 faster than the
    conversion instruction), in PTX where native (CUDA). fp8: the GPU's fp8 conversion where
    native, else the bit decode (the value / 2^8)."""
    if fmt == "int8" and native:
        [out] = plt.elementwise_inline_asm(INT8_PTX, args=[w], constraints="=r,=r,=r,=r,r", pack=4,
                                           result_shape_dtypes=[jax.ShapeDtypeStruct(w.shape, jnp.float32)])
        return out
    if fmt == "int8":
        bits = lax.bitcast_convert_type(w, jnp.uint8).astype(jnp.int32) ^ INT8_MAGIC
        return lax.bitcast_convert_type(bits, jnp.float32) - jnp.float32(2.0 ** 23 + 128)
    if native:
        return lax.bitcast_convert_type(w, jnp.float8_e4m3fn).astype(jnp.float32)
    return _fp8_bits_to_f16(w).astype(jnp.float32)


FMA_PTX = "fma.rn.f32 $0, $1, $2, $3;"
# The formats whose chunk sums are chains of multiply-adds (_chained) rather than products summed
# pairwise: on the H200 int8's one-row projections took 71.0 us an 8B layer against 73.1 (its
# conversion leaves the most instructions a weight, so fused multiply-adds pay); fp8's 71.7
# against 70.6, so fp8 keeps the pairwise sums (docs/quantization.md).
CHAINED = ("int8",)


def _fma(a, b, c, ptx: bool):
    """a * b + c, one rounding (one FFMA) where ptx (CUDA): Triton there keeps a product and a sum
    apart, two instructions a weight; elsewhere the compiler's own."""
    if ptx:
        [out] = plt.elementwise_inline_asm(FMA_PTX, args=[a, b, c], constraints="=r,r,r,r", pack=1,
                                           result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)])
        return out
    return a * b + c


def _chained(acc, w, x, chunk: int, ptx: bool):
    """acc [n, k / chunk] + the sums of each chunk neighbouring products of w [n, k] and x [k], as one
    chain of multiply-adds per chunk (all within the thread that loaded the chunk's weights)."""
    n, k = w.shape
    ws = jnp.split(w.reshape(n, k // chunk, chunk), chunk, axis=-1)
    xs = jnp.split(x.reshape(1, k // chunk, chunk), chunk, axis=-1)
    for wj, xj in zip(ws, xs):
        acc = _fma(wj.reshape(n, k // chunk), jnp.broadcast_to(xj.reshape(1, k // chunk), (n, k // chunk)), acc, ptx)
    return acc


def _matvec_kernel(x_ref, w_ref, s_ref, *rest, m: int, block_k: int, fmt: str, native: bool, ptx: bool,
                   split: bool, normed: bool = False, gated: bool = False, residual: bool = False, k_total: int = 0,
                   eps: float = 0.0):
    refs = list(rest)
    norm_ref = refs.pop(0) if normed else None
    res_ref = refs.pop(0) if residual else None
    o_ref = refs.pop(0)
    kk = w_ref.shape[-1]
    block_n = w_ref.shape[-2]
    halves = 2 if gated else 1  # gated: w_ref holds [gate, up] panels (pallas_kernels/fused.py)
    chunk = min(CHUNK, block_k)

    def chunked(p):  # [..., block_k] -> [..., block_k / chunk]: sums of neighbours, within a thread
        return jnp.sum(p.reshape(*p.shape[:-1], block_k // chunk, chunk), axis=-1)

    def summed(acc, w, x):  # acc + the chunk sums of w [block_n, block_k] times x [block_k] (CHAINED)
        return _chained(acc, w, x, chunk, ptx) if fmt in CHAINED else acc + chunked(w * x[None, :])

    def step(i, carry):
        accs, squares = carry
        at = pl.multiple_of(i * block_k, block_k)
        ws = [_to_f32(w_ref[h, :, pl.ds(at, block_k)] if gated else w_ref[:, pl.ds(at, block_k)], fmt, native)
              for h in range(halves)]
        xs = [x_ref[r, pl.ds(at, block_k)].astype(jnp.float32) for r in range(m)]
        if normed:  # squares by chunk, summed at the end; x scaled by the norm weight
            squares = tuple(sq + chunked(x * x) for sq, x in zip(squares, xs))
            g = norm_ref[pl.ds(at, block_k)].astype(jnp.float32)
            xs = [x * g for x in xs]
        return tuple(summed(accs[r * halves + h], w, xs[r]) for r in range(m) for h, w in enumerate(ws)), squares

    zeros = (jnp.zeros((block_n, block_k // chunk), jnp.float32),) * (m * halves)
    accs, squares = lax.fori_loop(0, kk // block_k, step,
                                  (zeros, (jnp.zeros((block_k // chunk,), jnp.float32),) * m if normed else ()))
    for r in range(m):
        ys = [jnp.sum(acc, axis=1) for acc in accs[r * halves:(r + 1) * halves]]
        if split:  # float32 partials: scaled and finished after the sum
            for h, y in enumerate(ys):
                if gated:
                    o_ref[h, r, :] = y
                else:
                    o_ref[r, :] = y
            continue
        if normed:
            inv = inverse_rms(jnp.sum(squares[r]), k_total, eps)
            ys = [y * inv for y in ys]
        ys = [y * (s_ref[h, :] if gated else s_ref[...]) for h, y in enumerate(ys)]
        res = res_ref[r, :] if residual else None
        o_ref[r, :] = finish(ys[0], o_ref.dtype, up=ys[1] if gated else None, residual=res)


def default_block_k(k: int) -> int:
    """The k tile for a program's k weights a row: 1024, 2048 past 8192 (H200, 8B shape, of
    512-2048: down's best, gate/up within 1.5 % of its best; q/k/v and o were best at 1024 with
    3 stages, not measured with the 1 this kernel runs; docs/quantization.md)."""
    return 2048 if k > 8192 else 1024


@functools.partial(jax.jit, static_argnames=("fmt", "out_dtype", "block_n", "block_k", "split_k", "num_warps",
                                             "interpret", "gated", "eps"))
def matvec(x, w, scale, norm=None, residual=None, *, fmt: str, out_dtype=None, block_n: int | None = None,
           block_k: int | None = None, split_k: int = 1, num_warps: int = 4, interpret: bool = False,
           gated: bool = False, eps: float = 1e-6):
    """x [m, k] @ w[n, k].T * scale [n] -> [m, n] for m <= MAX_ROWS; see the module docstring.
    block_n None: 8 columns a program (gated: 4 of gate's and 4 of up's). block_k None:
    default_block_k. Loads run in program order (Triton pipelines only loads that feed dots;
    carrying tiles a step ahead by hand was slower on the H200). Fusions as the matmul kernel's
    (pallas_kernels/fused.py): norm [k] (split_k 1 only), gated, residual [m, n]."""
    if fmt not in FORMATS:
        raise ValueError(f"matvec fmt must be one of {', '.join(FORMATS)}; got {fmt!r}")
    m, k = x.shape
    n = w.shape[0]
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"matvec x must have 1 to {MAX_ROWS} rows; got {m}")
    if w.ndim != 2 or w.shape[1] != k:
        raise ValueError(f"matvec w must be [n, k={k}]; got {list(w.shape)}")
    expected = jnp.int8 if fmt == "int8" else jnp.uint8
    if w.dtype != expected:
        raise ValueError(f"matvec w for fmt {fmt!r} must be {jnp.dtype(expected).name}; got {w.dtype}")
    if split_k < 1 or k % split_k:
        raise ValueError(f"matvec split_k must divide k={k}; got {split_k}")
    if norm is not None and split_k > 1:
        raise ValueError(f"matvec fuses norm without k splits only (split_k 1); got split_k {split_k}")
    fusions = check_fusions(m, k, n, norm, residual, gated, True, "matvec")
    kk = k // split_k
    halves = 2 if gated else 1
    n_out = n // halves
    block_n = block_n or 8 // halves
    while n_out % block_n:  # any n: the largest power of two up to block_n that divides it
        block_n //= 2
    block_k = _largest_pow2_divisor(kk, block_k or default_block_k(kk), "k")
    out_dtype = out_dtype or x.dtype
    rows = 1
    while rows < m:
        rows *= 2  # Triton blocks are powers of two; the kernel reads and writes only the m real rows
    split = split_k > 1
    w = w.reshape(2, n_out, k) if gated else w
    in_specs = [pl.BlockSpec((rows, kk), lambda j, p: (0, p)),
                pl.BlockSpec((2, block_n, kk), lambda j, p: (0, j, p)) if gated else
                pl.BlockSpec((block_n, kk), lambda j, p: (j, p)),
                pl.BlockSpec((2, block_n), lambda j, p: (0, j)) if gated else pl.BlockSpec((block_n,), lambda j, p: (j,))]
    if norm is not None:
        in_specs.append(pl.BlockSpec((kk,), lambda j, p: (p,)))
    if residual is not None and not split:
        in_specs.append(pl.BlockSpec((rows, block_n), lambda j, p: (0, j)))
    if split:  # float32 partials, [2, m, n] each gated
        out_spec = (pl.BlockSpec((None, 2, rows, block_n), lambda j, p: (p, 0, 0, j)) if gated else
                    pl.BlockSpec((None, rows, block_n), lambda j, p: (p, 0, j)))
        out_shape = jax.ShapeDtypeStruct((split_k, 2, m, n_out) if gated else (split_k, m, n_out), jnp.float32)
    else:
        out_spec = pl.BlockSpec((rows, block_n), lambda j, p: (0, j))
        out_shape = jax.ShapeDtypeStruct((m, n_out), out_dtype)

    own = NATIVE_FP8 if fmt == "fp8" else PTX_PLATFORMS  # platforms converting with their own instructions

    def on(platform):
        native = platform in own
        s = scale.astype(jnp.float32) * (FP8_SHIFT if fmt == "fp8" and not native else 1.0)
        s = s.reshape(2, n_out) if gated else s
        call = pl.pallas_call(
            functools.partial(_matvec_kernel, m=m, block_k=block_k, fmt=fmt, native=native,
                              ptx=platform in PTX_PLATFORMS, split=split,
                              normed=norm is not None, gated=gated, residual=residual is not None and not split,
                              k_total=k, eps=eps),
            grid=(n_out // block_n, split_k),
            in_specs=in_specs,
            out_specs=out_spec,
            out_shape=out_shape,
            compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
            interpret=interpret,
            name=f"matvec_{fmt}",
        )

        def run(x, w, *f):
            norm_, residual_ = given(f, norm, residual)
            operands = [a for a in (norm_, None if split else residual_) if a is not None]
            out = call(x, w, s, *operands)
            return combine_partials(out, s, out_dtype, residual=residual_) if split else out
        return run

    if interpret:
        return on("interpret")(x, w, *fusions)
    return lax.platform_dependent(x, w, *fusions, default=on("default"),
                                  **{p: on(p) for p in sorted({*own, *PTX_PLATFORMS})})


def matvec_reference(x, w, scale, fmt: str):
    """Plain-JAX float32 reference: the matmul kernel's (written independently of both kernels)
    with w [n, k] as [k, n]."""
    return matmul_reference(x, w.T, scale, fmt)
