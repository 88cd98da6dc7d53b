"""Per-layer time of the 8B layer's four fused one-row matvec calls, kernel variants alternating."""
import functools, json, os, sys, time
import jax, jax.numpy as jnp
import pallas_kernels.matvec as mv

D, F, NQKV = 4096, 14336, 6144
ORIG_CHAINED, ORIG_FN = mv._chained, mv.CHAINED


def chained2(acc, w, x, chunk, ptx):
    """two interleaved chains (even and odd positions), added at the end"""
    n, k = w.shape
    ws = jnp.split(w.reshape(n, k // chunk, chunk), chunk, axis=-1)
    xs = jnp.split(x.reshape(1, k // chunk, chunk), chunk, axis=-1)
    b = None
    for j, (wj, xj) in enumerate(zip(ws, xs)):
        wj = wj.reshape(n, k // chunk)
        xj = jnp.broadcast_to(xj.reshape(1, k // chunk), (n, k // chunk))
        if j % 2 == 0:
            acc = mv._fma(wj, xj, acc, ptx)
        else:
            b = wj * xj if b is None else mv._fma(wj, xj, b, ptx)
    return acc + b


from pallas_kernels.matvec import *  # noqa
from pallas_kernels.matvec import _to_f32


def _matvec_kernel_x2d(x_ref, w_ref, s_ref, *rest, m: int, block_k: int, fmt: str, native: bool, ptx: bool,
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
        return mv._chained(acc, w, x, chunk, ptx) if fmt in mv.CHAINED else acc + chunked(w * x)

    def step(i, carry):
        accs, squares = carry
        at = pl.multiple_of(i * block_k, block_k)
        ws = [_to_f32(w_ref[h, :, pl.ds(at, block_k)] if gated else w_ref[:, pl.ds(at, block_k)], fmt, native)
              for h in range(halves)]
        xs = [x_ref[pl.ds(r, 1), pl.ds(at, block_k)].astype(jnp.float32) for r in range(m)]
        if normed:  # squares by chunk, summed at the end; x scaled by the norm weight
            squares = tuple(sq + chunked(x * x) for sq, x in zip(squares, xs))
            g = norm_ref[pl.ds(at, block_k)].astype(jnp.float32)[None, :]
            xs = [x * g for x in xs]
        return tuple(summed(accs[r * halves + h], w, xs[r]) for r in range(m) for h, w in enumerate(ws)), squares

    zeros = (jnp.zeros((block_n, block_k // chunk), jnp.float32),) * (m * halves)
    accs, squares = lax.fori_loop(0, kk // block_k, step,
                                  (zeros, (jnp.zeros((1, block_k // chunk), jnp.float32),) * m if normed else ()))
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


ORIG_KERNEL = mv._matvec_kernel

VARIANTS = {
    "head": dict(),
    "fp8_chain": dict(chained=("int8", "fp8")),
    "chain2_both": dict(chained=("int8", "fp8"), fn=chained2),
    "int8_chain2": dict(fn=chained2),
    "x2d": dict(kernel=_matvec_kernel_x2d),
    "x2d_fp8_chain": dict(kernel=_matvec_kernel_x2d, chained=("int8", "fp8")),
    "warps8": dict(num_warps=8),
    "warps2": dict(num_warps=2),
}


def setv(v):
    mv.CHAINED = v.get("chained", ORIG_FN)
    mv._chained = v.get("fn", ORIG_CHAINED)
    mv._matvec_kernel = v.get("kernel", ORIG_KERNEL)
    jax.clear_caches()


def layers(fmt, count):
    key = jax.random.PRNGKey(0)
    lo, dt = (-127, jnp.int8) if fmt == "int8" else (0, jnp.uint8)
    out = []
    for i in range(count):
        ks = jax.random.split(jax.random.fold_in(key, i), 4)
        r = lambda k, s: jax.random.randint(k, s, lo, 127).astype(dt)
        if fmt == "fp8":  # keep e4m3 finite: clear exponent-all-ones-mantissa NaN patterns
            r = lambda k, s: (jax.random.randint(k, s, 0, 127) & 0x77).astype(dt)
        out.append(dict(qkv=r(ks[0], (NQKV, D)), o=r(ks[1], (D, D)), gu=r(ks[2], (2 * F, D)), down=r(ks[3], (D, F))))
    return out


def run(fmt, ls, nw, reps):
    sc = {n: jnp.full((s,), 1e-3, jnp.float32) for n, s in (("qkv", NQKV), ("o", D), ("gu", 2 * F), ("down", D))}
    g = jnp.ones((D,), jnp.bfloat16)
    f = functools.partial(mv.matvec, fmt=fmt, num_warps=nw)
    loops = 20

    def passes(ls, x):
        def one(i, x):
            for L in ls:
                q = f(x, L["qkv"], sc["qkv"], g, gated=False)
                h = f(q[:, :D], L["o"], sc["o"], residual=x)
                m = f(h, L["gu"], sc["gu"], g, gated=True)
                x = f(m, L["down"], sc["down"], residual=h)
            return x
        return jax.lax.fori_loop(0, loops, one, x)
    jf = jax.jit(passes)
    x = jax.random.normal(jax.random.PRNGKey(1), (1, D), jnp.bfloat16)
    jf(ls, x).block_until_ready()
    L = ls[0]
    out = jnp.concatenate([f(x, L["qkv"], sc["qkv"], g).ravel(), f(x, L["o"], sc["o"], residual=x).ravel(),
                           f(x, L["gu"], sc["gu"], g, gated=True).ravel(),
                           f(jnp.tile(x, (1, 4))[:, :F] * 0.1, L["down"], sc["down"], residual=x).ravel()])
    best = 1e9
    for _ in range(reps):
        t = time.perf_counter(); jf(ls, x).block_until_ready(); best = min(best, time.perf_counter() - t)
    return best / (loops * len(ls)) * 1e6, out


if __name__ == "__main__":
    interp = os.environ.get("INTERP")
    names = sys.argv[1:] or list(VARIANTS)
    for fmt in ("int8", "fp8"):
        ls = layers(fmt, 12)
        ref = None
        for rnd in range(2):
            for name in names:
                v = VARIANTS[name]
                setv(v)
                us, out = run(fmt, ls, v.get("num_warps", 4), 5)
                o = out.astype(jnp.float32)
                if ref is None:
                    ref = o
                diff = float(jnp.max(jnp.abs(o - ref)) / (jnp.max(jnp.abs(ref)) + 1e-9))
                print(json.dumps(dict(fmt=fmt, variant=name, round=rnd, us_per_layer=round(us, 2), rel_diff_vs_head=diff)), flush=True)
