"""Grouped expert matmul for mixture-of-experts layers (Pallas, Triton lowering: runs on ROCm and
CUDA): each block of BLOCK_M rows belongs to one expert, and reads only that expert's weights, in
place. A decode step of Qwen3-30B-A3B (8 of 128 experts a layer) reads its 8 experts once; XLA's
paths either copy the chosen experts out first (a gather) or pay ragged_dot's fixed cost (about
0.55 ms a layer on an H100 even for one token; docs/moe.md).

Layout (group_pairs builds it from the router's choices):
  x             [S, k]        rows in blocks of BLOCK_M, block i all for expert block_expert[i]
                              (unused rows: zeros)
  w             [E, k, n]     each expert's weights (k leading: the engine's layout), or, gated,
                [E, k, 2, n]  gate and up side by side; 8-bit (int8, or fp8 e4m3fn bits) channels
                              first, [E, n, k] / [E, 2, n, k], as jaxspec's Quantized keeps them,
                              converted to x's dtype in registers as pallas_kernels/matmul.py does
  scale         [E, n]        8-bit: float32, each expert's own per output column ([E, 2, n] gated),
                              applied to the float32 sums before the epilogue
  block_expert  [S / BLOCK_M] int32 each block's expert, -1 for blocks past the last used one
  -> out        [S, n]        out_dtype (gated: silu(gate) * up, as pallas_kernels/fused.py rounds it)
Up to BLOCK_M tokens (decode at small batches, verify passes) skip the grouping: x is one block
holding every token, which each used block multiplies by its expert (shared_x; few_tokens_layout).

Grid (blocks, n / block_n): program (i, j) loads expert block_expert[i]'s [block_k, block_n] tiles
(gate's and up's, gated) down k in a fixed order, one float32 accumulator; blocks with no expert
return at once. block_k depends on k only and every dot is [BLOCK_M, block_k] x [block_k, block_n]
(block_n only picks which columns a program sums), so a row's sums have one order whatever the
other rows are: the same token gives the same bits alone, in a batch or in a verify pass
(deterministic mode; issue 25).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.fused import finish
from pallas_kernels.matmul import BLOCK_M, FORMATS, FP8_SHIFT, NATIVE_FP8, _dot, _largest_pow2_divisor, _weights_as

DEFAULT_BLOCK_K = 128
DEFAULT_BLOCK_N = 64
# Column tiles per platform where measured: on an H100, Qwen3-30B-A3B's experts at 4-64 tokens ran
# fastest with 128 columns (gate's and up's each: 64 KB of weights a pipeline stage; docs/moe.md).
# Elsewhere 64 (MI300's LDS is 64 KB, and no MI300 was at hand to measure). Column tiles change
# no sum's order, so no bit.
BLOCK_N = {"cuda": 128}


# Up to this many (token, expert) pairs group_pairs ranks each pair among its expert's by comparing
# every pair with every other (one [P, P] comparison XLA fuses) instead of sorting them (a sort
# and a scatter: separate GPU kernels in every layer of every step); past it the [P, P]
# comparison outgrows the sort. Both give the same layout. Timed (Qwen3-30B-A3B, 8 pairs a token;
# docs/moe.md): compare against sort 14 us / 23 at 8 pairs (H100), 20 / 32 at 64 and 75 / 79 at 256
# (H200), 136 / 29 at 512 (H100).
COMPARE_MAX_PAIRS = 256


def group_pairs(experts: jnp.ndarray, num_experts: int, block_m: int = BLOCK_M, method: str | None = None):
    """The grouped layout of (token, expert) pairs. experts [P] int32, each pair's expert; those
    outside [0, num_experts) (another device's, under expert parallelism) are left out.
    -> (slot [P]: each pair's row in the layout, past the last row for pairs left out;
        block_expert [blocks] int32: each block's expert, -1 past the last).
    Each expert's pairs fill whole blocks of block_m rows from a block of their own, in pair
    order, so blocks = P // block_m + min(num_experts, P) always suffices: a static shape for any
    routing. method "compare" or "sort" (None: compare up to COMPARE_MAX_PAIRS pairs) only
    changes how it is computed."""
    p = experts.shape[0]
    method = method or ("compare" if p <= COMPARE_MAX_PAIRS else "sort")
    if method not in ("compare", "sort"):
        raise ValueError(f"group_pairs method must be 'compare' or 'sort'; got {method!r}")
    kept = (experts >= 0) & (experts < num_experts)
    bins = jnp.where(kept, experts, num_experts)  # one bin past the experts for the pairs left out
    if method == "compare":
        sizes = jnp.sum(bins[:, None] == jnp.arange(num_experts + 1)[None, :], axis=0, dtype=jnp.int32)
    else:
        sizes = jnp.bincount(bins, length=num_experts + 1)
    blocks = (sizes[:num_experts] + block_m - 1) // block_m
    first_row = jnp.append(jnp.cumsum(blocks) - blocks, 0) * block_m  # each expert's first row
    if method == "compare":  # a pair's rank: the earlier pairs of its expert
        earlier = jnp.tril(bins[:, None] == bins[None, :], k=-1)
        slot = first_row[bins] + jnp.sum(earlier, axis=1, dtype=jnp.int32)
    else:
        order = jnp.argsort(bins, stable=True)
        sorted_bins = bins[order]
        rank = jnp.arange(p) - (jnp.cumsum(sizes) - sizes)[sorted_bins]
        slot = jnp.zeros((p,), jnp.int32).at[order].set((first_row[sorted_bins] + rank).astype(jnp.int32))
    n_blocks = p // block_m + min(num_experts, p)
    slot = jnp.where(kept, slot, n_blocks * block_m).astype(jnp.int32)
    # compare_all: one fused comparison; the default 'scan' is a loop of log2(E) steps, which on a
    # GPU is a kernel launch (and a loop test) each, in every layer of every step
    block_expert = jnp.searchsorted(jnp.cumsum(blocks), jnp.arange(n_blocks), side="right", method="compare_all")
    block_expert = jnp.where(block_expert < num_experts, block_expert, -1).astype(jnp.int32)
    return slot, block_expert


def _kernel(block_expert_ref, x_ref, w_ref, *rest, block_k: int, gated: bool, fmt: str, w_nk: bool,
            native_fp8: bool, x_rows: int):
    scale_ref = rest[0] if len(rest) == 2 else None
    o_ref = rest[-1]
    e = block_expert_ref[pl.program_id(0)]
    bn = o_ref.shape[1]
    col = pl.program_id(1) * bn  # (outside pl.when: interpret mode has no program ids inside a cond)

    @pl.when(e >= 0)
    def _():
        k = x_ref.shape[1]
        cols = pl.ds(col, bn)

        def tile(at, half):  # [block_k, bn] (w_nk: [bn, block_k]) in x's dtype; 8 bits converted exactly
            rows = pl.ds(at, block_k)
            at_half = (half,) if gated else ()
            index = (e, *at_half, cols, rows) if w_nk else (e, rows, *at_half, cols)
            return _weights_as(w_ref[index], fmt, x_ref.dtype, native_fp8)

        def step(i, accs):
            at = pl.multiple_of(i * block_k, block_k)
            if x_rows < BLOCK_M:  # a few tokens' x, its missing rows read as zeros (no pad before)
                real = lax.broadcasted_iota(jnp.int32, (BLOCK_M, block_k), 0) < x_rows
                x = plt.load(x_ref.at[:, pl.ds(at, block_k)], mask=real, other=0)
            else:
                x = x_ref[:, pl.ds(at, block_k)]
            return tuple(acc + _dot(x, tile(at, h), ((1,), (1,)) if w_nk else ((1,), (0,)))
                         for h, acc in enumerate(accs))

        zeros = jnp.zeros((x_ref.shape[0], bn), jnp.float32)
        accs = lax.fori_loop(0, k // block_k, step, (zeros,) * (2 if gated else 1))
        if scale_ref is not None:  # per-channel scales factor out of the k sums: applied once, to them
            accs = tuple(acc * scale_ref[(e, h, cols) if gated else (e, cols)][None, :] for h, acc in enumerate(accs))
        o_ref[...] = finish(accs[0], o_ref.dtype, up=accs[1] if gated else None)


@functools.partial(jax.jit, static_argnames=("gated", "fmt", "w_nk", "out_dtype", "block_k", "block_n", "num_warps",
                                             "num_stages", "shared_x", "interpret"))
def expert_matmul(x, w, block_expert, scale=None, *, gated: bool = False, fmt: str = "float", w_nk: bool = False,
                  out_dtype=None, block_k: int | None = None, block_n: int | None = None, num_warps: int = 4,
                  num_stages: int = 3, shared_x: bool = False, interpret: bool = False):
    """x [S, k] @ w[block's expert] (times scale[block's expert]) -> [S, n] in out_dtype (default
    x's); see the module docstring. fmt: w as x's float dtype, int8, or fp8 e4m3fn bits (uint8;
    pallas_kernels/matmul.py FORMATS), converted to x's dtype in registers as the matmul kernel
    does. w_nk: w channels first, [E, n, k] or gated [E, 2, n, k] (8-bit experts are kept so).
    scale: float32 per expert and output column, [E, n] or gated [E, 2, n] (None: unscaled),
    applied to the float32 sums before the epilogue. block_k, block_n: the tiles (None: the
    largest powers of two up to DEFAULT_BLOCK_K and the platform's BLOCK_N that divide k and n).
    block_k fixes the order of every sum, so it follows the weights' shape, never the rows;
    block_n fixes none. shared_x: x is up to BLOCK_M rows (read as one block, the missing rows
    zeros) that every block multiplies by its own expert (a few tokens' layout: no copy of x per
    block, no pad), out still a block each."""
    if fmt not in FORMATS:
        raise ValueError(f"expert_matmul fmt must be one of {', '.join(FORMATS)}; got {fmt!r}")
    s, k = x.shape
    n = w.shape[-2] if w_nk else w.shape[-1]
    pair = ["2"] if gated else []
    want = ["E", *pair, "n", f"k={k}"] if w_nk else ["E", f"k={k}", *pair, "n"]
    if w.ndim != len(want) or w.shape[want.index(f"k={k}")] != k or (gated and w.shape[want.index("2")] != 2):
        raise ValueError(f"expert_matmul w must be [{', '.join(want)}]; got {list(w.shape)}")
    if shared_x and (s > BLOCK_M or block_expert.ndim != 1):
        raise ValueError(f"expert_matmul with shared_x: x must be at most {BLOCK_M} rows, block_expert [blocks]; "
                         f"got x {list(x.shape)}, block_expert {list(block_expert.shape)}")
    if not shared_x and (s % BLOCK_M or block_expert.shape != (s // BLOCK_M,)):
        raise ValueError(f"expert_matmul x must hold whole blocks of {BLOCK_M} rows, one block_expert each; got "
                         f"x {list(x.shape)}, block_expert {list(block_expert.shape)}")
    blocks = block_expert.shape[0]
    expected = {"int8": jnp.int8, "fp8": jnp.uint8}.get(fmt, x.dtype)
    if w.dtype != expected:
        what = "x's dtype" if fmt == "float" else f"for fmt {fmt!r}"
        raise ValueError(f"expert_matmul w must be {what} {jnp.dtype(expected).name}; got {w.dtype}")
    scale_shape = (w.shape[0], 2, n) if gated else (w.shape[0], n)
    if scale is not None and scale.shape != scale_shape:
        raise ValueError(f"expert_matmul scale must be [E, {'2, ' if gated else ''}n={n}] float32; got "
                         f"{list(scale.shape)}")
    block_k = _largest_pow2_divisor(k, block_k or DEFAULT_BLOCK_K, "k")
    scaled = scale is not None or fmt == "fp8"  # fp8's bit decode leaves a factor 2^8 to the scale
    s32 = jnp.ones(scale_shape, jnp.float32) if scale is None else scale.astype(jnp.float32)

    def on(platform):
        native = fmt == "fp8" and platform in NATIVE_FP8
        columns = _largest_pow2_divisor(n, block_n or BLOCK_N.get(platform, DEFAULT_BLOCK_N), "n")
        kernel = functools.partial(_kernel, block_k=block_k, gated=gated, fmt=fmt, w_nk=w_nk, native_fp8=native,
                                   x_rows=s if shared_x else BLOCK_M)

        def call(block_expert, x, w, s32):
            weights = (w, s32 * FP8_SHIFT if fmt == "fp8" and not native else s32) if scaled else (w,)
            return pl.pallas_call(
                kernel,
                grid=(blocks, n // columns),
                in_specs=[pl.BlockSpec(block_expert.shape, lambda i, j: (0,)),
                          pl.BlockSpec((BLOCK_M, k), (lambda i, j: (0, 0)) if shared_x else (lambda i, j: (i, 0)))]
                # the weights (and scales) whole, indexed by each block's expert inside
                + [pl.BlockSpec(a.shape, lambda i, j, a=a: (0,) * a.ndim) for a in weights],
                out_specs=pl.BlockSpec((BLOCK_M, columns), lambda i, j: (i, j)),
                out_shape=jax.ShapeDtypeStruct((blocks * BLOCK_M, n), out_dtype or x.dtype),
                compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
                interpret=interpret,
                name=("expert_matmul_gated" if gated else "expert_matmul") + ("" if fmt == "float" else f"_{fmt}"),
            )(block_expert, x, *weights)
        return call

    operands = (block_expert, x, w, s32)
    if interpret:
        return on("interpret")(*operands)
    return lax.platform_dependent(*operands, default=on("default"), **{p: on(p) for p in set(NATIVE_FP8) | set(BLOCK_N)})


def grouped_layout(h, experts, num_experts: int, method: str | None = None):
    """(x, block_expert, read_back) for m tokens' pairs (experts [m * k]) by group_pairs (method:
    its own): the rows scattered into their blocks, each pair's output gathered back from its row."""
    slot, block_expert = group_pairs(experts, num_experts, method=method)
    k = experts.shape[0] // h.shape[0]
    x = jnp.zeros((block_expert.shape[0] * BLOCK_M, h.shape[1]), h.dtype).at[slot].set(
        jnp.repeat(h, k, axis=0), mode="drop")
    return x, block_expert, lambda out: jnp.take(out, slot, axis=0, mode="fill", fill_value=0)


def few_tokens_layout(h, experts, num_experts: int, all_held: bool = False):
    """The layout of up to BLOCK_M tokens (h [m, d], experts [m * k]), with nothing scattered: x
    is the tokens themselves, read as one block that every block multiplies (shared_x), and
    each distinct expert held here takes a block, in the order of the pairs that first chose
    them (min(m * k, num_experts) blocks, the unused ones -1), whose row i is token i through that
    expert; each pair's output is its token's row in its expert's block. A row's sums do not
    depend on its block or row, so every token's bits are the grouped layout's. One token (a
    decode step at batch 1) needs not even the comparison: its k experts are distinct (a
    repeated one would be read twice, still correctly), so its blocks are its pairs in order and
    each output the first row of its block. all_held: every pair's expert is held here (no
    expert parallelism), so one token's choices are its blocks as they are: no kernel before the
    experts' to mark the others'. -> (x, block_expert, read_back), for expert_matmul's shared_x."""
    m, p = h.shape[0], experts.shape[0]
    k = p // m
    kept = (experts >= 0) & (experts < num_experts)  # (pairs routed to another device: skipped)
    if m == 1 and k <= num_experts:
        rows = lambda out: out.reshape(p, BLOCK_M, -1)[:, 0]  # noqa: E731
        if all_held:
            return h, experts.astype(jnp.int32), rows
        block_expert = jnp.where(kept, experts, -1)
    else:  # [P, P] comparisons XLA fuses: each pair's first pair of its expert, and that one's rank
        # among the first pairs (so the blocks are the distinct experts, compacted)
        bins = jnp.where(kept, experts, num_experts)
        first = jnp.argmax(bins[:, None] == bins[None, :], axis=1)
        leads = kept & (first == jnp.arange(p))
        rank = jnp.sum(jnp.tril(jnp.ones((p, p), bool), -1) & leads[None, :], axis=1, dtype=jnp.int32)
        blocks = min(p, num_experts)
        chosen = leads[None, :] & (rank[None, :] == jnp.arange(blocks)[:, None])  # [blocks, P]
        block_expert = jnp.max(jnp.where(chosen, experts[None, :], -1), axis=1)
        rows = lambda out: jnp.take(out, rank[first] * BLOCK_M + jnp.arange(p) // k, axis=0)  # noqa: E731
    # (a skipped pair's rows are never written: where, not a product, keeps them out)
    read_back = lambda out: jnp.where(kept[:, None], rows(out), 0)  # noqa: E731
    return h, block_expert.astype(jnp.int32), read_back


def experts_mlp(h, experts, weights, gate_up, down, *, fmt: str = "float", gate_up_scale=None, down_scale=None,
                first_expert=None, interpret: bool = False, grouped: bool = False, **tiles):
    """The experts of a mixture-of-experts MLP through expert_matmul: h [m, d] normed tokens,
    experts and weights [m, k] the router's choices (global expert ids) and their weights,
    gate_up [E, d, 2, f] and down [E, f, d] the experts held here: all of them (first_expert
    None: every choice is one of them), or those from first_expert on (expert parallelism: pairs
    routed elsewhere add nothing). fmt "int8" / "fp8": 8-bit experts, channels first
    (gate_up [E, 2, f, d], down [E, d, f]) with float32 scales gate_up_scale [E, 2, f] and
    down_scale [E, d] (each expert's own, per output channel). -> [m, d] float32: each token's
    weighted expert outputs, summed over its k choices in order (so the sum too is the token's
    alone). tiles: expert_matmul's block_n, num_warps, num_stages. Up to BLOCK_M tokens take
    few_tokens_layout, more the grouped one (grouped: the grouped one always, to measure them)."""
    m, k = experts.shape
    e = gate_up.shape[0]
    few = m <= BLOCK_M and not grouped
    local = (experts - (0 if first_expert is None else first_expert)).reshape(-1)
    if few:
        x, block_expert, read_back = few_tokens_layout(h, local, e, all_held=first_expert is None)
    else:
        x, block_expert, read_back = grouped_layout(h, local, e)
    kw = dict(fmt=fmt, w_nk=fmt != "float", interpret=interpret, **tiles)
    act = expert_matmul(x, gate_up, block_expert, gate_up_scale, gated=True, shared_x=few, **kw)
    out = expert_matmul(act, down, block_expert, down_scale, out_dtype=jnp.float32, **kw)
    pairs = read_back(out) * weights.reshape(-1, 1)
    pairs = pairs.reshape(m, k, -1)
    total = pairs[:, 0]
    for j in range(1, k):  # in a fixed order
        total = total + pairs[:, j]
    return total


def experts_mlp_reference(h, experts, weights, gate_up, down):
    """Plain-JAX float32 reference, written independently of the kernel: each token's chosen
    experts applied one by one from the full weights."""
    h = h.astype(jnp.float32)
    gu = jnp.einsum("md,mkdcf->mkcf", h, gate_up.astype(jnp.float32)[experts], precision=lax.Precision.HIGHEST)
    act = jax.nn.silu(gu[..., 0, :]) * gu[..., 1, :]
    out = jnp.einsum("mkf,mkfd->mkd", act, down.astype(jnp.float32)[experts], precision=lax.Precision.HIGHEST)
    return jnp.sum(out * weights[..., None], axis=1)
