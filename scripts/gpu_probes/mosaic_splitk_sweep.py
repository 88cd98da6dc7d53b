"""On a Hopper GPU (H100/H200): JAX's Mosaic GPU mixed-type matmul (TMA loads, a warp-specialized
pipeline, wgmma; jax/experimental/pallas/ops/gpu/hopper_mixed_type_matmul_mgpu.py) with the k range
split over its work items, at a model's projection shapes and a few rows, beside XLA's own GEMM on
the converted weights (and the matmul kernel for int8): us per projection, timed as
scripts/gpu_probes/matmul_sweep.py times. A measurement of a route not taken (docs/quantization.md, "B=32:
what the 8-bit GEMMs lose at 32 rows"), kept for whoever takes a TMA kernel up.

    python3 scripts/gpu_probes/mosaic_splitk_sweep.py [--rows 32] [--out FILE] [--budget-s 330]
    python3 scripts/gpu_probes/mosaic_splitk_sweep.py --lower   # lowers for CUDA ahead of time (any machine)

The weights [n, k] are the kernel's 8-bit operand and the rows, transposed, its other (bf16 for
int8; float16 for fp8, which this kernel cannot convert to bf16); each work item sums one k range
of a 2 * tile_m-channel tile into float32 partials [splits, n, rows], which XLA adds, scales and
transposes after.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import time

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax
from jax._src import dtypes
from matmul_sweep import timed, weights
from xla_8bit_conversions import CONVERSIONS, xla

from jaxspec.bench.shapes import projection_shapes, shape_config
from pallas_kernels.matmul import matmul

EPI_ROWS = 64  # output channels per epilogue copy
FP8_ROWS_DTYPE = jnp.float16  # the kernel converts e4m3 to float16, not to bf16


def splitk_kernel(a, b, *, tile_m: int, tile_k: int, steps: int, splits: int, num_sms: int):
    """a [m, k] 8-bit times b [k, n] 16-bit -> float32 partial sums [splits * m, n]: two compute
    warpgroups own tile_m rows of a each, a persistent grid of num_sms programs walks the
    (row tile, k range) work items."""
    m, k = a.shape
    n = b.shape[1]
    a_bits, b_bits = dtypes.itemsize_bits(a.dtype), dtypes.itemsize_bits(b.dtype)
    a_sw = plgpu.find_swizzle(tile_k * a_bits, "lhs")
    b_sw = plgpu.find_swizzle(n * b_bits, "rhs")
    o_sw = plgpu.find_swizzle(n * 32, "out")
    a_tr = (plgpu.TilingTransform((8, a_sw * 8 // a_bits)), plgpu.SwizzleTransform(a_sw))
    b_tr = (plgpu.TilingTransform((8, b_sw * 8 // b_bits)), plgpu.SwizzleTransform(b_sw))
    o_tr = (plgpu.TilingTransform((8, o_sw * 8 // 32)), plgpu.SwizzleTransform(o_sw))
    cta_m = 2 * tile_m
    if m % cta_m or k % (tile_k * splits) or tile_m % EPI_ROWS:
        raise ValueError(f"m={m} must divide by {cta_m}, k={k} by {tile_k * splits}, tile_m by {EPI_ROWS}")
    m_tiles, k_range = m // cta_m, k // splits

    def kernel(a_gmem, b_gmem, out_gmem, out_smem):
        def pipeline(body, context):
            return plgpu.emit_pipeline_warp_specialized(
                body, grid=(k_range // tile_k,), memory_registers=40,
                in_specs=[plgpu.BlockSpec((cta_m, tile_k), lambda i: (0, i), transforms=a_tr, memory_space=plgpu.SMEM),
                          plgpu.BlockSpec((tile_k, n), lambda i: (i, 0), transforms=b_tr, memory_space=plgpu.SMEM)],
                wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=steps, compute_context=context)

        def ignore(*_, **__):
            return None

        @functools.partial(pl.run_scoped, allocs=pipeline(ignore, ignore).get_allocations(a_gmem, b_gmem),
                           collective_axes="wg")
        def _scope(allocs):
            wg = lax.axis_index("wg")

            @plgpu.nd_loop((m_tiles * splits,), collective_axes="cluster_grid")
            def _items(info):
                (item,) = info.index
                mi, ks = item // splits, item % splits
                k_slice = pl.ds(ks * k_range, k_range)

                def context(eval_pipeline):
                    @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tile_m, n), jnp.float32))
                    def _acc(acc_ref):
                        eval_pipeline(acc_ref)
                        acc = acc_ref[...]
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                        for e in range(tile_m // EPI_ROWS):
                            slot = e % 2
                            plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                            out_smem[wg, slot] = acc[e * EPI_ROWS:(e + 1) * EPI_ROWS]
                            plgpu.commit_smem()
                            row = ks * m + mi * cta_m + wg * tile_m + e * EPI_ROWS
                            plgpu.copy_smem_to_gmem(out_smem.at[wg, slot], out_gmem.at[pl.ds(row, EPI_ROWS), :])

                def body(_, a_smem, b_smem, acc_ref):
                    plgpu.wgmma(acc_ref, a_smem[pl.ds(wg * tile_m, tile_m)].astype(b.dtype), b_smem)
                    plgpu.wgmma_wait(0)
                    return acc_ref

                pipeline(body, context)(a_gmem.at[pl.ds(mi * cta_m, cta_m), k_slice], b_gmem.at[k_slice, :],
                                        allocations=allocs)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    call = plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((splits * m, n), jnp.float32),
        grid=(num_sms,), grid_names=("cluster_grid",), num_threads=3, thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        scratch_types=dict(out_smem=plgpu.SMEM((2, min(2, tile_m // EPI_ROWS), EPI_ROWS, n), jnp.float32,
                                               transforms=o_tr)))
    return call(a, b)


def as_8bit(w, fmt: str):
    """The 8-bit weights as their own dtype (fp8 arrives as its uint8 bits)."""
    return lax.bitcast_convert_type(w, jnp.float8_e4m3fn if fmt == "fp8" else jnp.int8)


def product(x, w, scale, *, fmt: str, num_sms: int, splits: int, **tiles):
    """x [rows, k] bf16 @ w [n, k] (int8, or fp8 e4m3 bits as uint8) * scale [n] -> [rows, n] bf16."""
    values = as_8bit(w, fmt)
    rows_t = x.T.astype(FP8_ROWS_DTYPE if fmt == "fp8" else jnp.bfloat16)
    part = splitk_kernel(values, rows_t, num_sms=num_sms, splits=splits, **tiles)
    return (part.reshape(splits, w.shape[0], x.shape[0]).sum(0).T * scale).astype(x.dtype)


def lower() -> None:
    """Ahead of time for CUDA: catches API drift without a GPU."""
    x = jax.ShapeDtypeStruct((32, 4096), jnp.bfloat16)
    scale = jax.ShapeDtypeStruct((4096,), jnp.float32)
    for fmt, stored in (("int8", jnp.int8), ("fp8", jnp.uint8)):
        f = jax.jit(functools.partial(product, fmt=fmt, num_sms=132, tile_m=64, tile_k=256, steps=4, splits=4))
        f.trace(x, jax.ShapeDtypeStruct((4096, 4096), stored), scale).lower(lowering_platforms=("cuda",))
        print(f"{fmt}: lowered for CUDA")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama3-8b")
    p.add_argument("--projections", nargs="+", default=["wo", "w_down", "wqkv", "w_gate_up"])
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--splits", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8])
    p.add_argument("--budget-s", type=float, default=330.0)
    p.add_argument("--out", help="JSON lines file")
    p.add_argument("--lower", action="store_true", help="only lower for CUDA ahead of time")
    args = p.parse_args(argv)
    if args.lower:
        lower()
        return 0
    from jax.extend import backend
    num_sms = backend.get_default_device().core_count
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}, {num_sms} SMs", flush=True)
    out = open(args.out, "a") if args.out else None
    start = time.perf_counter()
    shapes = projection_shapes(shape_config(args.shape))

    def record(**r):
        print(json.dumps(r), flush=True)
        if out:
            out.write(json.dumps(r) + "\n")
            out.flush()

    for name in args.projections:
        k, n = shapes[name]
        copies = min(64, max(2, -(-(256 << 20) // (k * n))))
        for fmt in ("int8", "fp8"):
            x = jax.random.normal(jax.random.PRNGKey(3), (args.rows, k), jnp.bfloat16)
            ws = weights(k, n, fmt, copies, nk=True)
            scale = jax.random.uniform(jax.random.PRNGKey(4), (n,), jnp.float32, 0.5, 1.5)
            base = dict(projection=name, fmt=fmt, rows=args.rows)
            xla_product = xla(CONVERSIONS["fp8" if fmt == "fp8" else "s8"])  # what the engine's XLA path runs
            record(**base, kernel="xla", us=round(timed(xla_product, ws, x, scale, 3) * 1e6, 2))
            if fmt == "int8":
                us = timed(lambda x, w, s: matmul(x, w, s, fmt=fmt, w_nk=True), ws, x, scale, 3) * 1e6
                record(**base, kernel="matmul", us=round(us, 2))
            ref = jnp.einsum("mk,nk->mn", x.astype(jnp.float32), as_8bit(ws[0], fmt).astype(jnp.float32),
                             precision="highest") * scale
            for (tile_m, tile_k, steps), splits in itertools.product([(64, 256, 2), (64, 256, 4), (64, 128, 4)],
                                                                      args.splits):
                if k % (tile_k * splits):
                    continue
                if time.perf_counter() - start > args.budget_s:
                    print("# budget spent", flush=True)
                    return 0
                cfg = dict(tile_m=tile_m, tile_k=tile_k, steps=steps, splits=splits)
                f = functools.partial(product, fmt=fmt, num_sms=num_sms, **cfg)
                try:
                    got = f(x, ws[0], scale).astype(jnp.float32)
                    us = timed(f, ws, x, scale, 3) * 1e6
                except Exception as e:  # a setting the kernel cannot take: say so and go on
                    print(f"# {name} {fmt} {cfg}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                relerr = float(jnp.max(jnp.abs(got - ref)) / jnp.max(jnp.abs(ref)))
                record(**base, kernel="mosaic-splitk", us=round(us, 2), relerr=relerr, **cfg)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
