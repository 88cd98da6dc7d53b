"""A mixture-of-experts router in two small kernels (Pallas, Triton lowering: ROCm and CUDA): the
logits h @ router in float32, then their softmax over the experts, the top k by repeated argmax,
and (when the model renormalizes) the chosen weights over their sum. XLA runs these as several
kernels a layer (the product, the softmax's reductions, top_k, the renormalization): on an H100 the
router of one Qwen3-30B-A3B token took 20.5 us a layer that way (docs/moe.md), for 0.5 MB of
weights. A first version did it all in one program per 16 rows, so one multiprocessor read the
whole router: 21.2 us. The product is spread over programs first.

  h        [m, d]   the normed tokens
  router   [d, E]   h's dtype
  -> weights [m, k] float32, experts [m, k] int32, in lax.top_k's order: largest first, and of
     equal probabilities the lower expert first

1. router_logits, grid (m, E / columns, splits): program (i, j, s) sums row i's products with
   `columns` experts over the s-th of `splits` equal parts of d, block_k rows of the router at a
   time (a multiply and a sum over the block_k rows: no tensor-core tile, whose 16 rows would
   carry one real row), into float32 partial logits [splits, m, E].
2. router_choose, grid (m,): row i's partials summed in split order, then the softmax and the top
   k, in one warp (its reductions stay within the warp).

One row a program: nothing is padded to a block of rows, and every sum's order is fixed by d,
block_k and splits (the router's shape), never by the rows: a row's choice is the same alone or
among others. (The version before ran 16-row tensor-core dots; on an H100 its two kernels took
4.8 us each a layer for one token, docs/moe.md.) E is padded to a power of two (at least 16) with
columns that take no probability; k to a power of two, its padding sliced off.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.matmul import _largest_pow2_divisor

DEFAULT_BLOCK_K = 128
DEFAULT_COLUMNS = 16  # experts per program of the product
# Programs the product is spread over, per row, where d allows: Qwen3-30B-A3B's router (2048 x 128)
# in 64 parts of 8 KB (8 column blocks x 8 parts of d, each one block_k step), Mixtral's (4096 x 8,
# padded to 16 columns) in 32 parts of d. A power of two, as columns and the padded E are, so the
# parts of d it asks for are one too. On an H100 (2026-12-07, 16-row dots, moe_costs.py) 64
# programs ran one token's router op in 22.3 us against 25.1 for 16 and 24.6 for 1.
PRODUCT_PROGRAMS = 64


def _pow2_at_least(n: int, least: int = 1) -> int:
    return max(least, 1 << (n - 1).bit_length())


@functools.partial(jax.jit, static_argnames=("k", "normalize", "block_k", "columns", "splits", "num_warps",
                                             "num_stages", "interpret"))
def router_topk(h, router, *, k: int, normalize: bool, block_k: int | None = None, columns: int | None = None,
                splits: int | None = None, num_warps: int = 4, num_stages: int = 3, interpret: bool = False):
    """(weights [m, k] float32, experts [m, k] int32): see the module docstring. normalize: the
    chosen weights divided by their sum (Qwen3-MoE's norm_topk_prob; Mixtral's softmax over its
    chosen logits is the same). block_k: the tile down d (None: the largest power of two up to
    128 that divides d). columns: experts per product program (None: 16; rounded up to a power
    of two of at least 16, at most E padded; they change no sum's order). splits: the parts of
    d summed apart (a power of two dividing d / block_k; None: enough for PRODUCT_PROGRAMS
    programs). block_k and splits fix every sum's order, so they follow the router's shape."""
    m, d = h.shape
    if router.ndim != 2 or router.shape[0] != d:
        raise ValueError(f"router_topk router must be [d={d}, E]; got {list(router.shape)}")
    e = router.shape[1]
    if not 1 <= k <= e:
        raise ValueError(f"router_topk k must be between 1 and the expert count {e}; got {k}")
    if router.dtype != h.dtype:
        raise ValueError(f"router_topk router must be h's dtype {h.dtype}; got {router.dtype}")
    block_k = _largest_pow2_divisor(d, block_k or DEFAULT_BLOCK_K, "d")
    ep, kp = _pow2_at_least(e, 16), _pow2_at_least(k)
    columns = min(ep, _pow2_at_least(columns or DEFAULT_COLUMNS, 16))
    steps = d // block_k
    if splits is None:
        # (steps & -steps: the largest power of two dividing steps)
        splits = min(max(1, PRODUCT_PROGRAMS * columns // ep), steps & -steps)
    elif splits < 1 or splits & (splits - 1) or steps % splits:
        raise ValueError(f"router_topk splits must be a power of two dividing d / block_k = {steps}; got {splits}")
    router = jnp.pad(router, ((0, 0), (0, ep - e)))
    part = d // splits
    partial = pl.pallas_call(
        functools.partial(_logits_kernel, block_k=block_k),
        grid=(m, ep // columns, splits),
        in_specs=[pl.BlockSpec((1, part), lambda i, j, s: (i, s)),
                  pl.BlockSpec((part, columns), lambda i, j, s: (s, j))],
        out_specs=pl.BlockSpec((1, columns), lambda i, j, s: (s * m + i, j)),
        out_shape=jax.ShapeDtypeStruct((splits * m, ep), jnp.float32),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="router_logits",
    )(h, router)
    weights, experts = pl.pallas_call(
        functools.partial(_choose_kernel, experts=e, k=k, normalize=normalize),
        grid=(m,),
        in_specs=[pl.BlockSpec((splits, 1, ep), lambda i: (0, i, 0))],
        out_specs=[pl.BlockSpec((1, kp), lambda i: (i, 0))] * 2,
        out_shape=[jax.ShapeDtypeStruct((m, kp), jnp.float32), jax.ShapeDtypeStruct((m, kp), jnp.int32)],
        compiler_params=plt.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
        name="router_choose",
    )(partial.reshape(splits, m, ep))
    return weights[:, :k], experts[:, :k]


def _logits_kernel(h_ref, r_ref, o_ref, *, block_k: int):
    def step(i, acc):  # [block_k] x [block_k, columns]: products summed down the block
        at = pl.multiple_of(i * block_k, block_k)
        x = h_ref[0, pl.ds(at, block_k)].astype(jnp.float32)
        return acc + jnp.sum(x[:, None] * r_ref[pl.ds(at, block_k), :].astype(jnp.float32), axis=0)

    acc = lax.fori_loop(0, h_ref.shape[1] // block_k, step, jnp.zeros(o_ref.shape[1:], jnp.float32))
    o_ref[...] = acc[None, :]


def _choose_kernel(p_ref, w_ref, x_ref, *, experts: int, k: int, normalize: bool):
    splits, rows, ep = p_ref.shape
    logits = p_ref[0]
    for s in range(1, splits):  # in split order
        logits = logits + p_ref[s]
    col = lax.broadcasted_iota(jnp.int32, (rows, ep), 1)
    logits = jnp.where(col < experts, logits, -jnp.inf)  # the padding columns: no probability
    p = jnp.exp(logits - jnp.max(logits, axis=1, keepdims=True))
    probs = p / jnp.sum(p, axis=1, keepdims=True)
    slot = lax.broadcasted_iota(jnp.int32, (rows, w_ref.shape[1]), 1)
    weights = jnp.zeros(slot.shape, jnp.float32)
    chosen = jnp.zeros(slot.shape, jnp.int32)
    for j in range(k):  # the largest left, the lower expert of equals (argmax's rule, as lax.top_k's)
        best = jnp.argmax(probs, axis=1).astype(jnp.int32)
        weights = jnp.where(slot == j, jnp.max(probs, axis=1)[:, None], weights)
        chosen = jnp.where(slot == j, best[:, None], chosen)
        probs = jnp.where(col == best[:, None], -1.0, probs)  # probabilities are >= 0: never again
    if normalize:
        weights = weights / jnp.sum(weights, axis=1, keepdims=True)  # (the padding slots hold 0)
    w_ref[...] = weights
    x_ref[...] = chosen


def router_topk_reference(h, router, *, k: int, normalize: bool):
    """Plain-JAX float32 reference, written independently of the kernel."""
    logits = jnp.dot(h.astype(jnp.float32), router.astype(jnp.float32), precision=lax.Precision.HIGHEST)
    weights, experts = lax.top_k(jax.nn.softmax(logits, axis=-1), k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts
