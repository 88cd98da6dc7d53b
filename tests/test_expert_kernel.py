"""The grouped expert kernel (pallas_kernels/experts.py): the grouped layout against a direct
count; the experts' MLP (float, int8 and fp8 experts) against a float32 reference in interpret
mode on the CPU; a token's bits whatever the tokens beside it; experts split over devices adding
up to the whole; clear errors; and ahead-of-time lowering for ROCm (gfx942) and CUDA (H200)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

from jaxspec.model.quantize import dequantize, quantize
from pallas_kernels.experts import expert_matmul, experts_mlp, experts_mlp_reference, group_pairs
from pallas_kernels.matmul import BLOCK_M

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def routed(rng, m, e, k, d, f, dtype=jnp.float32):
    """Tokens, each with k distinct experts of e and their weights, and the experts' weights."""
    h = jnp.asarray(rng.standard_normal((m, d)), dtype)
    experts = jnp.asarray(np.stack([rng.permutation(e)[:k] for _ in range(m)]), jnp.int32)
    weights = jnp.asarray(rng.dirichlet(np.ones(k), m), jnp.float32)
    gate_up = jnp.asarray(rng.standard_normal((e, d, 2, f)) / np.sqrt(d), dtype)
    down = jnp.asarray(rng.standard_normal((e, f, d)) / np.sqrt(f), dtype)
    return h, experts, weights, gate_up, down


@pytest.mark.parametrize("method", ["compare", "sort"])
@pytest.mark.parametrize("pairs, e", [(1, 8), (8, 128), (40, 4), (37, 8)])
def test_the_grouped_layout_gives_each_block_one_expert_and_each_pair_its_own_row(pairs, e, method):
    """Either way of computing it (comparing every pair with every other, or sorting them) gives
    the same layout: each expert's pairs in pair order from a block of their own."""
    rng = np.random.default_rng(pairs + e)
    experts = rng.integers(-2, e + 2, pairs)  # some out of range: another device's
    slot, block_expert = map(np.asarray, group_pairs(jnp.asarray(experts, jnp.int32), e, method=method))
    rows = len(block_expert) * BLOCK_M
    kept = (experts >= 0) & (experts < e)
    assert len(block_expert) == pairs // BLOCK_M + min(e, pairs)
    assert np.all(slot[~kept] >= rows) and len(set(slot[kept])) == kept.sum()
    assert np.array_equal(block_expert[slot[kept] // BLOCK_M], experts[kept])
    counts = np.bincount(experts[kept], minlength=e)
    used = block_expert[block_expert >= 0]
    assert np.array_equal(np.bincount(used, minlength=e), -(-counts // BLOCK_M))  # whole blocks, fewest
    assert np.all(block_expert[len(used):] == -1) and np.all(np.diff(used) >= 0)
    for j in range(e):  # in pair order within an expert, from the start of its first block
        rows = slot[experts == j]
        assert np.array_equal(rows, rows[0] + np.arange(len(rows))) if len(rows) else True
        assert not len(rows) or rows[0] % BLOCK_M == 0


# (1 and up to 16 tokens: few_tokens_layout, 16 of 4 experts choosing each many times; 37: grouped)
@pytest.mark.parametrize("m, e, k", [(1, 8, 2), (4, 16, 4), (16, 4, 2), (37, 4, 2)])
def test_the_experts_mlp_matches_the_float32_reference(m, e, k):
    rng = np.random.default_rng(m * e + k)
    h, experts, weights, gate_up, down = routed(rng, m, e, k, d=64, f=32)
    got = experts_mlp(h, experts, weights, gate_up, down, interpret=True)
    want = experts_mlp_reference(h, experts, weights, gate_up, down)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))


def eight_bit(gate_up, down, fmt):
    """The experts in `fmt` as the engine keeps them (Quantized: channels first, each expert's
    own per-channel scales), and the float32 weights they stand for."""
    q = quantize(gate_up, 1, fmt, lead=1), quantize(down, 1, fmt, lead=1)
    return q, tuple(dequantize(w) for w in q)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("m, e, k", [(1, 8, 2), (5, 4, 2), (37, 4, 2)])
def test_8bit_experts_match_the_float32_reference_of_their_dequantized_weights(fmt, m, e, k):
    """Gated (gate/up) and plain (down) 8-bit kernels, scales in the epilogue, against the float32
    reference on the weights they stand for; the matmul kernel's fused-epilogue tolerance."""
    rng = np.random.default_rng(m * e + k + len(fmt))
    h, experts, weights, gate_up, down = routed(rng, m, e, k, d=64, f=32)
    (gu, dn), (gate_up, down) = eight_bit(gate_up, down, fmt)
    assert gu.values.shape == (e, 2, 32, 64) and gu.scale.shape == (e, 2, 32) and dn.scale.shape == (e, 64)
    got = experts_mlp(h, experts, weights, gu.values, dn.values, fmt=fmt, gate_up_scale=gu.scale,
                      down_scale=dn.scale, interpret=True)
    want = experts_mlp_reference(h, experts, weights, gate_up, down)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))


