"""The Pallas tree-attention kernel against its independent float32 reference (interpret mode on
the CPU, compiled on a GPU when one is present), and ahead-of-time lowering for ROCm and CUDA."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

from jaxspec.decoding.trees import ancestor_mask, balanced_tree, chain
from pallas_kernels.tree_attention import tree_attention, tree_attention_reference

ON_GPU = jax.default_backend() == "gpu"
# Relative error bounds (METHOD.md): float32 arithmetic lands far under 1e-3 (the kernel asks
# for IEEE float32 dots, on GPUs too); bf16 operands between 1e-3 and 1e-2.
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


def random_tree(rng, t: int) -> tuple[int, ...]:
    return (-1,) + tuple(int(rng.integers(0, i)) for i in range(1, t))


def rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert np.all(np.isfinite(out)), "NaN or inf in the kernel output"
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def make_inputs(rng, b, t, h, n, d, s, lengths, dtype):
    f = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)  # noqa: E731
    return f(b, t, h, d), f(b, s, n, d), f(b, s, n, d), f(b, t, n, d), f(b, t, n, d), jnp.asarray(lengths, jnp.int32)


CASES = [  # b, t, h, n, d, s, lengths, tree, num_splits
    (1, 1, 4, 4, 64, 64, [37], "chain", 1),  # one node, MHA
    (2, 5, 8, 2, 64, 128, [100, 0], "chain", 2),  # ragged and empty prefix, GQA 4
    (3, 8, 8, 1, 128, 256, [256, 65, 1], "balanced", 4),  # MQA, head dim 128, full prefix
    (2, 11, 16, 4, 64, 192, [0, 0], "random", 3),  # no prefix at all: tree only
    (2, 24, 8, 2, 128, 128, [64, 127], "random", None),  # rows > one block, split heuristic
    (1, 15, 32, 8, 128, 512, [300], "balanced", 4),  # 8B-shaped heads, partial merge chunks
    (2, 64, 8, 2, 64, 256, [256, 3], "random", 2),  # 64 nodes: one head per program
    (1, 3, 8, 1, 64, 128, [128], "chain", 2),  # fewer nodes than one merge block
    (2, 6, 12, 4, 64, 256, [200, 17], "random", 4),  # 3 heads per kv head: one head per program
]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=[f"b{c[0]}-t{c[1]}-h{c[2]}-n{c[3]}-d{c[4]}-s{c[5]}-{c[7]}" for c in CASES])
def test_kernel_matches_reference(case, dtype):
    b, t, h, n, d, s, lengths, tree, splits = case
    rng = np.random.default_rng(abs(hash((case[:6], str(dtype)))) % 2**32)
    parents = {"chain": chain(t - 1), "balanced": balanced_tree(2, 3)[:t], "random": random_tree(rng, t)}[tree]
    mask = ancestor_mask(parents)
    args = make_inputs(rng, b, t, h, n, d, s, lengths, dtype)
    out = tree_attention(*args, mask, num_splits=splits, block_rows=32, interpret=not ON_GPU)
    ref = tree_attention_reference(*args, mask)
    assert out.shape == (b, t, h, d) and out.dtype == dtype
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("block_k, splits", [(128, 2), (256, 1), (256, 4)])
def test_longer_key_steps_match_reference(block_k, splits):
    """block_k > 64 (GPUs with shared memory to spare); a split shorter than it steps by less."""
    rng = np.random.default_rng(block_k + splits)
    args = make_inputs(rng, 2, 9, 8, 2, 64, 512, [500, 130], jnp.float32)
    mask = ancestor_mask(random_tree(rng, 9))
    out = tree_attention(*args, mask, block_k=block_k, num_splits=splits, interpret=not ON_GPU)
    assert rel_err(out, tree_attention_reference(*args, mask)) < TOL[jnp.float32]


FUSED_CASES = [  # b, t, g, n, d, s, lengths, num_splits
    (2, 1, 4, 2, 64, 128, [5, 127], 1),  # decode; one row's slot is the cache's last
    (3, 6, 4, 2, 64, 128, [0, 60, 125], 2),  # a chain past the end: its last slots are dropped
    (1, 9, 2, 4, 128, 256, [200], None),  # split heuristic
]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", FUSED_CASES, ids=[f"b{c[0]}-t{c[1]}-g{c[2]}-s{c[5]}" for c in FUSED_CASES])
def test_fused_operands_and_cache_writes(case, dtype):
    """q, k and v read from one fused [b, t, n, g + 2, d] array (what the engine's projection
    gives), and the chunk's keys and values written into the caches in place: the output matches
    the reference on the sliced operands, and the caches equal a scatter that drops slots past
    the end, every other slot untouched."""
    b, t, g, n, d, s, lengths, splits = case
    rng = np.random.default_rng(sum(case[:6]))
    f = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)  # noqa: E731
    qkv, kc, vc = f(b, t, n, g + 2, d), f(b, s, n, d), f(b, s, n, d)
    lengths = jnp.asarray(lengths, jnp.int32)
    mask = ancestor_mask(random_tree(rng, t))
    out, k_out, v_out = tree_attention(qkv, kc, vc, qkv, qkv, lengths, mask, groups=g, k_index=g, v_index=g + 1,
                                       write_cache=True, num_splits=splits, interpret=not ON_GPU)
    q, k, v = qkv[:, :, :, :g].reshape(b, t, n * g, d), qkv[:, :, :, g], qkv[:, :, :, g + 1]
    assert out.shape == (b, t, n * g, d) and out.dtype == dtype
    assert rel_err(out, tree_attention_reference(q, kc, vc, k, v, lengths, mask)) < TOL[dtype]
    slots = np.asarray(lengths)[:, None] + np.arange(t)
    for cache, new, written in ((kc, k, k_out), (vc, v, v_out)):
        expected = np.array(cache)
        for row in range(b):
            kept = slots[row] < s
            expected[row, slots[row][kept]] = np.asarray(new)[row, kept]
        np.testing.assert_array_equal(np.asarray(written), expected)


def test_fused_operands_out_of_range_are_refused():
    rng = np.random.default_rng(1)
    qkv = jnp.asarray(rng.normal(size=(1, 2, 2, 3, 64)), jnp.float32)
    cache = jnp.zeros((1, 64, 2, 64), jnp.float32)
    with pytest.raises(ValueError, match="v_index=3 must lie inside"):
        tree_attention(qkv, cache, cache, qkv, qkv, jnp.array([4]), ancestor_mask(chain(1)), groups=1, k_index=1,
                       v_index=3, interpret=True)


def test_reference_is_ordinary_causal_attention_for_a_chain():
    """Sanity of the reference itself: a chain tree over an empty prefix is causal attention."""
    rng = np.random.default_rng(7)
    q, kc, vc, tk, tv, _ = make_inputs(rng, 1, 6, 2, 2, 16, 16, [0], jnp.float32)
    ref = tree_attention_reference(q, kc, vc, tk, tv, jnp.array([0]), ancestor_mask(chain(5)))
    hi = jax.lax.Precision.HIGHEST  # full float32 on GPUs too (their default is tf32)
    logits = jnp.einsum("bthd,bshd->bhts", q, tk, precision=hi) / 4.0
    logits = jnp.where(jnp.tril(jnp.ones((6, 6), bool)), logits, -jnp.inf)
    expected = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(logits, -1), tv, precision=hi)
    assert rel_err(ref, expected) < 1e-6


def test_bad_cache_length_is_refused():
    rng = np.random.default_rng(0)
    args = make_inputs(rng, 1, 2, 2, 2, 64, 100, [10], jnp.float32)
    with pytest.raises(ValueError, match="cache length 100 must be a multiple of 64"):
        tree_attention(*args, ancestor_mask(chain(1)), interpret=True)


@pytest.mark.parametrize("platform, device_kind", [("rocm", "gfx942"), ("cuda", "NVIDIA H200")])
@pytest.mark.parametrize("d, fused", [(64, False), (128, False), (128, True)], ids=["d64", "d128", "d128-fused"])
def test_kernel_lowers_ahead_of_time(platform, device_kind, d, fused):
    """No GPU needed: the kernel lowers to a Triton custom call for MI300X (ROCm) and H200, also
    reading a fused q/k/v array and writing the caches (the engine's form)."""
    b, t, h, n, s = 1, 16, 32, 8, 512
    mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(device_kind, None, platform))
    bf16 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)  # noqa: E731
    lengths, mask = jax.ShapeDtypeStruct((b,), jnp.int32), jax.ShapeDtypeStruct((t, t), jnp.bool_)
    if fused:
        g = h // n
        qkv = bf16(b, t, n, g + 2, d)
        args = (qkv, bf16(b, s, n, d), bf16(b, s, n, d), qkv, qkv, lengths, mask)
        kw = dict(groups=g, k_index=g, v_index=g + 1, write_cache=True)
    else:
        args = (bf16(b, t, h, d), bf16(b, s, n, d), bf16(b, s, n, d), bf16(b, t, n, d), bf16(b, t, n, d), lengths, mask)
        kw = {}
    with use_abstract_mesh(mesh):
        lowered = tree_attention.trace(*args, num_warps=4, num_stages=1, **kw).lower(lowering_platforms=(platform,))
    text = lowered.as_text()
    assert "__gpu$xla.gpu.triton" in text
    assert "tree_attention" in text


