#!/usr/bin/env python3
"""On a GPU: each 8B projection at verify and batch row counts through XLA on converted 8-bit
weights, written several ways, beside the matmul kernel: us per projection, timed as
scripts/gpu_probes/matmul_sweep.py times (copies of the weights in one jitted loop, best of 3).

    python3 scripts/gpu_probes/xla_8bit_conversions.py [--rows 4 32]

s8: int8 astype; s8-f32 / s8-f16: through float32 / float16; s8-magic: (v xor 0x80) | 0x6400 as
float16, minus 1152; fp8: bitcast to float8_e4m3fn then astype; fp8-f16: the rows and the
weights as float16 (e4m3 -> float16 is one instruction for two weights on Hopper, -> bf16 is not);
fp8-w8a8: the rows quantized to
e4m3 too (a float32 scale per row) and an fp8 x fp8 dot with float32 sums (vLLM's FP8 on Hopper
and MI300), not what the engine runs; kernel-*: pallas_kernels/matmul.py.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from jax import lax
from matmul_sweep import timed, weights

from jaxspec.bench.shapes import projection_shapes, shape_config
from pallas_kernels.matmul import matmul

CONVERSIONS = {
    "s8": lambda w, dtype: w.astype(dtype),
    "s8-f32": lambda w, dtype: w.astype(jnp.float32).astype(dtype),
    "s8-f16": lambda w, dtype: w.astype(jnp.float16).astype(dtype),
    "s8-magic": lambda w, dtype: (lax.bitcast_convert_type(
        (lax.bitcast_convert_type(w, jnp.uint8).astype(jnp.uint16) ^ 0x80) | 0x6400, jnp.float16)
        - jnp.float16(1152)).astype(dtype),
    "fp8": lambda w, dtype: lax.bitcast_convert_type(w, jnp.float8_e4m3fn).astype(dtype),
}


def xla(convert):
    def product(x, w, scale):
        wb = convert(w, x.dtype)
        return (jnp.einsum("mk,nk->mn", x, wb, preferred_element_type=jnp.float32) * scale).astype(x.dtype)
    return product


def f16_rows(x, w, scale):
    """Rows and weights as float16, float32 sums (rows past 65504 would overflow: a measurement)."""
    wf = lax.bitcast_convert_type(w, jnp.float8_e4m3fn).astype(jnp.float16)
    y = jnp.einsum("mk,nk->mn", x.astype(jnp.float16), wf, preferred_element_type=jnp.float32)
    return (y * scale).astype(x.dtype)


def w8a8(x, w, scale):
    """Activations quantized per row to e4m3 (amax / 448), then the fp8 x fp8 product."""
    f8 = jnp.float8_e4m3fn
    row_scale = jnp.maximum(jnp.max(jnp.abs(x.astype(jnp.float32)), axis=1, keepdims=True), 1e-12) / 448.0
    x8 = (x.astype(jnp.float32) / row_scale).astype(f8)
    y = jnp.einsum("mk,nk->mn", x8, lax.bitcast_convert_type(w, f8), preferred_element_type=jnp.float32)
    return (y * row_scale * scale).astype(x.dtype)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama3-8b")
    p.add_argument("--rows", type=int, nargs="+", default=[32, 4])
    args = p.parse_args(argv)
    shapes = projection_shapes(shape_config(args.shape))
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}: us per projection", flush=True)
    for rows in args.rows:
        for name in ("wqkv", "wo", "w_gate_up", "w_down"):
            k, n = shapes[name]
            x = jax.random.normal(jax.random.PRNGKey(0), (rows, k), jnp.bfloat16)
            scale = jnp.ones((n,), jnp.float32)
            copies = min(64, max(2, -(-(256 << 20) // (k * n))))
            us = {}
            for fmt in ("int8", "fp8"):
                w = weights(k, n, fmt, copies, nk=True)
                for kind, convert in CONVERSIONS.items():
                    if kind.startswith("s8") == (fmt == "int8"):
                        us[kind] = timed(xla(convert), w, x, scale, 3) * 1e6
                if fmt == "fp8":
                    us["fp8-f16"] = timed(f16_rows, w, x, scale, 3) * 1e6
                    us["fp8-w8a8"] = timed(w8a8, w, x, scale, 3) * 1e6
                us[f"kernel-{fmt}"] = timed(lambda x, w, s, fmt=fmt: matmul(x, w, s, fmt=fmt, w_nk=True), w, x, scale,
                                            3) * 1e6
            print(rows, name, " ".join(f"{kind}={t:.1f}" for kind, t in us.items()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
