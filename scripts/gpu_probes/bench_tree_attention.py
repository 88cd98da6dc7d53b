#!/usr/bin/env python3
"""GPU benchmark of the Pallas tree-attention kernel against the XLA path, with the memory floor.

Shapes of an 8B-class target layer (32 query heads, 8 kv heads, head dim 128, bf16). For each
(batch, prefix, tree nodes): check the kernel against the float32 reference, time its default
tiling (what the engine runs) and a sweep of neighbouring tilings (the best is reported beside
it), time the XLA path (the engine's masked einsum attention), and compute the floor = bytes of
K/V, q and out / measured copy bandwidth. --compare times another version of the kernel file.

Timing: one jitted fori_loop runs the op on 8 distinct input sets per iteration (so K/V do not
sit in L2), each call fed by the loop carry so nothing is hoisted; the same loop with the op
replaced by a read of q is subtracted. Median of several runs. Needs a GPU (--interpret runs
the script's logic on a CPU, with meaningless times).

    python scripts/gpu_probes/bench_tree_attention.py [--quick | --shapes 1x8192x16,...] [--no-sweep]
        [--compare OLD/tree_attention.py] [--json OUT]
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import math
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.decoding.trees import ancestor_mask, balanced_tree, chain
from pallas_kernels.tree_attention import (
    BLOCK_K,
    tiling,
    tree_attention,
    tree_attention_reference,
)

H, N, D = 32, 8, 128
SETS = 8


def xla_tree_attention(q, k_cache, v_cache, tree_k, tree_v, lengths, tree_mask):
    """The XLA path as the engine runs it: bf16 einsums, float32 softmax over prefix + tree."""
    b, t, h, d = q.shape
    n = k_cache.shape[2]
    qg = q.reshape(b, t, n, h // n, d)
    s_prefix = jnp.einsum("btngd,bsnd->bngts", qg, k_cache, preferred_element_type=jnp.float32)
    s_tree = jnp.einsum("btngd,bsnd->bngts", qg, tree_k, preferred_element_type=jnp.float32)
    prefix_ok = (jnp.arange(k_cache.shape[1])[None, :] < lengths[:, None])[:, None, None, None, :]
    s = jnp.concatenate([jnp.where(prefix_ok, s_prefix, -jnp.inf), jnp.where(tree_mask != 0, s_tree, -jnp.inf)], -1)
    p = jax.nn.softmax(s / math.sqrt(d), axis=-1).astype(q.dtype)
    s_len = k_cache.shape[1]
    out = jnp.einsum("bngts,bsnd->btngd", p[..., :s_len], v_cache) + jnp.einsum(
        "bngts,bsnd->btngd", p[..., s_len:], tree_v)
    return out.reshape(b, t, h, d)


def loop_seconds(op, sets, iters: int) -> float:
    """Wall time of one jitted loop calling op on every set per iteration; op=None times the same
    loop with the call replaced by a read of q (the baseline). Each call's q depends on the loop
    carry, so nothing is hoisted; the baseline reads every q too (one small fusion per set, as
    the q = q + carry fusion costs the timed loop), so neither side is charged for the other."""

    @jax.jit
    def run(sets):
        def body(_, acc):
            for q, *rest in sets:
                q = q + (acc * 0).astype(q.dtype)
                value = jnp.sum(q) if op is None else op(q, *rest)[0, 0, 0, 0]
                acc = acc + value.astype(jnp.float32)
            return acc

        return jax.lax.fori_loop(0, iters, body, jnp.zeros((), jnp.float32))

    return median_seconds(run, sets)


def median_seconds(fn, *args, runs: int = 5) -> float:
    """Median wall time of fn(*args) after one warm-up call, waiting for the device each time."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth() -> float:
    x = jnp.ones((1 << (31 if jax.default_backend() == "gpu" else 26),), jnp.bfloat16)  # 4 GiB on a GPU
    return 2 * x.nbytes / median_seconds(jax.jit(lambda a: a * 1), x)


