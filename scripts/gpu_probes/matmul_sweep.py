"""Time the weight matmul kernel (pallas_kernels/matmul.py) on a GPU at a model's projection
shapes, over its tile settings, beside XLA's bf16 matmul and XLA's convert-then-matmul of 8-bit
weights; prints the fraction of the copy bandwidth each reaches (weights read / time).

  python3 scripts/gpu_probes/matmul_sweep.py --shape llama3-8b --rows 1 32 --formats int8 fp8 float

Each timing runs `copies` different weight matrices of one shape in one jitted graph (together
several times the L2), best of --repeats calls; the time per matrix includes its launch. Stops
sweeping after --budget-s seconds and prints what it has. One JSON line per timing goes to --out.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import jax
import jax.numpy as jnp

from jaxspec.bench.common import best_seconds
from jaxspec.bench.scale import jax_copy_bandwidth
from jaxspec.bench.shapes import SHAPES, projection_shapes, shape_config
from pallas_kernels.matmul import matmul
from pallas_kernels.matvec import matvec

STORED = {"float": jnp.bfloat16, "int8": jnp.int8, "fp8": jnp.uint8}


def weights(k: int, n: int, fmt: str, copies: int, nk: bool):
    key = jax.random.PRNGKey(k * 7 + n)
    shape = (n, k) if nk else (k, n)
    if fmt == "float":
        one = lambda key: jax.random.normal(key, shape, jnp.bfloat16) / 64
    else:
        one = lambda key: jax.random.randint(key, shape, -127 if fmt == "int8" else 0, 127).astype(STORED[fmt])
    return [one(key) for key in jax.random.split(key, copies)]  # separate buffers, as a model's are


def timed(fn, w, x, scale, repeats: int) -> float:
    """Seconds per matrix of fn over every matrix in the list w. One call runs the list `loops`
    times in a fori_loop, each pass's x depending on the last's outputs (summed whole, so XLA
    computes every column), which keeps JAX's dispatch out of the time."""
    nbytes = sum(wi.nbytes for wi in w)
    loops = min(200, max(2, int(20e-3 * 3e12 / nbytes)))

    def passes(w, x, scale):
        def one_pass(i, x):
            total = jnp.sum(jnp.concatenate([fn(x, wi, scale).ravel() for wi in w]).astype(jnp.float32))
            return x + (total * 1e-30).astype(x.dtype)
        return jax.lax.fori_loop(0, loops, one_pass, x)

    f = jax.jit(passes)
    return best_seconds(lambda: f(w, x, scale).block_until_ready(), repeats) / (loops * len(w))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    p.add_argument("--projections", nargs="+", default=["wqkv", "wo", "w_gate_up", "w_down"])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    p.add_argument("--formats", nargs="+", default=["int8", "fp8", "float"], choices=list(STORED))
    p.add_argument("--block-n", type=int, nargs="+", default=[32, 64, 128])
    p.add_argument("--block-k", type=int, nargs="+", default=[128, 256])
    p.add_argument("--split-k", type=int, nargs="+", default=[1, 2, 4, 8], help="0: the kernel's default")
    p.add_argument("--layouts", nargs="+", default=["kn", "nk"], choices=["kn", "nk"])
    p.add_argument("--num-stages", type=int, nargs="+", default=[3])
    p.add_argument("--num-warps", type=int, nargs="+", default=[4])
    p.add_argument("--block-m", type=int, nargs="+", default=[16])
    p.add_argument("--subs", type=int, nargs="+", default=[0], help="row blocks per program (0: the kernel's default)")
    p.add_argument("--kernel", default="matmul", choices=["matmul", "matvec"],
                   help="matvec: pallas_kernels/matvec.py (8-bit, nk, few rows; block_m and subs unused)")
    p.add_argument("--top", type=int, default=3, help="settings kept from the first format for the others")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=420.0)
    p.add_argument("--out", help="JSON lines file")
    p.add_argument("--interpret", action="store_true", help="Pallas interpret mode (a CPU smoke run)")
    args = p.parse_args(argv)
    start = time.perf_counter()
    out = open(args.out, "a") if args.out else None
    bw = jax_copy_bandwidth(0.25 if args.interpret else 4.0)
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}, copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)

    def record(**r):
        r["of_copy_bw"] = r["bytes"] / r["s"] / bw
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()), flush=True)
        if out:
            out.write(json.dumps(r) + "\n")
            out.flush()

    shapes = projection_shapes(shape_config(args.shape))
    settings = list(itertools.product(args.layouts, args.block_n, args.block_k, args.split_k, args.num_stages,
                                      args.num_warps, args.block_m, args.subs))
    for name in args.projections:
        k, n = shapes[name]
        best: list[tuple[float, tuple]] = []
        for fi, fmt in enumerate(args.formats):
            nbytes = k * n * jnp.dtype(STORED[fmt]).itemsize
            copies = min(64, max(2, -(-(256 << 20) // nbytes)))
            scale = jnp.ones((n,), jnp.float32) if fmt != "float" else None
            for rows in args.rows:
                x = jax.random.normal(jax.random.PRNGKey(rows), (rows, k), jnp.bfloat16)
                w_kn = weights(k, n, fmt, copies, nk=False)
                if fmt == "float":
                    s = timed(lambda x, w, _: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype),
                              w_kn, x, scale, args.repeats)
                else:
                    to = jnp.float8_e4m3fn if fmt == "fp8" else jnp.int8
                    s = timed(lambda x, w, sc: (jnp.dot(x, jax.lax.bitcast_convert_type(w, to).astype(x.dtype),
                                                        preferred_element_type=jnp.float32) * sc).astype(x.dtype),
                              w_kn, x, scale, args.repeats)
                record(projection=name, k=k, n=n, fmt=fmt, rows=rows, kernel="xla", s=s, bytes=nbytes)
                w_nk = weights(k, n, fmt, copies, nk=True) if "nk" in args.layouts else None
                tried = settings if fi == 0 and rows == args.rows[0] else [t for _, t in sorted(best)[: args.top]]
                ranked = []
                for layout, bn, bk, sk, stages, warps, bm, subs in tried:
                    if time.perf_counter() - start > args.budget_s:
                        print("# budget spent", flush=True)
                        return
                    if sk and (k % sk or (k // sk) % min(bk, 16)) or n % bn:
                        continue
                    if args.kernel == "matvec":
                        if fmt == "float" or layout != "nk":
                            continue
                        kw = dict(fmt=fmt, block_k=bk, block_n=bn, split_k=sk or 1, num_warps=warps,
                                  interpret=args.interpret)
                        fn = lambda x, w, sc: matvec(x, w, sc, **kw)
                    else:
                        kw = dict(fmt=fmt, block_m=bm, block_k=bk, block_n=bn, split_k=sk or None,
                                  w_nk=layout == "nk", num_stages=stages, num_warps=warps, interpret=args.interpret,
                                  subs=subs or None)
                        fn = lambda x, w, sc: matmul(x, w, sc, **kw)
                    try:
                        s = timed(fn, w_nk if layout == "nk" else w_kn, x, scale, args.repeats)
                    except Exception as e:  # a setting Triton cannot compile: say so and go on
                        print(f"# {name} {fmt} {layout} bn={bn} bk={bk} sk={sk}: {type(e).__name__}: {str(e)[:160]}")
                        continue
                    record(projection=name, k=k, n=n, fmt=fmt, rows=rows, kernel=args.kernel, layout=layout,
                           block_n=bn, block_k=bk, split_k=sk, stages=stages, warps=warps, block_m=bm, subs=subs,
                           s=s, bytes=nbytes)
                    ranked.append((s, (layout, bn, bk, sk, stages, warps, bm, subs)))
                if fi == 0 and rows == args.rows[0]:
                    best = ranked
                ranked.sort()
                print(f"## {name} {fmt} rows={rows}: best {ranked[:3]}", flush=True)
    print(f"# done in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
