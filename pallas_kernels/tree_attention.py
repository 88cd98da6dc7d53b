"""Fused tree-attention verification kernel (Pallas, Triton lowering: runs on ROCm and CUDA).

Computes, for the t tree nodes of each row, attention over
  * the row's committed KV prefix: cache slots [0, lengths[b]), and
  * the tree's own keys, each node seeing only its ancestors and itself (`tree_mask`),
in one pass with an online softmax, GQA (the query heads of one kv head share each K/V load),
bf16 or float32 inputs and float32 accumulation.

Layout (every operand is read where it lies: no transposes, pads or slices around the call):
  q        [b, t, h, d]   tree queries (RoPE applied), h = n * g; or [b, t, n, G, d] with kv head
                          i's g queries at [:, :, i, :g] (a fused projection's output, G >= g)
  k_cache  [b, s, n, d]   one layer of the KV cache (slots past lengths[b] are ignored)
  v_cache  [b, s, n, d]
  tree_k   [b, t, n, d]   the tree nodes' own keys / values; or [b, t, n, E, d] with them at
  tree_v   [b, t, n, d]   index k_index / v_index of axis 3 (again a fused projection's output)
  lengths  [b] int32      committed prefix length per row (0 allowed)
  tree_mask [t, t] bool   tree_mask[i, j]: node i may attend to node j (ancestor or self)
  -> out   [b, t, h, d]   in the cache's dtype
With write_cache the kernel also stores the tree's keys and values into the caches at slots
lengths[b] + [0, t) (slots past s are dropped), in place, and returns the caches too: a decode
step then needs no slice or scatter kernels around the attention (at batch 32 on the H200 those
were four launches a layer, docs/quantization.md).

Grid: (b, n * head blocks, prefix splits). A program takes `gb` query heads of one kv head for
all t nodes (blocks span tb = t rounded up to a power of two; loads and stores past t are
masked): its rows are node * gb + head, so one K/V tile serves tb * gb query rows. At batch 1 a (row, kv head) grid would leave most of the
GPU idle, so the prefix is split across programs (flash-decoding): each split writes its
normalised partial output (in q's dtype, as vLLM's paged attention v2 does) and its
log-sum-exp, and a second small kernel merges the splits straight into `out`. With one split
the first kernel writes `out` itself. Split 0 also folds in the tree block.

Backend notes (DESIGN.md): only the Triton lowering runs on ROCm, so compiler_params are always
plt.CompilerParams; Triton wants power-of-two tiles and dot tiles >= 16 (tb >= 16); MI300 has
64 KB of shared memory per CU, hence block_k 64 and 2 pipeline stages there (3 on NVIDIA
while the tiles fit).
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
MERGE_ELEMENTS = 8192  # partial-output elements one merge program loads at once
# K/V bytes that pipelining may hold beyond the tile in use. On the H200, 2 x 128 KB float32 tiles
# (block_k 256, d 64, 3 stages) overflowed its 227 KB; 2 x 64 KB ran.
MAX_PIPELINED_BYTES = 128 * 1024


def _pow2(n: int, minimum: int = 16) -> int:
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())


def _dot(a, b, contract_b: int):
    """a [M, K] . b (contracting b's axis `contract_b`) -> float32. HIGHEST precision: IEEE
    float32 for f32 inputs (Triton would use tf32), plain bf16 x bf16 -> f32 otherwise.
    (pl.dot is gone from JAX 0.12; lax.dot_general lowers on every supported version.)"""
    dims = (((1,), (contract_b,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def _node_rows(tb: int, t: int, ndim: int):
    """Mask [tb, 1, ...] of the real nodes among the tb padded ones."""
    return (jnp.arange(tb) < t).reshape((tb,) + (1,) * (ndim - 1))


def _write_tree(tk_ref, tv_ref, kc_ref, vc_ref, length, t: int):
    """Stores the t nodes' keys and values at cache slots length + [0, t), one slot at a time
    (a slot past the cache is masked, so interpret mode's clamped slices write nothing there)."""
    cache_len, d = kc_ref.shape

    def node(i, _):
        slot = length + i
        keep = jnp.full((1, d), slot < cache_len)
        for src, dst in ((tk_ref, kc_ref), (tv_ref, vc_ref)):
            plt.store(dst.at[pl.ds(slot, 1), :], src[pl.ds(i, 1), :].astype(dst.dtype), mask=keep)

    lax.fori_loop(0, t, node, None)


def _attend_kernel(
    lengths_ref, q_ref, k_ref, v_ref, tk_ref, tv_ref, mask_ref,  # inputs
    *out_refs,  # out (one split) or (partial out, log-sum-exp); then the caches with write_cache
    scale: float, block_k: int, split_len: int, t: int, tb: int, gb: int, num_splits: int,
    write_cache: bool, blocks_per_kv_head: int,
):
    split = pl.program_id(2)
    length = lengths_ref[0]
    if write_cache:  # the first program of each (row, kv head) writes its tree's keys and values
        *out_refs, kc_ref, vc_ref = out_refs
        first = (pl.program_id(1) % blocks_per_kv_head == 0) & (split == 0)
        pl.when(first)(lambda: _write_tree(tk_ref, tv_ref, kc_ref, vc_ref, length, t))
    d = q_ref.shape[-1]
    rows = tb * gb
    q = plt.load(q_ref, mask=_node_rows(tb, t, 3), other=0.0).astype(k_ref.dtype).reshape(rows, d)
    start = split * split_len

    def attend(keys, values, valid, carry):
        acc, m, l = carry
        s = _dot(q, keys, contract_b=1) * scale  # [rows, K]
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

    def tree_block(carry):
        real = jnp.arange(tb) < t
        keys = plt.load(tk_ref, mask=real[:, None], other=0.0).astype(k_ref.dtype)
        values = plt.load(tv_ref, mask=real[:, None], other=0.0).astype(v_ref.dtype)
        visible = plt.load(mask_ref, mask=real[:, None] & real[None, :], other=0)
        # Row node * gb + head sees what its node sees.
        visible = jnp.broadcast_to(visible[:, None, :], (tb, gb, tb)).reshape(rows, tb)
        return attend(keys, values, visible != 0, carry)

    carry = (
        jnp.zeros((rows, d), jnp.float32),
        jnp.full((rows,), NEG, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )
    num_blocks = jnp.clip(pl.cdiv(length - start, block_k), 0, split_len // block_k)
    carry = lax.fori_loop(0, num_blocks, prefix_block, carry)
    if num_splits == 1:
        acc, _, l = tree_block(carry)
        out = (acc / l[:, None]).reshape(tb, gb, d)
        plt.store(out_refs[0], out.astype(out_refs[0].dtype), mask=_node_rows(tb, t, 3))
        return
    acc, m, l = lax.cond(split == 0, tree_block, lambda c: c, carry)
    part_ref, lse_ref = out_refs
    empty = l == 0  # a split wholly past this row's prefix
    l = jnp.where(empty, 1.0, l)
    part_ref[...] = (acc / l[:, None]).reshape(tb, gb, d).astype(part_ref.dtype)
    lse_ref[...] = jnp.where(empty, NEG, m + jnp.log(l)).reshape(tb, gb)


def _merge_kernel(part_ref, lse_ref, o_ref, *, num_splits: int, total_rows: int):
    """Merges every split's partial output for a block of (node, head) rows at once: the loads
    are independent, so their latencies overlap (a loop over splits would pay one per split)."""
    sp, rows = lse_ref.shape  # splits padded to a power of two
    real = (jnp.arange(sp) < num_splits)[:, None]
    lse = plt.load(lse_ref, mask=real, other=NEG)  # [sp, rows]
    part = plt.load(part_ref, mask=real[:, :, None], other=0.0).astype(jnp.float32)  # [sp, rows, d]
    w = jnp.exp(lse - jnp.max(lse, axis=0)[None, :])
    out = jnp.sum(w[:, :, None] * part, axis=0) / jnp.sum(w, axis=0)[:, None]
    row = pl.program_id(1) * rows + jnp.arange(rows)
    plt.store(o_ref, out.astype(o_ref.dtype), mask=(row < total_rows)[:, None])


def _heads_per_program(g: int, tb: int, block_rows: int) -> int:
    """Largest power of two dividing g with tb * gb <= block_rows (at least 1)."""
    gb = 1
    while g % (gb * 2) == 0 and tb * gb * 2 <= block_rows:
        gb *= 2
    return gb


def _choose_splits(programs: int, prefix_blocks: int, target_programs: int) -> int:
    """Largest power-of-two split count that keeps programs * splits <= target_programs and
    divides the prefix blocks. (On the H200 ~2 programs per SM was best at every measured shape,
    even when that leaves one 64-key block per split: docs/KERNELS.md.)"""
    splits = 1
    while programs * splits * 2 <= target_programs and prefix_blocks % (splits * 2) == 0:
        splits *= 2
    return splits


def default_stages(kv_tile_bytes: int) -> int:
    """Software-pipelining depth for K/V tiles of this size (one key step of K plus V): 3 on
    NVIDIA GPUs (best at every shape measured on the H200) while the extra tiles in flight fit
    its shared memory with room to spare, else 2; 2 elsewhere (a third K/V stage would overflow
    MI300's 64 KB of shared memory)."""
    nvidia = any(d.device_kind.startswith("NVIDIA") for d in jax.devices())
    return 3 if nvidia and 2 * kv_tile_bytes <= MAX_PIPELINED_BYTES else 2


def tiling(b: int, t: int, h: int, n: int, s: int, *, block_k: int = BLOCK_K, block_rows: int = 64,
           num_splits: int | None = None, target_programs: int = 264) -> tuple[int, int, int, int]:
    """(padded nodes tb, query heads per program, prefix splits, keys per inner step) for a call
    of these shapes. block_k is the most keys per step; a split shorter than it takes fewer."""
    if s % BLOCK_K:
        raise ValueError(f"cache length {s} must be a multiple of {BLOCK_K}")
    if block_k % BLOCK_K or block_k & (block_k - 1):
        raise ValueError(f"block_k={block_k} must be a power-of-two multiple of {BLOCK_K}")
    tb = _pow2(t)
    gb = _heads_per_program(h // n, tb, block_rows)
    splits = num_splits or _choose_splits(b * n * (h // n // gb), s // BLOCK_K, target_programs)
    if (s // BLOCK_K) % splits:
        raise ValueError(f"num_splits={splits} must divide the {s // BLOCK_K} prefix blocks of {BLOCK_K} keys")
    step = block_k
    while (s // splits) % step:
        step //= 2
    return tb, gb, splits, step


def _grouped(x, n: int):
    """[b, t, h, d] -> [b, t, n, h // n, d] (a free reshape); 5-d arrays pass as they are."""
    if x.ndim == 5:
        return x
    b, t, h, d = x.shape
    return x.reshape(b, t, n, h // n, d)


@functools.partial(
    jax.jit,
    static_argnames=("groups", "k_index", "v_index", "write_cache", "block_k", "block_rows", "num_splits",
                     "num_warps", "num_stages", "interpret", "target_programs", "merge_rows"),
)
def tree_attention(
    q, k_cache, v_cache, tree_k, tree_v, lengths, tree_mask, *,
    groups: int | None = None, k_index: int = 0, v_index: int = 0, write_cache: bool = False,
    block_k: int = BLOCK_K, block_rows: int = 64, num_splits: int | None = None,
    num_warps: int = 4, num_stages: int | None = None, interpret: bool = False, target_programs: int = 264,
    merge_rows: int = 64,
):
    """Tree attention -> out, or (out, k_cache, v_cache) with write_cache; see the module
    docstring for shapes. groups: the query heads per kv head of a 5-d q (default: all of its
    axis 3). The cache length s must be a multiple of BLOCK_K (the engine sizes its cache so);
    see `tiling` for the other knobs."""
    b, t = q.shape[:2]
    s, n, d = k_cache.shape[1:]
    q, tree_k, tree_v = _grouped(q, n), _grouped(tree_k, n), _grouped(tree_v, n)
    g = groups or q.shape[3]
    if not (g <= q.shape[3] and k_index < tree_k.shape[3] and v_index < tree_v.shape[3]):
        raise ValueError(f"groups={g}, k_index={k_index}, v_index={v_index} must lie inside q {q.shape}, "
                         f"tree_k {tree_k.shape} and tree_v {tree_v.shape}")
    h = n * g
    tb, gb, splits, block_k = tiling(b, t, h, n, s, block_k=block_k, block_rows=block_rows, num_splits=num_splits,
                                     target_programs=target_programs)
    head_blocks = n * (g // gb)  # programs per batch row; block j holds heads [j * gb, (j + 1) * gb)
    split_len = s // splits
    kv_head = lambda j: j // (g // gb)  # noqa: E731
    stages = num_stages or default_stages(2 * block_k * d * k_cache.dtype.itemsize)
    params = plt.CompilerParams(num_warps=num_warps, num_stages=stages)
    dtype = k_cache.dtype
    out_shape = jax.ShapeDtypeStruct((b, t, h, d), dtype)

    kernel = functools.partial(
        _attend_kernel, scale=1.0 / math.sqrt(d), block_k=block_k, split_len=split_len, t=t, tb=tb, gb=gb,
        num_splits=splits, write_cache=write_cache, blocks_per_kv_head=g // gb,
    )
    if splits == 1:
        out_specs = [pl.BlockSpec((None, tb, gb, d), lambda bi, j, *_: (bi, 0, j, 0))]
        out_shapes = [out_shape]
    else:
        out_specs = [  # partial outputs in out's own layout, nodes padded to tb
            pl.BlockSpec((None, None, tb, gb, d), lambda bi, j, si: (bi, si, 0, j, 0)),
            pl.BlockSpec((None, None, tb, gb), lambda bi, j, si: (bi, si, 0, j)),
        ]
        out_shapes = [
            jax.ShapeDtypeStruct((b, splits, tb, h, d), dtype),
            jax.ShapeDtypeStruct((b, splits, tb, h), jnp.float32),
        ]
    cache_spec = pl.BlockSpec((None, s, None, d), lambda bi, j, si: (bi, 0, kv_head(j), 0))
    aliases = {}
    if write_cache:  # the caches (operands 2 and 3) come back as the last two outputs, in place
        out_specs += [cache_spec, cache_spec]
        out_shapes += [jax.ShapeDtypeStruct(k_cache.shape, dtype), jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)]
        aliases = {2: len(out_shapes) - 2, 3: len(out_shapes) - 1}
    tree_spec = lambda index: pl.BlockSpec(  # noqa: E731
        (None, tb, None, None, d), lambda bi, j, si: (bi, 0, kv_head(j), index, 0))
    result = pl.pallas_call(
        kernel,
        grid=(b, head_blocks, splits),
        in_specs=[
            pl.BlockSpec((1,), lambda bi, j, si: (bi,)),
            pl.BlockSpec((None, tb, None, gb, d), lambda bi, j, si: (bi, 0, kv_head(j), j % (g // gb), 0)),
            pl.BlockSpec((None, split_len, None, d), lambda bi, j, si: (bi, si, kv_head(j), 0)),
            pl.BlockSpec((None, split_len, None, d), lambda bi, j, si: (bi, si, kv_head(j), 0)),
            tree_spec(k_index),
            tree_spec(v_index),
            pl.BlockSpec((tb, tb), lambda bi, j, si: (0, 0)),
        ],
        out_specs=out_specs,
        out_shape=out_shapes,
        input_output_aliases=aliases,
        compiler_params=params,
        interpret=interpret,
        name="tree_attention",
    )(lengths.astype(jnp.int32), q, k_cache, v_cache, tree_k, tree_v, tree_mask.astype(jnp.int32))
    caches = tuple(result[-2:]) if write_cache else ()
    if splits == 1:
        return (result[0], *caches) if write_cache else result[0]

    part, lse = result[:2]
    sp = _pow2(splits, minimum=1)
    merge_rows = max(1, min(merge_rows, MERGE_ELEMENTS // (sp * d)))  # bounds the registers held
    while (tb * h) % merge_rows:  # blocks stay inside the partial arrays
        merge_rows //= 2
    total = t * h  # merge (node, head) rows; out viewed as [b, t * h, d] (a free reshape)
    merged = pl.pallas_call(
        functools.partial(_merge_kernel, num_splits=splits, total_rows=total),
        grid=(b, pl.cdiv(total, merge_rows)),
        in_specs=[
            pl.BlockSpec((None, sp, merge_rows, d), lambda bi, c: (bi, 0, c, 0)),
            pl.BlockSpec((None, sp, merge_rows), lambda bi, c: (bi, 0, c)),
        ],
        out_specs=pl.BlockSpec((None, merge_rows, d), lambda bi, c: (bi, c, 0)),
        out_shape=jax.ShapeDtypeStruct((b, total, d), dtype),
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="tree_attention_merge",
    )(part.reshape(b, splits, tb * h, d), lse.reshape(b, splits, tb * h))
    out = merged.reshape(b, t, h, d)
    return (out, *caches) if write_cache else out


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
