"""What the 8-bit kernels (matmul.py, matvec.py) can fuse around a projection, so a decode step
does not launch a kernel for each: XLA fuses these into its own GEMMs for bf16 weights, but a
Pallas call takes no producers or consumers (issue 26: 97 such launches an 8B step).

- norm (prologue; matvec only): out = rms_norm(x, norm) @ w, computed as ((x * norm) @ w) / rms(x):
  x is scaled by the norm weight as it is loaded, each row's sum of squares comes from the same
  loads and the row's 1/rms scales the sums in the epilogue (the RMS norm before q/k/v, gate/up
  and the LM head). In the matmul kernel, whose x tiles feed tensor-core dots, it made the 8B
  int8 step 1.6x slower (H200: 4.78 against 2.92 ms; as it had the bf16 projections).
- gated (epilogue): w holds gate and up ([2, n, k]); out = silu(x @ gate) * (x @ up), the gated
  MLP's product (one kernel in place of gate/up, then the multiply).
- residual (epilogue): out = residual + x @ w (the o and down projections' residual adds).

Each rounds as the unfused graph does (projections to out_dtype, then silu, the product and
the sum each rounded to out_dtype), except the norm: its float32 1/rms multiplies float32 sums
where the unfused graph rounds the normalised x to out_dtype first. So a fused step is close to,
not bit-equal with, an unfused one: the default mode's accelerator path only, never
deterministic mode (docs/deterministic.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def inverse_rms(squares, k: int, eps: float):
    """1/rms of rows from their float32 sums of squares over k values."""
    return lax.rsqrt(squares / k + eps)


def finish(y, out_dtype, up=None, residual=None):
    """The fused epilogue of scaled float32 sums y (the gate's, with up): see the module docstring."""
    f32 = jnp.float32
    y = y.astype(out_dtype)
    if up is not None:
        g = y.astype(f32)
        y = (g * jax.nn.sigmoid(g)).astype(out_dtype)  # silu, rounded
        y = (y.astype(f32) * up.astype(out_dtype).astype(f32)).astype(out_dtype)
    if residual is not None:
        y = (y.astype(f32) + residual.astype(f32)).astype(out_dtype)
    return y


def combine_partials(partials, scale, out_dtype, residual=None):
    """Split-k float32 partials [splits, m, n] (gated: [splits, 2, m, n]) added in a fixed order
    (an unrolled chain XLA keeps), then the scale [n] (gated: [2, n]; None: unscaled) and the
    epilogue."""
    total = partials[0]
    for p in range(1, partials.shape[0]):
        total = total + partials[p]
    if scale is not None:
        total = total * scale[..., None, :]
    if total.ndim == 3:  # gated: [2, m, n]
        return finish(total[0], out_dtype, up=total[1], residual=residual)
    return finish(total, out_dtype, residual=residual)


def check_fusions(m: int, k: int, n: int, norm, residual, gated: bool, w_nk: bool, kernel: str) -> tuple:
    """The fusion operands given (norm, residual), checked by name."""
    if (residual is not None or gated) and not w_nk:  # (matvec, the only one with a norm, is always [n, k])
        raise ValueError(f"{kernel} fuses residual and gated with w as [n, k] (w_nk) only")
    if norm is not None and norm.shape != (k,):
        raise ValueError(f"{kernel} norm must be [k={k}]; got {list(norm.shape)}")
    if gated and n % 2:
        raise ValueError(f"{kernel} gated w must hold gate and up: an even number of rows; got {n}")
    n_out = n // 2 if gated else n
    if residual is not None and residual.shape != (m, n_out):
        raise ValueError(f"{kernel} residual must be [m={m}, n={n_out}]; got {list(residual.shape)}")
    return tuple(f for f in (norm, residual) if f is not None)


def given(operands, *optional):
    """The optional operands in their places (None where not given) from those given, in order."""
    it = iter(operands)
    return [None if o is None else next(it) for o in optional]