def sweep(b: int, s: int, t: int) -> list[dict]:
    """The default tiling first (what the engine runs), then its neighbours: half and twice the
    splits, shallower and deeper software pipelining, a longer key step, 8 warps, and 128 query
    rows per program where the heads allow it (larger matrix tiles for the compute-bound
    many-node shapes)."""
    _, gb, splits, _ = tiling(b, t, H, N, s)
    configs = [{}, dict(num_stages=2), dict(num_stages=4), dict(block_k=128), dict(num_warps=8)]
    configs += [dict(num_splits=x) for x in (splits // 2, splits * 2) if x >= 1 and (s // BLOCK_K) % x == 0]
    if tiling(b, t, H, N, s, block_rows=128)[1] > gb:
        configs += [dict(block_rows=128, num_warps=w) for w in (4, 8)]
    return configs


def describe(cfg: dict, b: int, s: int, t: int) -> str:
    keys = ("block_rows", "num_splits", "block_k", "target_programs")
    _, gb, splits, step = tiling(b, t, H, N, s, **{k: v for k, v in cfg.items() if k in keys})
    extra = "".join(f", {k} {v}" for k, v in cfg.items() if k not in keys)
    return f"{splits} splits, {gb} heads/program, {step} keys/step{extra}"


def load_module(path: str):
    spec = importlib.util.spec_from_file_location("compare_kernel", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a few shapes only")
    p.add_argument("--shapes", help="comma-separated BATCHxPREFIXxNODES to run instead of the default grid")
    p.add_argument("--no-sweep", action="store_true", help="time the default tiling only")
    p.add_argument("--compare", help="another version of tree_attention.py to time beside this one")
    p.add_argument("--json", help="write all results here")
    p.add_argument("--interpret", action="store_true", help="Pallas interpret mode: a CPU smoke run of this script")
    args = p.parse_args()

    print(f"jax {jax.__version__}, devices {[d.device_kind for d in jax.devices()]}", flush=True)
    bw = copy_bandwidth()
    print(f"measured bandwidth (x*1 over 4 GiB, read+write): {bw / 1e12:.2f} TB/s", flush=True)
    shapes = [(1, s, t) for s in (512, 2048, 8192) for t in (8, 16, 64)]
    shapes += [(4, 2048, 16), (16, 2048, 16), (16, 8192, 16), (16, 2048, 64), (16, 8192, 64)]
    if args.quick:
        shapes = [(1, 2048, 16), (16, 2048, 16)]
    if args.shapes:
        shapes = [tuple(int(x) for x in item.split("x")) for item in args.shapes.split(",")]
    other = load_module(args.compare).tree_attention if args.compare else None
    rng = np.random.default_rng(0)
    rows = []
    print("| batch | prefix | nodes | floor us | kernel us | kernel/floor | XLA us | XLA/kernel | best us | best tiling"
          + (" | compared us" if other else "") + " | rel err |")
    print("| --- " * (11 + bool(other)) + "|", flush=True)
    for b, s, t in shapes:
        parents = chain(t - 1) if t <= 8 else balanced_tree(2, 6)[:t]
        mask = jnp.asarray(ancestor_mask(parents), jnp.int32)  # the engine's mask is a constant
        lengths = jnp.full((b,), s, jnp.int32)
        sets = []
        for _ in range(SETS):
            f = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.bfloat16)  # noqa: E731
            sets.append((f(b, t, H, D), f(b, s, N, D), f(b, s, N, D), f(b, t, N, D), f(b, t, N, D), lengths, mask))
        ref = tree_attention_reference(*sets[0][:-1], mask != 0)
        kv_bytes = 2 * b * s * N * D * 2 + 2 * b * t * N * D * 2
        io_bytes = 2 * b * t * H * D * 2
        floor = (kv_bytes + io_bytes) / bw
        iters = max(2, int(2e-3 / max(floor, 1e-6)) // SETS)
        baseline = loop_seconds(None, sets, iters)  # the same for every op on these inputs

        def timed(op) -> float:
            """Seconds per op call, loop overhead subtracted."""
            return (loop_seconds(op, sets, iters) - baseline) / (iters * SETS)

        def measure(fn):
            out = fn(*sets[0])
            err = float(jnp.linalg.norm(out.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))
            assert err < 1e-2 and bool(jnp.all(jnp.isfinite(out))), f"kernel wrong: rel err {err}"
            return timed(fn), err

        timings = []
        for cfg in [{}] if args.no_sweep else sweep(b, s, t):
            try:
                sec, err = measure(lambda *a, cfg=cfg: tree_attention(*a, **cfg, interpret=args.interpret))
            except Exception as e:  # a tiling the compiler refuses: report, try the next
                print(f"  tiling {cfg} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            timings.append(dict(config=cfg, tiling=describe(cfg, b, s, t), us=sec * 1e6, rel_err=err))
        default = timings[0] if timings and timings[0]["config"] == {} else None
        if default is None:
            raise SystemExit(f"the default tiling failed for batch {b}, prefix {s}, nodes {t}")
        best = min(timings, key=lambda r: r["us"])
        xla = timed(xla_tree_attention) * 1e6
        row = dict(batch=b, prefix=s, nodes=t, floor_us=floor * 1e6, kernel_us=default["us"],
                   tiling=default["tiling"], xla_us=xla, best=best, sweep=timings, rel_err=default["rel_err"])
        cells = [b, s, t, f"{floor * 1e6:.1f}", f"{default['us']:.1f}", f"{default['us'] / (floor * 1e6):.2f}",
                 f"{xla:.1f}", f"{xla / default['us']:.2f}", f"{best['us']:.1f}", best["tiling"]]
        if other:
            row["compared_us"] = measure(functools.partial(other, interpret=args.interpret))[0] * 1e6
            cells.append(f"{row['compared_us']:.1f}")
        cells.append(f"{default['rel_err']:.1e}")
        rows.append(row)
        print("| " + " | ".join(str(c) for c in cells) + " |", flush=True)
        if args.json:  # after every row, so a run cut short keeps what it measured
            with open(args.json, "w") as f:
                json.dump({"bandwidth_Bps": bw, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
