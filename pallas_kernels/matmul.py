"""Weight matmul with a fixed reduction order (Pallas, Triton lowering: runs on ROCm and CUDA):
activations times bf16, int8 or fp8 weights, float32 accumulation, per-output-channel scales in
the epilogue.

Layout:
  x      [m, k]  activations (bf16 or float32)
  w      [k, n]  weights: x's dtype, int8, or fp8 e4m3fn given as its uint8 bits (FORMATS);
                 or [n, k] with w_nk (each output channel contiguous, as 8-bit models keep them)
  scale  [n]     float32 per output channel (None: no scaling)
  -> out [m, n]  in x's dtype (or out_dtype: float32 for logits)

Grid (m / (block_m * subs), n / block_n, split_k; the last rows masked): each program owns `subs` row
blocks of block_m rows beside one block_n-wide column tile and reduces over its k / split_k
share in blocks of block_k, in order, one float32 accumulator per row block: every weight tile
it loads serves all its rows (batches read each weight once), while every dot stays
[block_m, block_k] x [block_k, block_n], one instruction shape whatever subs is. Split partials
are added in order after. split_k fills the GPU when n alone gives few tiles (a decode step's o
projection: 64). The tiles and splits depend on (k, n) only, so every output element is summed
in the same order whatever m is and whatever the other rows hold: a row gives the same bits
alone, in a batch, or in a verify pass of K+1 rows (issue 25). At decode row counts the kernel
is bound by reading w, which 8-bit weights halve (issue 26).

With w_nk it fuses the gated MLP's silu(gate) * up and the residual add into its epilogue
(pallas_kernels/fused.py). (An RMS norm fused into the loop, x scaled as loaded and its squares
summed from the same loads, made the 8B projections 1.6-2.4x slower on the H200 at 1 and 64 rows,
the norm=1 rows of docs/bench/h200-matmul-sweep-norm-subs.jsonl, and the int8 step 1.6x slower;
deterministic mode runs pallas_kernels/rms_norm.py before them instead.)

8-bit weights become x's dtype in registers. int8 converts exactly. fp8 e4m3fn converts with the
GPU's own fp8 instruction on CUDA (NATIVE_FP8); elsewhere it is decoded from its bits without fp8
hardware or Triton's fp8 casts (absent for ROCm's e4m3fnuz in Pallas): its exponent and mantissa,
shifted left by 7 beside its sign, are a float16 of the same value / 2^8 (normal and subnormal
alike; fp8 NaN is never stored), and the 2^8 joins the scale. Both are exact, so one stored
format runs on MI300 and H200 alike, with the same bits. (One row of 8-bit weights has its own
kernel in the default mode: pallas_kernels/matvec.py.)

Backend notes (DESIGN.md): compiler_params are always plt.CompilerParams; Triton wants
power-of-two tiles and dot tiles >= 16; MI300 has 64 KB of shared memory per CU, which the
default tiles (block_k 128, block_n 64, 3 stages: at most 48 KB of weights and 12 KB of
activations) respect.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.fused import check_fusions, combine_partials, finish, given

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


MIN_PROGRAMS = 384  # at decode rows: about three per multiprocessor keep the weight reads flowing
MAX_SPLIT_K = 8
DECODE_BLOCK_N = 64  # the column tile the k splits are counted for (the decode rows' best)


def tiling(k: int, n: int, block_k: int | None = None, split_k: int | None = None) -> tuple[int, int]:
    """(block_k, split_k) for a [k, n] weight, the two settings that fix the order of every sum:
    the largest power of two up to block_k (default 128) that divides k / split_k, and (default)
    the fewest k splits, up to MAX_SPLIT_K, that give MIN_PROGRAMS programs of DECODE_BLOCK_N
    columns. Both depend on the weight's shape only, never on the rows. The defaults were the best
    at decode rows for the 8B and 1B shapes' projections in 8 bits (H200, scripts/gpu_probes/matmul_sweep.py:
    within 3 % of each shape's best of 96 settings)."""
    if split_k is None:
        tiles = n // _largest_pow2_divisor(n, DECODE_BLOCK_N, "n")
        split_k = 1
        while split_k < MAX_SPLIT_K and tiles * split_k < MIN_PROGRAMS and k % (2 * split_k * 16) == 0:
            split_k *= 2
    if split_k < 1 or k % split_k:
        raise ValueError(f"matmul split_k must divide k={k}; got {split_k}")
    return _largest_pow2_divisor(k // split_k, block_k or 128, "k"), split_k


def _fp8_bits_to_f16(bits):
    """fp8 e4m3fn bits (uint8) -> float16 of the value / 2^8 (see the module docstring)."""
    b = bits.astype(jnp.int32)
    half = ((b & 0x7F) << 7) | ((b & 0x80) << 8)
    return lax.bitcast_convert_type(half.astype(jnp.uint16), jnp.float16)


def _weights_as(w, fmt: str, dtype, native_fp8: bool = False):
    """8-bit weights in dtype, exactly (fp8: the value / 2^8 unless native_fp8)."""
    if fmt == "fp8" and native_fp8:  # the GPU's own fp8 conversion (CUDA: two weights an instruction)
        return lax.bitcast_convert_type(w, jnp.float8_e4m3fn).astype(dtype)
    if fmt == "fp8":
        return _fp8_bits_to_f16(w).astype(jnp.float32).astype(dtype)
    if fmt == "int8":
        return w.astype(jnp.float32).astype(dtype)
    return w


def _dot(a, b, contract=((1,), (0,))):
    """a [M, K] . b [K, N] (or b [N, K]) -> float32; IEEE float32 for float32 inputs (Triton
    would use tf32)."""
    return lax.dot_general(a, b, (contract, ((), ())), precision=lax.Precision.HIGHEST,
                           preferred_element_type=jnp.float32)


def _matmul_kernel(x_ref, w_ref, *rest, m: int, block_k: int, fmt: str, scaled: bool, w_nk: bool, subs: int,
                   native_fp8: bool, gated: bool = False, residual: bool = False, split: bool = False):
    refs = list(rest)
    scale_ref = refs.pop(0) if scaled else None
    res_ref = refs.pop(0) if residual else None
    o_ref = refs.pop(0)
    kk = x_ref.shape[1]
    bm = x_ref.shape[0] // subs
    dtype = x_ref.dtype
    halves = 2 if gated else 1  # gated: w_ref holds [gate, up] panels (pallas_kernels/fused.py)
    # Rows past m (the last program's) are masked, not padded: no pad before, no slice after.
    first = pl.program_id(0) * bm * subs
    real = [first + r * bm + jnp.arange(bm) < m for r in range(subs)]

    def step(i, carry):
        at = pl.multiple_of(i * block_k, block_k)
        if gated:
            ws = [_weights_as(w_ref[h, :, pl.ds(at, block_k)], fmt, dtype, native_fp8) for h in range(halves)]
        elif w_nk:
            ws = [_weights_as(w_ref[:, pl.ds(at, block_k)], fmt, dtype, native_fp8)]
        else:
            ws = [_weights_as(w_ref[pl.ds(at, block_k), :], fmt, dtype, native_fp8)]
        out = []
        for r in range(subs):  # one dot shape per row block, whatever subs is
            x = plt.load(x_ref.at[pl.ds(r * bm, bm), pl.ds(at, block_k)], mask=real[r][:, None], other=0)
            for h, w in enumerate(ws):
                out.append(carry[r * halves + h] + (_dot(x, w, ((1,), (1,))) if w_nk else _dot(x, w)))
        return tuple(out)

    accs = lax.fori_loop(0, kk // block_k, step, (jnp.zeros((bm, o_ref.shape[-1]), jnp.float32),) * (subs * halves))
    for r in range(subs):
        rows = pl.ds(r * bm, bm)
        ys = list(accs[r * halves:(r + 1) * halves])
        if split:  # float32 partials, finished after their sum
            for h, y in enumerate(ys):
                if gated:
                    plt.store(o_ref.at[pl.ds(h, 1), rows, :], y[None], mask=real[r][None, :, None])
                else:
                    plt.store(o_ref.at[rows, :], y, mask=real[r][:, None])
            continue
        if scaled:
            ys = [y * (scale_ref[h, :] if gated else scale_ref[...])[None, :] for h, y in enumerate(ys)]
        res = plt.load(res_ref.at[rows, :], mask=real[r][:, None], other=0) if residual else None
        out = finish(ys[0], o_ref.dtype, up=ys[1] if gated else None, residual=res)
        plt.store(o_ref.at[rows, :], out, mask=real[r][:, None])


# Rows per program (row blocks of block_m rows): 64, so at 64 rows and more each weight tile is
# read once; 256 (four 64-row blocks) asked the H200 for more shared memory than it has.
MAX_TILE_ROWS = 64
# The most rows per dot that give a row the bits of a 16-row dot, per platform: on NVIDIA GPUs
# 16-, 32- and 64-row dots (mma.sync, and Hopper's wgmma from 64) agreed bit for bit on the H200
# at every 8B projection (scripts/gpu_probes/matmul_bits.py; docs/deterministic.md). Elsewhere 16 only:
# MI300's MFMA instruction shape follows the tile, and interpret mode runs the CPU's dot.
DOT_ROWS = {"cuda": 64}
# Where fp8 weights convert through Triton's own fp8 cast (CUDA, sm_89 and later): faster than the
# bit decode at every 8B projection on the H200 (docs/quantization.md). Both are exact, so the
# choice changes no bit. ROCm keeps the bit decode (Pallas cannot cast MI300's e4m3fnuz).
NATIVE_FP8 = ("cuda",)
# 8-bit weights past BLOCK_M rows: wider column tiles, since each re-reads the activations' tile
# (H200, 32 rows: the 8B gate/up and down projections 15 % and 5 % faster than with 64).
WIDE_BLOCK_N = 128


def row_blocks(m: int, block_m: int = BLOCK_M) -> int:
    """Row blocks per program for m rows: enough for all of them, up to MAX_TILE_ROWS rows (a
    power of two)."""
    subs = 1
    while 2 * subs * block_m <= MAX_TILE_ROWS and subs * block_m < m:
        subs *= 2
    return subs


def rows_per_dot(m: int, most: int = BLOCK_M) -> int:
    """Rows per dot for m rows: a power of two from 16, up to `most` (DOT_ROWS)."""
    block_m = BLOCK_M
    while block_m < most and block_m < m:
        block_m *= 2
    return block_m


@functools.partial(jax.jit, static_argnames=("fmt", "out_dtype", "block_m", "block_k", "block_n", "split_k", "w_nk",
                                             "subs", "num_warps", "num_stages", "interpret", "gated"))
def matmul(x, w, scale=None, residual=None, *, fmt: str = "float", out_dtype=None, block_m: int | None = None,
           block_k: int | None = None, block_n: int | None = None, split_k: int | None = None, w_nk: bool = False,
           subs: int | None = None, num_warps: int = 4, num_stages: int = 3, interpret: bool = False,
           gated: bool = False):
    """x [m, k] @ w [k, n] (times scale [n]) -> [m, n] in out_dtype (default x's); see the
    module docstring. block_k, split_k: `tiling` (None: its defaults). split_k > 1: that many
    programs each sum a fixed k range, and their float32 partials are added in order afterwards.
    w_nk: w is given as [n, k] (each output channel contiguous: faster for 8-bit weights).
    block_m (rows per dot), subs (row blocks per program): None picks them for m rows on the
    platform the call is lowered for (rows_per_dot with DOT_ROWS, row_blocks). block_m, subs,
    block_n, num_warps and num_stages change no bit (measured: scripts/gpu_probes/matmul_bits.py).

    Fusions (pallas_kernels/fused.py; w_nk only): gated (w [2n, k]: gate's channels, then up's;
    -> silu(gate) * up [m, n]; block_n counts each half's columns, half the unfused default);
    residual [m, n] (added). Not the norm (see the module docstring)."""
    if fmt not in FORMATS:
        raise ValueError(f"matmul fmt must be one of {', '.join(FORMATS)}; got {fmt!r}")
    m, k = x.shape
    n = w.shape[0] if w_nk else w.shape[1]
    if w.ndim != 2 or w.shape[1 if w_nk else 0] != k:
        raise ValueError(f"matmul w must be [{'n, k=' + str(k) if w_nk else 'k=' + str(k) + ', n'}]; got {list(w.shape)}")
    expected = {"int8": jnp.int8, "fp8": jnp.uint8}.get(fmt, x.dtype)
    if w.dtype != expected:
        raise ValueError(f"matmul w for fmt {fmt!r} must be {jnp.dtype(expected).name}; got {w.dtype}")
    fusions = check_fusions(m, k, n, None, residual, gated, w_nk, "matmul")
    block_k, split_k = tiling(k, n, block_k, split_k)
    wide = fmt != "float" and m > BLOCK_M  # (bf16's tiles at 64 rows were measured with DECODE_BLOCK_N)
    n_out = n // 2 if gated else n
    default_n = (WIDE_BLOCK_N if wide else DECODE_BLOCK_N) // (2 if gated else 1)
    block_n = _largest_pow2_divisor(n_out, block_n or default_n, "n")
    s = jnp.ones((n,), jnp.float32) if scale is None else scale.astype(jnp.float32)
    scaled = scale is not None or fmt == "fp8"
    launch = functools.partial(_launch, fmt=fmt, out_dtype=out_dtype or x.dtype, block_k=block_k, block_n=block_n,
                               split_k=split_k, w_nk=w_nk, scaled=scaled, num_warps=num_warps,
                               num_stages=num_stages, interpret=interpret, gated=gated)

    def on(platform):
        native = fmt == "fp8" and platform in NATIVE_FP8
        bm = block_m or rows_per_dot(m, DOT_ROWS.get(platform, BLOCK_M))
        shifted = s * FP8_SHIFT if fmt == "fp8" and not native else s
        return lambda x, w, *f: launch(x, w, shifted, *given(f, residual), block_m=bm,
                                       subs=subs or row_blocks(m, bm), native_fp8=native)

    if interpret:
        return on("interpret")(x, w, *fusions)
    return lax.platform_dependent(x, w, *fusions, default=on("default"),
                                  **{p: on(p) for p in set(DOT_ROWS) | set(NATIVE_FP8)})


def _launch(x, w, s, residual, *, fmt: str, out_dtype, block_m: int, subs: int, block_k: int, block_n: int,
            split_k: int, w_nk: bool, scaled: bool, num_warps: int, num_stages: int, interpret: bool,
            native_fp8: bool, gated: bool):
    m, k = x.shape
    halves = 2 if gated else 1
    n = s.shape[0] // halves  # output columns
    tile_m = block_m * subs
    kk = k // split_k  # each program's share of the sum
    split = split_k > 1
    fused_scale = scaled and not split  # split partials are scaled after their sum
    # The row blocks of one weight tile are neighbours in the launch order (grid axis 0), so a
    # batch past tile_m rows reads each tile from memory once and from L2 after.
    args = [x, w.reshape(2, n, k) if gated else w]
    in_specs = [pl.BlockSpec((tile_m, kk), lambda i, j, p: (i, p)),
                pl.BlockSpec((2, block_n, kk), lambda i, j, p: (0, j, p)) if gated else
                pl.BlockSpec((block_n, kk), lambda i, j, p: (j, p)) if w_nk else
                pl.BlockSpec((kk, block_n), lambda i, j, p: (p, j))]
    if fused_scale:
        args.append(s.reshape(2, n) if gated else s)
        in_specs.append(pl.BlockSpec((2, block_n), lambda i, j, p: (0, j)) if gated else
                        pl.BlockSpec((block_n,), lambda i, j, p: (j,)))
    if residual is not None and not split:
        args.append(residual)
        in_specs.append(pl.BlockSpec((tile_m, block_n), lambda i, j, p: (i, j)))
    if split:  # float32 partials, [2, m, n] each gated
        out_specs = (pl.BlockSpec((None, 2, tile_m, block_n), lambda i, j, p: (p, 0, i, j)) if gated else
                     pl.BlockSpec((None, tile_m, block_n), lambda i, j, p: (p, i, j)))
        out_shape = jax.ShapeDtypeStruct((split_k, 2, m, n) if gated else (split_k, m, n), jnp.float32)
    else:
        out_specs = pl.BlockSpec((tile_m, block_n), lambda i, j, p: (i, j))
        out_shape = jax.ShapeDtypeStruct((m, n), out_dtype)
    out = pl.pallas_call(
        functools.partial(_matmul_kernel, m=m, block_k=block_k, fmt=fmt, scaled=fused_scale, w_nk=w_nk, subs=subs,
                          native_fp8=native_fp8, gated=gated, residual=residual is not None and not split,
                          split=split),
        grid=(pl.cdiv(m, tile_m), n // block_n, split_k),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"matmul_{fmt}",
    )(*args)
    if not split:
        return out
    return combine_partials(out, (s.reshape(2, n) if gated else s) if scaled else None, out_dtype, residual=residual)


def matmul_reference(x, w, scale=None, fmt: str = "float"):
    """Plain-JAX float32 reference, written independently of the kernel: fp8 bits through JAX's
    own float8_e4m3fn type."""
    if fmt == "fp8":
        w = lax.bitcast_convert_type(w, jnp.float8_e4m3fn)
    out = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32), precision=lax.Precision.HIGHEST)
    return out if scale is None else out * scale.astype(jnp.float32)[None, :]


def fused_reference(x, w, scale, fmt: str, norm=None, residual=None, gated: bool = False, eps: float = 1e-6):
    """Plain-JAX float32 reference of the fused kernels (w [n, k]; pallas_kernels/fused.py): HF's
    RMS norm, the product, silu(gate) * up, the residual, all in float32."""
    x = x.astype(jnp.float32)
    if norm is not None:
        x = x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * norm.astype(jnp.float32)
    out = matmul_reference(x, w.T, scale, fmt)
    if gated:
        gate, up = jnp.split(out, 2, axis=1)
        out = jax.nn.silu(gate) * up
    return out if residual is None else out + residual.astype(jnp.float32)