def test_bf16_experts_round_as_the_gated_mlp_does():
    """bf16 in, float32 sums: within bf16's rounding of the gate, up and product of the reference."""
    rng = np.random.default_rng(3)
    h, experts, weights, gate_up, down = routed(rng, 6, 8, 2, d=128, f=64, dtype=jnp.bfloat16)
    got = np.asarray(experts_mlp(h, experts, weights, gate_up, down, interpret=True))
    want = np.asarray(experts_mlp_reference(h, experts, weights, gate_up, down))
    np.testing.assert_allclose(got, want, rtol=0, atol=2 ** -6 * np.abs(want).max())


@pytest.mark.parametrize("fmt", ["float", "int8", "fp8"])
def test_a_token_gives_the_same_bits_alone_and_among_others(fmt):
    rng = np.random.default_rng(5)
    h, experts, weights, gate_up, down = routed(rng, 24, 8, 2, d=64, f=32, dtype=jnp.bfloat16)
    kw = dict(interpret=True)
    if fmt != "float":
        (gu, dn), _ = eight_bit(gate_up, down, fmt)
        gate_up, down = gu.values, dn.values
        kw |= dict(fmt=fmt, gate_up_scale=gu.scale, down_scale=dn.scale)
    batch = np.asarray(experts_mlp(h, experts, weights, gate_up, down, **kw))  # the grouped layout
    for i in (0, 13, 23):
        alone = np.asarray(experts_mlp(h[i:i + 1], experts[i:i + 1], weights[i:i + 1], gate_up, down, **kw))
        assert np.array_equal(alone[0], batch[i])
    few = slice(3, 8)  # five tokens: few_tokens_layout, and the grouped layout forced
    for grouped in (False, True):
        got = experts_mlp(h[few], experts[few], weights[few], gate_up, down, grouped=grouped, **kw)
        assert np.array_equal(np.asarray(got), batch[few])


@pytest.mark.parametrize("m", [1, 5, 20])  # few_tokens_layout (one token: a block per pair); grouped
def test_experts_split_over_devices_add_up_to_the_whole(m):
    """Expert parallelism: each device's experts (first_expert on) give the pairs routed to them,
    the others nothing; the shares add up to all experts' output."""
    rng = np.random.default_rng(7)
    h, experts, weights, gate_up, down = routed(rng, m, 8, 2, d=64, f=32)
    whole = experts_mlp(h, experts, weights, gate_up, down, interpret=True)
    shares = [experts_mlp(h, experts, weights, gate_up[i:i + 4], down[i:i + 4], first_expert=i, interpret=True)
              for i in (0, 4)]
    np.testing.assert_allclose(np.asarray(shares[0] + shares[1]), np.asarray(whole), rtol=1e-6, atol=1e-6)


