"""The mixture-of-experts router's kernels (pallas_kernels/router.py): its choices and weights
against a float32 reference in interpret mode on the CPU, with the product split every way,
lax.top_k's order among equal probabilities, a row's bits whatever the rows beside it, clear
errors, and ahead-of-time lowering for ROCm (gfx942) and CUDA (H200)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

from pallas_kernels.router import router_topk, router_topk_reference

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def tokens_and_router(m, d, e, dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal((m, d)), dtype),
            jnp.asarray(rng.standard_normal((d, e)) / np.sqrt(d), dtype))


@pytest.mark.parametrize("m, d, e, k, normalize, dtype", [
    (1, 64, 8, 2, True, jnp.float32),  # Mixtral's top-2 of 8 (padded to 16 columns)
    (5, 128, 128, 8, True, jnp.float32),  # Qwen3-30B-A3B's top-8 of 128
    (37, 256, 16, 3, False, jnp.bfloat16),  # three blocks of rows, k padded to 4
])
def test_the_router_kernel_matches_the_float32_reference(m, d, e, k, normalize, dtype):
    h, router = tokens_and_router(m, d, e, dtype)
    weights, experts = router_topk(h, router, k=k, normalize=normalize, interpret=True)
    want_weights, want_experts = router_topk_reference(h, router, k=k, normalize=normalize)
    assert weights.shape == (m, k) and weights.dtype == jnp.float32 and experts.dtype == jnp.int32
    np.testing.assert_array_equal(experts, want_experts)
    np.testing.assert_allclose(weights, want_weights, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("columns, splits", [(16, 1), (32, 4), (128, 1), (64, 8)])
def test_the_product_split_over_programs_changes_no_choice(columns, splits):
    h, router = tokens_and_router(6, 1024, 128, seed=2)
    weights, experts = router_topk(h, router, k=8, normalize=True, columns=columns, splits=splits, interpret=True)
    want_weights, want_experts = router_topk_reference(h, router, k=8, normalize=True)
    np.testing.assert_array_equal(experts, want_experts)
    np.testing.assert_allclose(weights, want_weights, rtol=1e-6, atol=1e-7)


def test_equal_probabilities_go_to_the_lower_experts_first_as_in_top_k():
    weights, experts = router_topk(jnp.ones((2, 32)), jnp.zeros((32, 8)), k=3, normalize=False, interpret=True)
    np.testing.assert_array_equal(experts, [[0, 1, 2]] * 2)
    np.testing.assert_allclose(weights, np.full((2, 3), 1 / 8), rtol=1e-7)


def test_a_token_gets_the_same_bits_alone_and_among_others():
    h, router = tokens_and_router(24, 256, 128, jnp.bfloat16, seed=4)
    batch = router_topk(h, router, k=8, normalize=True, interpret=True)
    for i in (0, 17, 23):
        alone = router_topk(h[i:i + 1], router, k=8, normalize=True, interpret=True)
        assert all(np.array_equal(a[0], b[i]) for a, b in zip(alone, batch))


@pytest.mark.parametrize("router, k, message", [
    (jnp.ones((32, 8)), 2, r"router must be \[d=64, E\]"),
    (jnp.ones((64, 8)), 9, "k must be between 1 and the expert count 8"),
    (jnp.ones((64, 8), jnp.bfloat16), 2, "router must be h's dtype float32"),
])
def test_bad_operands_are_refused_by_name(router, k, message):
    with pytest.raises(ValueError, match=message):
        router_topk(jnp.ones((3, 64)), router, k=k, normalize=True, interpret=True)


@pytest.mark.parametrize("splits", [3, 8])
def test_a_split_that_does_not_divide_d_is_refused(splits):
    with pytest.raises(ValueError, match=f"splits must be a power of two dividing d / block_k = 4; got {splits}"):
        router_topk(jnp.ones((3, 64)), jnp.ones((64, 8)), k=2, normalize=True, block_k=16, splits=splits,
                    interpret=True)


@pytest.mark.parametrize("platform, device_kind", [("rocm", "gfx942"), ("cuda", "NVIDIA H200")])
@pytest.mark.parametrize("d, e, k", [(2048, 128, 8), (4096, 8, 2)])  # Qwen3-30B-A3B, Mixtral-8x7B
def test_the_router_kernel_lowers_ahead_of_time(platform, device_kind, d, e, k):
    mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(device_kind, None, platform))
    with use_abstract_mesh(mesh):
        text = router_topk.trace(jax.ShapeDtypeStruct((4, d), jnp.bfloat16), jax.ShapeDtypeStruct((d, e), jnp.bfloat16),
                                 k=k, normalize=True).lower(lowering_platforms=(platform,)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 2 and "router_logits" in text and "router_choose" in text


@pytest.mark.parametrize("path, backend, tokens, kernel", [
    ("auto", "gpu", 1, True), ("auto", "gpu", 2, False), ("auto", "cpu", 1, False),
    ("kernel", "cpu", 8, True), ("xla", "gpu", 1, False)])
def test_the_engine_routes_one_token_through_the_kernels_by_default(monkeypatch, path, backend, tokens, kernel):
    """JAXSPEC_ROUTER's rule (forward.ROUTER_PATH): by default the kernels route one token on an
    accelerator (a decode step at batch 1, where they measured faster) and XLA's ops the rest."""
    from jaxspec.model import forward
    monkeypatch.setattr(forward, "ROUTER_PATH", path)
    monkeypatch.setattr(forward.jax, "default_backend", lambda: backend)
    assert forward._router_kernel(tokens) == kernel
