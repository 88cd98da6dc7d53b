#!/usr/bin/env python3
"""Which of the matmul kernel's settings change a row's bits, on this machine's GPU: each
projection of a shape, at several row counts, through the kernel with 16-row dots, one row block
a program (the reference), and with settings changed (rows per dot, row blocks per program,
column tile, warps, stages; "default": what the kernel picks on this platform); prints, per
variant, how many output elements differ from the reference's and the largest difference, and
whether a row alone equals the same row among the others under the defaults. Only settings that
never change a bit may vary with the number of rows in deterministic mode (issue 25): block_k and
split_k are fixed by (k, n) and are not varied here.

    python3 scripts/gpu_probes/matmul_bits.py [--shape llama3-8b] [--rows 1 16 64 256]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.bench.shapes import projection_shapes, shape_config
from pallas_kernels.matmul import matmul

REFERENCE = dict(block_m=16, subs=1)
VARIANTS = {
    "default": {},
    "block_m=32": dict(block_m=32, subs=1),
    "block_m=64": dict(block_m=64, subs=1),
    "block_m=16, subs=4": dict(block_m=16, subs=4),
    "block_m=32, subs=2": dict(block_m=32, subs=2),
    "block_n=128": dict(block_n=128),
    "block_n=32": dict(block_n=32),
    "num_warps=8": dict(num_warps=8),
    "num_stages=4": dict(num_stages=4),
    "block_m=64, block_n=128, num_warps=8": dict(block_m=64, subs=1, block_n=128, num_warps=8),
}


def operands(k: int, n: int, rows: int, wide: bool, seed: int):
    """bf16 activations and weights; wide: magnitudes over 2^-8..2^8 with random signs, so sums
    cancel and round often (where a different order shows first)."""
    kx, kw, ke1, ke2 = jax.random.split(jax.random.PRNGKey(seed), 4)
    x = jax.random.normal(kx, (rows, k), jnp.float32)
    w = jax.random.normal(kw, (k, n), jnp.float32) / 64
    if wide:
        x = x * 2.0 ** jax.random.randint(ke1, x.shape, -8, 9)
        w = w * 2.0 ** jax.random.randint(ke2, w.shape, -8, 9)
    return x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama3-8b")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--projections", nargs="+", default=["wqkv", "wo", "w_gate_up", "w_down"],
                   choices=["wqkv", "wo", "w_gate_up", "w_down", "lm_head"])
    p.add_argument("--out-dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--interpret", action="store_true", help="Pallas interpret mode (a CPU smoke run)")
    args = p.parse_args(argv)
    shapes = projection_shapes(shape_config(args.shape))
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}, out {args.out_dtype}")
    print("| projection | rows | data | variant | elements differing | max abs diff |")
    print("| --- | --- | --- | --- | --- | --- |")
    out_dtype = jnp.dtype(args.out_dtype)
    for name in args.projections:
        k, n = shapes[name]
        for wide in (False, True):
            x_all, w = operands(k, n, max(args.rows), wide, seed=k + n)
            for rows in args.rows:
                x = x_all[:rows]
                ref = np.asarray(matmul(x, w, out_dtype=out_dtype, interpret=args.interpret, **REFERENCE))
                alone = np.asarray(matmul(x[:1], w, out_dtype=out_dtype, interpret=args.interpret))
                among = np.asarray(matmul(x, w, out_dtype=out_dtype, interpret=args.interpret))[:1]
                print(f"| {name} | {rows} | {'wide' if wide else 'normal'} | default: row 0 alone vs among these | "
                      f"{(alone != among).sum()} / {alone.size} | {np.abs(alone - among).max():.3g} |", flush=True)
                for variant, kw in VARIANTS.items():
                    try:
                        out = np.asarray(matmul(x, w, out_dtype=out_dtype, interpret=args.interpret, **kw))
                    except Exception as e:  # a setting Triton cannot compile: say so and go on
                        print(f"| {name} | {rows} | - | {variant} | {type(e).__name__}: {str(e)[:80]} | |")
                        continue
                    print(f"| {name} | {rows} | {'wide' if wide else 'normal'} | {variant} | "
                          f"{(out != ref).sum()} / {out.size} | {np.abs(out - ref).max():.3g} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