def test_one_tokens_experts_over_devices_holding_fewer_than_it_chooses():
    """Expert parallelism where each device holds 2 of 8 experts, fewer than a token's 4 choices:
    its blocks are then the distinct experts it holds, not the token's pairs; the shares still add
    up to the whole."""
    h, experts, weights, gate_up, down = routed(np.random.default_rng(8), 1, 8, 4, d=64, f=32)
    whole = experts_mlp(h, experts, weights, gate_up, down, interpret=True)
    shares = [experts_mlp(h, experts, weights, gate_up[i:i + 2], down[i:i + 2], first_expert=i, interpret=True)
              for i in range(0, 8, 2)]
    np.testing.assert_allclose(np.asarray(sum(shares)), np.asarray(whole), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("args, kwargs, message", [
    ((jnp.ones((16, 64)), jnp.ones((4, 32, 32)), jnp.zeros((1,), jnp.int32)), {}, r"w must be \[E, k=64, n\]"),
    ((jnp.ones((16, 64)), jnp.ones((4, 64, 32)), jnp.zeros((1,), jnp.int32)), {"gated": True},
     r"w must be \[E, k=64, 2, n\]"),
    ((jnp.ones((20, 64)), jnp.ones((4, 64, 32)), jnp.zeros((1,), jnp.int32)), {}, "whole blocks of 16 rows"),
    ((jnp.ones((16, 64)), jnp.ones((4, 64, 32), jnp.bfloat16), jnp.zeros((1,), jnp.int32)), {}, "must be x's dtype"),
    ((jnp.ones((16, 64)), jnp.ones((4, 32, 64), jnp.int8), jnp.zeros((1,), jnp.int32)), {"fmt": "fp8", "w_nk": True},
     "w must be for fmt 'fp8' uint8; got int8"),
    ((jnp.ones((16, 64)), jnp.ones((4, 64, 32), jnp.int8), jnp.zeros((1,), jnp.int32)), {"fmt": "int8", "w_nk": True},
     r"w must be \[E, n, k=64\]"),
    ((jnp.ones((16, 64)), jnp.ones((4, 2, 32, 64), jnp.int8), jnp.zeros((1,), jnp.int32), jnp.ones((4, 32))),
     {"fmt": "int8", "w_nk": True, "gated": True}, r"scale must be \[E, 2, n=32\] float32; got \[4, 32\]"),
    ((jnp.ones((16, 64)), jnp.ones((4, 64, 32)), jnp.zeros((1,), jnp.int32)), {"fmt": "int4"}, "fmt must be one of"),
    ((jnp.ones((32, 64)), jnp.ones((4, 64, 32)), jnp.zeros((5,), jnp.int32)), {"shared_x": True},
     "with shared_x: x must be at most 16 rows"),
])
def test_bad_operands_are_refused_by_name(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        expert_matmul(*args, interpret=True, **kwargs)


@pytest.mark.parametrize("platform, device_kind", [("rocm", "gfx942"), ("cuda", "NVIDIA H200")])
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("fmt", ["float", "int8", "fp8"])
def test_kernel_lowers_ahead_of_time(platform, device_kind, gated, fmt):
    """No GPU needed: the kernel lowers to a Triton custom call for MI300X (ROCm) and H200, at
    Qwen3-30B-A3B's expert shapes (d 2048, f 768, 128 experts; a verify pass of 4 tokens: the
    gated product with their one shared block, the down product a block per pair); 8-bit experts
    channels first with their scales."""
    mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(device_kind, None, platform))
    blocks = 32
    k, n = (2048, 768) if gated else (768, 2048)
    pair = (2,) if gated else ()
    if fmt == "float":
        w, scale, kw = jax.ShapeDtypeStruct((128, k, *pair, n), jnp.bfloat16), None, {}
    else:
        w = jax.ShapeDtypeStruct((128, *pair, n, k), {"int8": jnp.int8, "fp8": jnp.uint8}[fmt])
        scale, kw = jax.ShapeDtypeStruct((128, *pair, n), jnp.float32), dict(fmt=fmt, w_nk=True)
    rows = 4 if gated else blocks * BLOCK_M  # (the 4 tokens read as one block, the rest masked)
    args = (jax.ShapeDtypeStruct((rows, k), jnp.bfloat16), w, jax.ShapeDtypeStruct((blocks,), jnp.int32), scale)
    with use_abstract_mesh(mesh):
        lowered = expert_matmul.trace(*args, gated=gated, shared_x=gated, **kw).lower(lowering_platforms=(platform,))
    text = lowered.as_text()
    name = ("expert_matmul_gated" if gated else "expert_matmul") + ("" if fmt == "float" else f"_{fmt}")
    assert "__gpu$xla.gpu.triton" in text and name in text


@pytest.mark.parametrize("t", [4, 32])
def test_the_experts_mlp_lowers_for_a_gpu_without_loops(t):
    """Grouping the pairs (ranks, counts, each block's expert) is straight-line code: a loop on a
    GPU runs its body as a launch per step, in every layer of every decode step (searchsorted's
    default binary search was one). A few pairs are ranked by comparison: no sort. A verify
    pass's few tokens (4) are not even scattered into blocks: one block holds them all."""
    mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice("NVIDIA H200", None, "cuda"))
    k, e, d, f = 8, 128, 2048, 768
    args = (jax.ShapeDtypeStruct((t, d), jnp.bfloat16), jax.ShapeDtypeStruct((t, k), jnp.int32),
            jax.ShapeDtypeStruct((t, k), jnp.float32), jax.ShapeDtypeStruct((e, d, 2, f), jnp.bfloat16),
            jax.ShapeDtypeStruct((e, f, d), jnp.bfloat16))
    with use_abstract_mesh(mesh):
        text = jax.jit(experts_mlp).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 2 and "stablehlo.while" not in text and "stablehlo.sort" not in text
    assert ("stablehlo.scatter" in text) == (t > BLOCK_M)


