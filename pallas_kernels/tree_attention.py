"""Fused tree-attention verification kernel (Pallas, Triton lowering: runs on ROCm and CUDA).

Computes, for the t tree nodes of each row, attention over
  * the row's committed KV prefix: cache slots [0, lengths[b]), and
  * the tree's own keys, each node seeing only its ancestors and itself (`tree_mask`),
in one pass with an online softmax, GQA (the g query heads of one kv head share each K/V load),
bf16 or float32 inputs and float32 accumulation.

Layout:
  q        [b, t, h, d]   tree queries (RoPE applied), h = n * g
  k_cache  [b, s, n, d]   one layer of the KV cache (slots past lengths[b] are ignored)
  v_cache  [b, s, n, d]
  tree_k   [b, t, n, d]   the tree nodes' own keys / values
  tree_v   [b, t, n, d]
  lengths  [b] int32      committed prefix length per row (0 allowed)
  tree_mask [t, t] bool   tree_mask[i, j]: node i may attend to node j (ancestor or self)
  -> out   [b, t, h, d]   in q's dtype

Grid: (b, n, row blocks, prefix splits). The query rows of one kv head are its g heads times t
nodes; they are tiled into blocks of `block_rows`. The prefix is split across programs
(flash-decoding) so that a batch-1 call still fills the GPU; each program keeps a partial
(max, sum, acc) and the splits are merged afterwards. Split 0 also folds in the tree block.

Backend notes (DESIGN.md): only the Triton lowering runs on ROCm, so compiler_params are always
plt.CompilerParams; Triton wants power-of-two blocks and dot tiles >= 16 (rows, tree nodes and
blocks are padded); MI300 has 64 KB of shared memory per CU, hence block_k 64 and 1-2 stages.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

NEG = -1e30  # finite "minus infinity": fully masked blocks stay NaN-free
BLOCK_K = 64  # prefix keys per inner step; callers size caches to a multiple of it


def _pow2(n: int, minimum: int = 16) -> int:
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())


def _dot(a, b, contract_b: int):
    """a [M, K] . b (contracting b's axis `contract_b`) -> float32. HIGHEST precision: IEEE
    float32 for f32 inputs (Triton would use tf32), plain bf16 x bf16 -> f32 otherwise.
    (pl.dot is gone from JAX 0.12; lax.dot_general lowers on every supported version.)"""
    dims = (((1,), (contract_b,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def _kernel(
    lengths_ref, q_ref, k_ref, v_ref, tk_ref, tv_ref, mask_ref,  # inputs
    o_ref, l_ref, m_ref,  # outputs: partial accumulators of this split
    *, scale: float, block_k: int, split_len: int,
):
    split = pl.program_id(3)
    length = lengths_ref[0]
    q = q_ref[...]  # [R, d]
    rows = q.shape[0]
    start = split * split_len

    def attend(keys, values, valid, carry):
        acc, m, l = carry
        s = _dot(q, keys, contract_b=1) * scale  # [R, K]
        s = jnp.where(valid, s, NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.exp(s - m_new[:, None])
        correction = jnp.exp(m - m_new)
        l = l * correction + jnp.sum(p, axis=1)
        pv = _dot(p.astype(values.dtype), values, contract_b=0)
        acc = acc * correction[:, None] + pv
        return acc, m_new, l

    def prefix_block(i, carry):
        offset = i * block_k
        keys = k_ref[pl.ds(offset, block_k), :]
        values = v_ref[pl.ds(offset, block_k), :]
        slots = start + offset + jnp.arange(block_k)
        return attend(keys, values, (slots < length)[None, :], carry)

    carry = (
        jnp.zeros((rows, q.shape[1]), jnp.float32),
        jnp.full((rows,), NEG, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )
    num_blocks = jnp.clip(pl.cdiv(length - start, block_k), 0, split_len // block_k)
    carry = lax.fori_loop(0, num_blocks, prefix_block, carry)
    carry = lax.cond(
        split == 0,
        lambda c: attend(tk_ref[...], tv_ref[...], mask_ref[...] != 0, c),
        lambda c: c,
        carry,
    )
    acc, m, l = carry
    o_ref[...] = acc
    l_ref[...] = l
    m_ref[...] = m


def _choose_splits(programs: int, prefix_blocks: int, target_programs: int) -> int:
    """Largest power-of-two split count <= what fills ~target_programs, dividing the blocks."""
    want = max(1, target_programs // max(programs, 1))
    splits = 1
    while splits * 2 <= want and prefix_blocks % (splits * 2) == 0:
        splits *= 2
    return splits


@functools.partial(
    jax.jit,
    static_argnames=("block_k", "block_rows", "num_splits", "num_warps", "num_stages", "interpret", "target_programs"),
)
def tree_attention(
    q, k_cache, v_cache, tree_k, tree_v, lengths, tree_mask, *,
    block_k: int = BLOCK_K, block_rows: int = 64, num_splits: int | None = None,
    num_warps: int = 4, num_stages: int = 2, interpret: bool = False, target_programs: int = 512,
):
    """Tree attention; see the module docstring for shapes. The cache length s must be a
    multiple of block_k (the engine sizes its cache so)."""
    b, t, h, d = q.shape
    s, n = k_cache.shape[1], k_cache.shape[2]
    g = h // n
    if s % block_k:
        raise ValueError(f"cache length {s} must be a multiple of block_k={block_k}")
    tb = _pow2(t)
    rows = g * t
    block_rows = min(block_rows, _pow2(rows))
    rows_padded = pl.cdiv(rows, block_rows) * block_rows
    row_blocks = rows_padded // block_rows
    splits = num_splits or _choose_splits(b * n * row_blocks, s // block_k, target_programs)
    if (s // block_k) % splits:
        raise ValueError(f"num_splits={splits} must divide the {s // block_k} prefix blocks")
    split_len = s // splits

    # Query rows of kv head n: row r = head-in-group * t + node.
    qr = q.reshape(b, t, n, g, d).transpose(0, 2, 3, 1, 4).reshape(b, n, rows, d)
    qr = jnp.pad(qr, ((0, 0), (0, 0), (0, rows_padded - rows), (0, 0)))
    pad_t = ((0, 0), (0, tb - t), (0, 0), (0, 0))
    tk, tv = jnp.pad(tree_k, pad_t), jnp.pad(tree_v, pad_t)
    node_of_row = jnp.arange(rows_padded) % t
    row_mask = jnp.pad(tree_mask.astype(jnp.int32), ((0, 0), (0, tb - t)))[node_of_row]
    row_mask = jnp.where((jnp.arange(rows_padded) < rows)[:, None], row_mask, 0)

    kernel = functools.partial(_kernel, scale=1.0 / math.sqrt(d), block_k=block_k, split_len=split_len)
    grid = (b, n, row_blocks, splits)
    o, l, m = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[
            pl.BlockSpec((1,), lambda bi, ni, ri, si: (bi,)),
            pl.BlockSpec((None, None, block_rows, d), lambda bi, ni, ri, si: (bi, ni, ri, 0)),
            pl.BlockSpec((None, split_len, None, d), lambda bi, ni, ri, si: (bi, si, ni, 0)),
            pl.BlockSpec((None, split_len, None, d), lambda bi, ni, ri, si: (bi, si, ni, 0)),
            pl.BlockSpec((None, tb, None, d), lambda bi, ni, ri, si: (bi, 0, ni, 0)),
            pl.BlockSpec((None, tb, None, d), lambda bi, ni, ri, si: (bi, 0, ni, 0)),
            pl.BlockSpec((block_rows, tb), lambda bi, ni, ri, si: (ri, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, block_rows, d), lambda bi, ni, ri, si: (bi, ni, si, ri, 0)),
            pl.BlockSpec((None, None, None, block_rows), lambda bi, ni, ri, si: (bi, ni, si, ri)),
            pl.BlockSpec((None, None, None, block_rows), lambda bi, ni, ri, si: (bi, ni, si, ri)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, n, splits, rows_padded, d), jnp.float32),
            jax.ShapeDtypeStruct((b, n, splits, rows_padded), jnp.float32),
            jax.ShapeDtypeStruct((b, n, splits, rows_padded), jnp.float32),
        ],
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="tree_attention",
    )(lengths.astype(jnp.int32), qr, k_cache, v_cache, tk, tv, row_mask)

    # Merge the splits' partial softmaxes.
    m_max = jnp.max(m, axis=2, keepdims=True)
    w = jnp.exp(m - m_max)  # [b, n, splits, R]
    out = jnp.sum(o * w[..., None], axis=2) / jnp.sum(l * w, axis=2)[..., None]
    out = out[:, :, :rows].reshape(b, n, g, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, h, d)
    return out.astype(q.dtype)


def tree_attention_reference(q, k_cache, v_cache, tree_k, tree_v, lengths, tree_mask):
    """Plain-JAX float32 reference, written independently of the kernel: one softmax over the
    concatenation [prefix keys, tree keys] with an explicit boolean mask."""
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    b, t, h, d = q.shape
    s, n = k_cache.shape[1], k_cache.shape[2]
    keys = jnp.concatenate([f32(k_cache), f32(tree_k)], axis=1)  # [b, s + t, n, d]
    values = jnp.concatenate([f32(v_cache), f32(tree_v)], axis=1)
    keys = jnp.repeat(keys, h // n, axis=2)  # kv head of query head j is j // g
    values = jnp.repeat(values, h // n, axis=2)
    logits = jnp.einsum("bthd,bshd->bhts", f32(q), keys, precision=lax.Precision.HIGHEST) / math.sqrt(d)
    prefix_ok = jnp.arange(s)[None, :] < lengths[:, None]  # [b, s]
    visible = jnp.concatenate(
        [jnp.broadcast_to(prefix_ok[:, None, :], (b, t, s)), jnp.broadcast_to(tree_mask, (b, t, t))], axis=2
    )
    logits = jnp.where(visible[:, None], logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1)
    return jnp.einsum("bhts,bshd->bthd", probs, values, precision=lax.Precision.HIGHEST)