def test_engine_with_the_kernel_matches_the_xla_path(tmp_path):
    """Decoding and speculative verification through the fused kernel (interpret mode on the
    CPU) give the same greedy tokens as the XLA attention path."""
    from tiny_models import TINY, save_tiny

    import jaxspec

    kind, overrides = TINY["llama_gqa"]
    target = jaxspec.load(save_tiny(tmp_path / "t", kind, overrides, seed=1), dtype="float32")
    draft = jaxspec.load(save_tiny(tmp_path / "d", kind, {**overrides, "num_hidden_layers": 1}, seed=2),
                         dtype="float32")
    prompts = [[5, 9, 33, 7], list(range(3, 40))]
    for d in (None, target, draft):
        xla = jaxspec.generate(prompts, target, d, max_new_tokens=12, num_draft_tokens=3, attention="xla")
        fused = jaxspec.generate(prompts, target, d, max_new_tokens=12, num_draft_tokens=3, attention="pallas")
        assert [o.token_ids for o in fused] == [o.token_ids for o in xla]


def test_unknown_attention_is_refused():
    import jaxspec
    from jaxspec.defaults import CHECKPOINTS

    model = jaxspec.load(CHECKPOINTS / "hf" / "code-draft-4m", dtype="float32")
    with pytest.raises(jaxspec.InputError, match="attention must be one of auto, xla, pallas"):
        jaxspec.generate(["x"], model, attention="flash")
