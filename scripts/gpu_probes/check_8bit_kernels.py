#!/usr/bin/env python3
"""On a GPU: the 8-bit kernels as compiled there (default tiles, channels-first weights) against
the float32 reference at the 8B shape's projections and LM head. matvec (one row's kernel) at
1 and 3 rows with float32 output, the matmul kernel at 1, 3 and 16 rows in bf16; then both with
each projection's fusions (pallas_kernels/fused.py: the norm before q/k/v, gate/up and the LM
head (matvec only), the gated product, the residual after o and down) against fused_reference. Prints
the relative error (max abs error / max abs value) of each; exits 1 if any is over its bound.

    python3 scripts/gpu_probes/check_8bit_kernels.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.matmul import fused_reference, matmul, matmul_reference
from pallas_kernels.matvec import matvec

SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096), (4096, 128256)]  # (k, n)
BOUND = {jnp.float32: 1e-5, jnp.bfloat16: 8e-3}  # float32 sums in another order; one bf16 rounding
# (k, n, fusions, output dtype) of each 8B projection as a decode step fuses it (n: gate and up's 2f).
FUSED = [(4096, 6144, "norm", jnp.bfloat16), (4096, 4096, "residual", jnp.bfloat16),
         (4096, 2 * 14336, "norm+gated", jnp.bfloat16), (14336, 4096, "residual", jnp.bfloat16),
         (4096, 128256, "norm", jnp.float32)]
FUSED_BOUND = {jnp.float32: 1e-5, jnp.bfloat16: 1.6e-2}  # bf16: gate, up, silu and the product each rounded


def _weights(k, n, fmt):
    key = jax.random.PRNGKey(k + n)
    w = jax.random.randint(key, (n, k), -127 if fmt == "int8" else 0, 127)
    w = w.astype(jnp.int8) if fmt == "int8" else jnp.where((w & 0x7F) == 0x7F, 0, w).astype(jnp.uint8)
    return w, jax.random.uniform(key, (n,), jnp.float32, 1e-3, 1e-2)


def check_fused() -> int:
    bad = 0
    for k, n, fusions, out_dtype in FUSED:
        for fmt in ("int8", "fp8"):
            w, s = _weights(k, n, fmt)
            gated = "gated" in fusions
            norm = jax.random.uniform(jax.random.PRNGKey(1), (k,), jnp.float32, 0.5, 1.5).astype(jnp.bfloat16)
            for rows in (1, 3, 16):
                x = jax.random.normal(jax.random.PRNGKey(rows), (rows, k), jnp.bfloat16)
                kw = dict(gated=gated, residual=jax.random.normal(jax.random.PRNGKey(7), (rows, n // (1 + gated)),
                                                                  jnp.bfloat16) if "residual" in fusions else None)
                outs = {"matmul": (fused_reference(x, w, s, fmt, **kw),
                                   matmul(x, w, s, fmt=fmt, w_nk=True, out_dtype=out_dtype, **kw))}
                if rows <= 4:
                    kw["norm"] = norm if "norm" in fusions else None
                    outs["matvec"] = (fused_reference(x, w, s, fmt, **kw),
                                      matvec(x, w, s, fmt=fmt, out_dtype=out_dtype, **kw))
                for name, (want, got) in outs.items():
                    want = np.asarray(want)
                    err = np.abs(np.asarray(got.astype(jnp.float32)) - want).max() / np.abs(want).max()
                    ok = err <= FUSED_BOUND[got.dtype.type]
                    bad += not ok
                    print(f"k={k} n={n} {fmt} {fusions} rows={rows} {name} ({got.dtype}): rel err {err:.2e} "
                          f"{'ok' if ok else 'OVER ' + str(FUSED_BOUND[got.dtype.type])}", flush=True)
    return bad


def main() -> int:
    worst = 0.0
    bad = 0
    for k, n in SHAPES:
        for fmt in ("int8", "fp8"):
            w, s = _weights(k, n, fmt)
            for rows in (1, 3, 16):
                x = jax.random.normal(jax.random.PRNGKey(rows), (rows, k), jnp.bfloat16)
                want = np.asarray(matmul_reference(x, w.T, s, fmt))
                outs = {"matmul": matmul(x, w, s, fmt=fmt, w_nk=True)}
                if rows <= 4:
                    outs["matvec"] = matvec(x, w, s, fmt=fmt, out_dtype=jnp.float32)
                for name, got in outs.items():
                    err = np.abs(np.asarray(got.astype(jnp.float32)) - want).max() / np.abs(want).max()
                    ok = err <= BOUND[got.dtype.type]
                    bad += not ok
                    worst = max(worst, err)
                    print(f"k={k} n={n} {fmt} rows={rows} {name} ({got.dtype}): rel err {err:.2e} "
                          f"{'ok' if ok else 'OVER ' + str(BOUND[got.dtype.type])}", flush=True)
    bad += check_fused()
    print(f"# {jax.devices()[0].device_kind}: {bad} over their bounds")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