def test_one_tokens_experts_lower_for_a_gpu_without_grouping_scatter_or_gather():
    """A decode step at batch 1: its k pairs take a block each, x is the token itself (the
    block's other rows masked) and each output the first row of its block, so nothing is
    computed or moved but the two kernels' work (the grouped layout's counts, scatter and gather
    were kernels of their own; then a pad of x, and a select marking the choices held here,
    which with every expert held here are all of them)."""
    mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice("NVIDIA H200", None, "cuda"))
    k, e, d, f = 8, 128, 2048, 768
    args = (jax.ShapeDtypeStruct((1, d), jnp.bfloat16), jax.ShapeDtypeStruct((1, k), jnp.int32),
            jax.ShapeDtypeStruct((1, k), jnp.float32), jax.ShapeDtypeStruct((e, d, 2, f), jnp.bfloat16),
            jax.ShapeDtypeStruct((e, f, d), jnp.bfloat16))
    with use_abstract_mesh(mesh):
        text = jax.jit(experts_mlp).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 2
    assert not any(op in text for op in ("stablehlo.scatter", "stablehlo.gather", "stablehlo.while", "stablehlo.sort",
                                         "stablehlo.pad", "stablehlo.select"))


def test_the_column_tile_changes_no_bits():
    """block_n only picks which columns a program sums (each row's sums run down k in block_k
    steps whatever it is), so the platform's column tile, or a sweep of them, changes no bit."""
    h, experts, _, gate_up, _ = routed(np.random.default_rng(3), 1, 4, 2, d=64, f=64, dtype=jnp.bfloat16)
    x = jnp.pad(h, ((0, BLOCK_M - 1), (0, 0)))
    narrow, wide = (np.asarray(expert_matmul(x, gate_up, experts[0, :1], gated=True, block_n=n, interpret=True))
                    for n in (16, 64))
    assert np.array_equal(narrow, wide)
