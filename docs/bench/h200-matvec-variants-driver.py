"""Per-layer time of the 8B layer's four fused one-row matvec calls, kernel variants alternating."""
import functools, inspect, json, sys
import jax, jax.numpy as jnp
import pallas_kernels.matvec as mv
from jaxspec.bench.common import best_seconds

D, F, NQKV = 4096, 14336, 6144
ORIG_CHAINED_FN, ORIG_CHAINED_FORMATS = mv._chained, mv.CHAINED


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


def _kernel_x2d():
    """matvec's kernel with each row of activations loaded as a [1, block_k] tile (the weights'
    layout) instead of a [block_k] vector: derived from the kernel's own source, so the two can
    differ only there."""
    src = inspect.getsource(mv._matvec_kernel).replace("def _matvec_kernel(", "def _matvec_kernel_x2d(")
    for old, new in (
        ("x_ref[r, pl.ds(at, block_k)]", "x_ref[pl.ds(r, 1), pl.ds(at, block_k)]"),
        ("norm_ref[pl.ds(at, block_k)].astype(jnp.float32)", "norm_ref[pl.ds(at, block_k)].astype(jnp.float32)[None, :]"),
        ("acc + chunked(w * x[None, :])", "acc + chunked(w * x)"),
        ("(jnp.zeros((block_k // chunk,), jnp.float32),) * m", "(jnp.zeros((1, block_k // chunk), jnp.float32),) * m"),
    ):
        assert src.count(old) == 1, old
        src = src.replace(old, new)
    # CHAINED and _chained read from mv at trace time, so the variants' patches reach this copy too
    src = src.replace("fmt in CHAINED", "fmt in mv.CHAINED").replace(" _chained(", " mv._chained(")
    scope = {**vars(mv), "mv": mv}  # the kernel's own globals
    exec(src, scope)
    return scope["_matvec_kernel_x2d"]


ORIG_KERNEL = mv._matvec_kernel

VARIANTS = {
    "head": dict(),
    "fp8_chain": dict(chained=("int8", "fp8")),
    "chain2_both": dict(chained=("int8", "fp8"), fn=chained2),
    "int8_chain2": dict(fn=chained2),
    "x2d": dict(kernel=_kernel_x2d()),
    "x2d_fp8_chain": dict(kernel=_kernel_x2d(), chained=("int8", "fp8")),
    "warps8": dict(num_warps=8),
    "warps2": dict(num_warps=2),
}


def setv(v):
    mv.CHAINED = v.get("chained", ORIG_CHAINED_FORMATS)
    mv._chained = v.get("fn", ORIG_CHAINED_FN)
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
    L = ls[0]
    out = jnp.concatenate([f(x, L["qkv"], sc["qkv"], g).ravel(), f(x, L["o"], sc["o"], residual=x).ravel(),
                           f(x, L["gu"], sc["gu"], g, gated=True).ravel(),
                           f(jnp.tile(x, (1, 4))[:, :F] * 0.1, L["down"], sc["down"], residual=x).ravel()])
    best = best_seconds(lambda: jf(ls, x).block_until_ready(), reps)  # warms up first
    return best / (loops * len(ls)) * 1e6, out


if __name__ == "__main__":
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
