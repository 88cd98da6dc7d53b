"""Position-invariant causal attention over the KV cache (Pallas, Triton lowering: ROCm and CUDA).

The kernel of deterministic mode (issue 25). The t new tokens of each row have had their keys
and values written into the cache at slots lengths[b] .. lengths[b] + t - 1, so token i (at
absolute position lengths[b] + i) attends to slots [0, lengths[b] + i] of the cache, and nothing
else: the same keys, in the same blocks, in the same order, whether it is decoded alone, verified
among K+1 tokens, or prefilled with its prompt, and whatever its batch neighbours are.

  q        [b, t, h, d]   queries (RoPE applied), h = n * g
  k_cache  [b, s, n, d]   one layer of the cache, the new tokens' keys in place
  v_cache  [b, s, n, d]
  lengths  [b] int32      slots committed before the new tokens
  -> out   [b, t, h, d]   in q's dtype

What fixes every sum:
  * Every program holds ROWS query rows (tokens x query heads of one kv head): one dot shape
    for decode, verify and prefill alike. gb heads per program depend on g only.
  * Keys are reduced in blocks of BLOCK_K slots from slot 0, split by absolute position into
    ranges of SPLIT_LEN slots (flash-decoding's parallelism, by position rather than by batch
    size). A block a row may not see adds exact zeros (its weights are 0 and its running max
    unchanged), so extra blocks a longer neighbour needs change no bit.
  * The splits' float32 partials are merged in split order, one after another; the splits past
    a row's position are exact zeros there too, so the cache's capacity changes nothing.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

NEG = -1e30  # finite "minus infinity": fully masked rows stay NaN-free
BLOCK_K = 64  # key slots per step
SPLIT_LEN = 128  # key slots per split (a multiple of BLOCK_K): fixed, so positions, not shapes, set the merge
ROWS = 16  # query rows per program (Triton's smallest dot tile)


def _dot(a, b, contract_b: int):
    dims = (((1,), (contract_b,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def heads_per_program(g: int) -> int:
    """Query heads of one kv head per program: the largest power of two dividing g, at most ROWS."""
    gb = 1
    while g % (gb * 2) == 0 and gb * 2 <= ROWS:
        gb *= 2
    return gb


def _attend_kernel(lengths_ref, q_ref, k_ref, v_ref, *out_refs, scale: float, t: int, tq: int, gb: int,
                   window: int | None, split_len: int, head_blocks: int, num_splits: int):
    qb = pl.program_id(1) // head_blocks
    split = pl.program_id(2)
    length = lengths_ref[0]
    d = q_ref.shape[-1]
    real = qb * tq + jnp.arange(tq) < t
    q = plt.load(q_ref, mask=real[:, None, None], other=0.0).reshape(ROWS, d)
    position = length + qb * tq + jnp.arange(ROWS) // gb  # [ROWS]: each row's absolute position (row = token, head)
    start = split * split_len
    last = length + jnp.minimum(t, qb * tq + tq)  # one past the last slot any row here sees

    def block(i, carry):
        acc, m, l = carry
        offset = pl.multiple_of(start + i * BLOCK_K, BLOCK_K)
        keys = k_ref[pl.ds(offset, BLOCK_K), :]
        values = v_ref[pl.ds(offset, BLOCK_K), :]
        slots = offset + jnp.arange(BLOCK_K)
        valid = slots[None, :] <= position[:, None]
        if window is not None:
            valid &= position[:, None] - slots[None, :] < window
        s = jnp.where(valid, _dot(q, keys, 1) * scale, NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.where(valid, jnp.exp(s - m_new[:, None]), 0.0)
        correction = jnp.exp(m - m_new)
        l = l * correction + jnp.sum(p, axis=1)
        acc = acc * correction[:, None] + _dot(p.astype(values.dtype), values, 0)
        return acc, m_new, l

    carry = (jnp.zeros((ROWS, d), jnp.float32), jnp.full((ROWS,), NEG, jnp.float32), jnp.zeros((ROWS,), jnp.float32))
    num_blocks = jnp.clip(pl.cdiv(last - start, BLOCK_K), 0, split_len // BLOCK_K)
    acc, m, l = lax.fori_loop(0, num_blocks, block, carry)
    if num_splits == 1:
        out = (acc / l[:, None]).reshape(tq, gb, d)
        plt.store(out_refs[0], out.astype(out_refs[0].dtype), mask=real[:, None, None])
        return
    acc_ref, m_ref, l_ref = out_refs
    acc_ref[...] = acc.reshape(tq, gb, d)
    m_ref[...] = m.reshape(tq, gb)
    l_ref[...] = l.reshape(tq, gb)


def _merge_kernel(acc_ref, m_ref, l_ref, o_ref, *, t: int, tq: int, num_splits: int):
    """The splits' partials of one program's rows, merged one split after another, in order."""
    real = pl.program_id(1) * tq + jnp.arange(tq) < t
    top = lax.fori_loop(1, num_splits, lambda i, top: jnp.maximum(top, m_ref[i]), m_ref[0])  # exact in any order

    def add(i, carry):
        num, den = carry
        w = jnp.exp(m_ref[i] - top)
        return num + acc_ref[i] * w[:, :, None], den + l_ref[i] * w

    # From split 0 on (not from zeros): one split merged equals the kernel's own one-split output.
    w0 = jnp.exp(m_ref[0] - top)
    num, den = lax.fori_loop(1, num_splits, add, (acc_ref[0] * w0[:, :, None], l_ref[0] * w0))
    plt.store(o_ref, (num / den[:, :, None]).astype(o_ref.dtype), mask=real[:, None, None])


@functools.partial(jax.jit, static_argnames=("sliding_window", "split_len", "num_warps", "num_stages", "interpret"))
def causal_attention(q, k_cache, v_cache, lengths, *, sliding_window: int | None = None, split_len: int = SPLIT_LEN,
                     num_warps: int = 4, num_stages: int = 2, interpret: bool = False):
    """See the module docstring. s must be a multiple of BLOCK_K (the engine sizes caches so)."""
    b, t, h, d = q.shape
    s, n = k_cache.shape[1], k_cache.shape[2]
    if s % BLOCK_K or split_len % BLOCK_K:
        raise ValueError(f"cache length {s} and split_len {split_len} must be multiples of {BLOCK_K}")
    g = h // n
    gb = heads_per_program(g)
    tq = ROWS // gb
    head_blocks = n * (g // gb)
    query_blocks = pl.cdiv(t, tq)
    num_splits = pl.cdiv(s, split_len)
    kv_head = lambda j: (j % head_blocks) // (g // gb)  # noqa: E731
    q_spec = pl.BlockSpec((None, tq, gb, d), lambda bi, j, si: (bi, j // head_blocks, j % head_blocks, 0))
    kv_spec = pl.BlockSpec((None, s, None, d), lambda bi, j, si: (bi, 0, kv_head(j), 0))
    kernel = functools.partial(_attend_kernel, scale=1.0 / math.sqrt(d), t=t, tq=tq, gb=gb, window=sliding_window,
                               split_len=split_len, head_blocks=head_blocks, num_splits=num_splits)
    params = plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    grid = (b, query_blocks * head_blocks, num_splits)
    args = (lengths.astype(jnp.int32), q, k_cache, v_cache)
    in_specs = [pl.BlockSpec((1,), lambda bi, j, si: (bi,)), q_spec, kv_spec, kv_spec]
    if num_splits == 1:
        return pl.pallas_call(kernel, grid=grid, in_specs=in_specs, out_specs=q_spec,
                              out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype), compiler_params=params,
                              interpret=interpret, name="causal_attention")(*args)
    tp = query_blocks * tq  # partials padded to whole query blocks
    part = lambda j: (j // head_blocks, j % head_blocks)  # noqa: E731
    acc, m, l = pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, None, tq, gb, d), lambda bi, j, si: (bi, si, *part(j), 0)),
                   pl.BlockSpec((None, None, tq, gb), lambda bi, j, si: (bi, si, *part(j))),
                   pl.BlockSpec((None, None, tq, gb), lambda bi, j, si: (bi, si, *part(j)))],
        out_shape=[jax.ShapeDtypeStruct((b, num_splits, tp, h, d), jnp.float32),
                   jax.ShapeDtypeStruct((b, num_splits, tp, h), jnp.float32),
                   jax.ShapeDtypeStruct((b, num_splits, tp, h), jnp.float32)],
        compiler_params=params, interpret=interpret, name="causal_attention",
    )(*args)
    return pl.pallas_call(
        functools.partial(_merge_kernel, t=t, tq=tq, num_splits=num_splits),
        grid=(b, query_blocks, h // gb),
        in_specs=[pl.BlockSpec((None, num_splits, tq, gb, d), lambda bi, c, j: (bi, 0, c, j, 0)),
                  pl.BlockSpec((None, num_splits, tq, gb), lambda bi, c, j: (bi, 0, c, j)),
                  pl.BlockSpec((None, num_splits, tq, gb), lambda bi, c, j: (bi, 0, c, j))],
        out_specs=pl.BlockSpec((None, tq, gb, d), lambda bi, c, j: (bi, c, j, 0)),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret, name="causal_attention_merge",
    )(acc, m, l)


def causal_attention_reference(q, k_cache, v_cache, lengths, sliding_window: int | None = None):
    """Plain-JAX float32 reference: one softmax over the visible slots of the whole cache."""
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    b, t, h, d = q.shape
    s, n = k_cache.shape[1], k_cache.shape[2]
    keys = jnp.repeat(f32(k_cache), h // n, axis=2)
    values = jnp.repeat(f32(v_cache), h // n, axis=2)
    logits = jnp.einsum("bthd,bshd->bhts", f32(q), keys, precision=lax.Precision.HIGHEST) / math.sqrt(d)
    position = lengths[:, None] + jnp.arange(t)[None, :]  # [b, t]
    slots = jnp.arange(s)
    visible = slots[None, None, :] <= position[:, :, None]
    if sliding_window is not None:
        visible &= position[:, :, None] - slots[None, None, :] < sliding_window
    logits = jnp.where(visible[:, None], logits, -jnp.inf)
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(logits, axis=-1), values, precision=lax.Precision.HIGHEST)
