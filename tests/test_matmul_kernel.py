"""The weight matmul kernel (pallas_kernels/matmul.py): against a float32 reference in interpret
mode on the CPU for float, int8 and fp8 weights; the same bits for a row whatever the rows beside
it; clear errors; and ahead-of-time lowering for ROCm (gfx942) and CUDA (H200)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

from pallas_kernels.matmul import (BLOCK_M, DECODE_BLOCK_N, DOT_ROWS, MIN_PROGRAMS, _fp8_bits_to_f16, _weights_as,
                                   fused_reference, matmul, matmul_reference, row_blocks, rows_per_dot, tiling)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def weights(rng, k, n, fmt):
    """(w as the kernel takes it, scale [n] or None)."""
    if fmt == "int8":
        return jnp.asarray(rng.integers(-127, 128, (k, n)), jnp.int8), jnp.asarray(rng.uniform(1e-3, 1e-2, n), jnp.float32)
    if fmt == "fp8":
        w = jnp.asarray(rng.standard_normal((k, n)) * 8, jnp.float8_e4m3fn)
        return jax.lax.bitcast_convert_type(w, jnp.uint8), jnp.asarray(rng.uniform(1e-3, 1e-2, n), jnp.float32)
    return jnp.asarray(rng.standard_normal((k, n)) / 16, jnp.bfloat16), None


def test_fp8_bits_decode_to_every_e4m3fn_value():
    bits = jnp.arange(256, dtype=jnp.uint8)
    decoded = np.asarray(_fp8_bits_to_f16(bits).astype(jnp.float32)) * 2.0 ** 8
    exact = np.asarray(jax.lax.bitcast_convert_type(bits, jnp.float8_e4m3fn).astype(jnp.float32))
    finite = ~np.isnan(exact)
    assert finite.sum() == 254 and np.array_equal(decoded[finite], exact[finite])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_every_8bit_weight_becomes_its_exact_value_in_the_activations_dtype(dtype):
    """The kernel's conversions, for every int8 value and every finite fp8 bit pattern."""
    ints = jnp.arange(-128, 128, dtype=jnp.int32).astype(jnp.int8)
    got = np.asarray(_weights_as(ints, "int8", dtype).astype(jnp.float32))
    assert _weights_as(ints, "int8", dtype).dtype == dtype and np.array_equal(got, np.arange(-128, 128))
    bits = jnp.arange(256, dtype=jnp.uint8)
    got = np.asarray(_weights_as(bits, "fp8", dtype).astype(jnp.float32)) * 2.0 ** 8
    exact = np.asarray(jax.lax.bitcast_convert_type(bits, jnp.float8_e4m3fn).astype(jnp.float32))
    finite = ~np.isnan(exact)
    assert np.array_equal(got[finite], exact[finite])
    native = np.asarray(_weights_as(bits, "fp8", dtype, native_fp8=True).astype(jnp.float32))  # CUDA's cast
    assert np.array_equal(native[finite], exact[finite])


@pytest.mark.parametrize("fmt", ["float", "int8", "fp8"])
@pytest.mark.parametrize("m, k, n", [(1, 64, 32), (5, 384, 640), (20, 256, 128)])
def test_kernel_matches_the_float32_reference(fmt, m, k, n):
    rng = np.random.default_rng(m * k + n)
    w, scale = weights(rng, k, n, fmt)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    got = np.asarray(matmul(x, w, scale, fmt=fmt, interpret=True).astype(jnp.float32))
    want = np.asarray(matmul_reference(x, w, scale, fmt))
    # bf16 output: half a unit in its 8-bit significand, plus float32 sums of k terms.
    np.testing.assert_allclose(got, want, rtol=2.0 ** -8, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("fmt", ["float", "int8", "fp8"])
@pytest.mark.parametrize("split_k, w_nk", [(2, False), (4, True), (1, True)])
def test_split_sums_and_channels_first_weights_match_the_reference(fmt, split_k, w_nk):
    rng = np.random.default_rng(split_k)
    w, scale = weights(rng, 512, 128, fmt)
    x = jnp.asarray(rng.standard_normal((3, 512)), jnp.bfloat16)
    got = matmul(x, w.T if w_nk else w, scale, fmt=fmt, split_k=split_k, w_nk=w_nk, interpret=True)
    want = np.asarray(matmul_reference(x, w, scale, fmt))
    np.testing.assert_allclose(np.asarray(got.astype(jnp.float32)), want, rtol=2.0 ** -8, atol=1e-5 * np.abs(want).max())


def test_default_tiles_split_k_only_where_n_gives_too_few_programs():
    assert tiling(4096, 28672) == (128, 1)  # 448 tiles of 64 columns already
    assert tiling(4096, 6144) == (128, 4)  # 96 tiles -> 384 programs
    assert tiling(4096, 4096) == (128, 8)  # at most 8 splits
    assert tiling(64, 64) == (16, 4)  # never below the 16-wide dot tile
    block_k, split = tiling(14336, 4096)
    assert 4096 // DECODE_BLOCK_N * split >= MIN_PROGRAMS and (14336 // split) % block_k == 0


def test_rows_per_dot_grow_with_the_rows_up_to_the_platforms_most():
    assert [rows_per_dot(m, 64) for m in (1, 16, 17, 33, 64, 300)] == [16, 16, 32, 64, 64, 64]
    assert rows_per_dot(300) == 16 and DOT_ROWS.get("rocm", BLOCK_M) == BLOCK_M


def test_float32_inputs_are_summed_in_float32():
    rng = np.random.default_rng(1)
    x, w = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((3, 128), (128, 64)))
    np.testing.assert_allclose(matmul(x, w, interpret=True), matmul_reference(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["float", "int8", "fp8"])
def test_a_row_gives_the_same_bits_alone_and_beside_any_other_rows(fmt):
    """Alone, in a batch of 5 with other neighbours, and as row 9 of a verify-sized 17."""
    rng = np.random.default_rng(7)
    w, scale = weights(rng, 256, 128, fmt)
    row = jnp.asarray(rng.standard_normal((1, 256)), jnp.bfloat16)
    assert tiling(256, 128)[1] > 1  # split sums too
    alone = matmul(row, w, scale, fmt=fmt, interpret=True)
    for rows, at in ((5, 3), (17, 9)):
        others = jnp.asarray(rng.standard_normal((rows, 256)) * 4, jnp.bfloat16)
        batch = others.at[at].set(row[0])
        assert np.array_equal(np.asarray(matmul(batch, w, scale, fmt=fmt, interpret=True)[at]), np.asarray(alone[0]))


@pytest.mark.parametrize("fmt", ["float", "int8"])
def test_row_blocks_per_program_never_change_a_rows_bits(fmt):
    """A row alone (one row block a program) equals the same row among 70 (four a program), or
    with two a program."""
    rng = np.random.default_rng(5)
    w, scale = weights(rng, 256, 128, fmt)
    batch = jnp.asarray(rng.standard_normal((70, 256)), jnp.bfloat16)
    alone = matmul(batch[33:34], w, scale, fmt=fmt, interpret=True)
    assert row_blocks(1) == 1 and row_blocks(70) == 4 and row_blocks(70, 32) == 2 and row_blocks(70, 64) == 1
    for subs in (None, 2):
        got = matmul(batch, w, scale, fmt=fmt, subs=subs, interpret=True)
        assert np.array_equal(np.asarray(got[33]), np.asarray(alone[0]))


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("m, split_k, fusions", [(1, 1, "gated"), (20, 2, "gated"), (5, 1, "residual"),
                                                 (1, 2, "residual")])
def test_fusions_match_the_float32_reference(fmt, m, split_k, fusions):
    """The gate/up product and the residual (pallas_kernels/fused.py), whole or in k splits, over
    one or two row blocks."""
    rng = np.random.default_rng(m * 10 + split_k)
    gated = fusions == "gated"
    w, scale = weights(rng, 256, 64 if gated else 32, fmt)
    w = w.T  # channels first: [n, k]
    residual = jnp.asarray(rng.standard_normal((m, 32)), jnp.float32) if fusions == "residual" else None
    x = jnp.asarray(rng.standard_normal((m, 256)), jnp.float32)
    got = matmul(x, w, scale, residual, fmt=fmt, w_nk=True, gated=gated, split_k=split_k, block_n=16, interpret=True)
    want = fused_reference(x, w, scale, fmt, residual=residual, gated=gated)
    assert got.shape == (m, 32)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))


@pytest.mark.parametrize("args, kwargs, message", [
    ((jnp.ones((2, 64), jnp.bfloat16), jnp.ones((64, 32), jnp.int8)), {"fmt": "int8", "gated": True},
     r"w as \[n, k\] \(w_nk\) only"),
    ((jnp.ones((2, 64), jnp.bfloat16), jnp.ones((32, 64), jnp.int8), None, jnp.ones((2, 16))),
     {"fmt": "int8", "w_nk": True}, r"residual must be \[m=2, n=32\]"),
    ((jnp.ones((2, 64), jnp.bfloat16), jnp.ones((64, 32), jnp.int8)), {"fmt": "int4"}, "fmt must be one of"),
    ((jnp.ones((2, 64), jnp.bfloat16), jnp.ones((64, 32), jnp.bfloat16)), {"fmt": "int8"}, "must be int8"),
    ((jnp.ones((2, 64), jnp.bfloat16), jnp.ones((32, 32), jnp.bfloat16)), {}, r"w must be \[k=64, n\]"),
    ((jnp.ones((2, 72), jnp.bfloat16), jnp.ones((72, 32), jnp.bfloat16)), {}, "k 72 must be a multiple of 16"),
])
def test_bad_operands_are_refused_by_name(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        matmul(*args, interpret=True, **kwargs)


@pytest.mark.parametrize("platform, device_kind", [("rocm", "gfx942"), ("cuda", "NVIDIA H200")])
@pytest.mark.parametrize("fmt, rows, fused", [("float", 4, False), ("int8", 4, False), ("fp8", 4, False),
                                              ("float", 64, False), ("int8", 40, False), ("int8", 4, True)])
def test_kernel_lowers_ahead_of_time(platform, device_kind, fmt, rows, fused):
    """No GPU needed: the kernel lowers to a Triton custom call for MI300X (ROCm) and H200, with
    each platform's rows per dot (64 and 16 at 64 rows); fused: as gate/up runs, with its product."""
    mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(device_kind, None, platform))
    w_dtype = {"int8": jnp.int8, "fp8": jnp.uint8}.get(fmt, jnp.bfloat16)
    args = (jax.ShapeDtypeStruct((rows, 4096), jnp.bfloat16),
            jax.ShapeDtypeStruct((6144, 4096) if fused else (4096, 6144), w_dtype),
            jax.ShapeDtypeStruct((6144,), jnp.float32))
    with use_abstract_mesh(mesh):
        lowered = matmul.trace(*args, fmt=fmt, w_nk=fused, gated=fused).lower(lowering_platforms=(platform,))
    text = lowered.as_text()
    assert "__gpu$xla.gpu.triton" in text and f"matmul_{fmt}" in text


def _triton_ir(platform: str, device_kind: str, rows: int, fmt: str = "float") -> str:
    mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(device_kind, None, platform))
    w_dtype = {"int8": jnp.int8, "fp8": jnp.uint8}.get(fmt, jnp.bfloat16)
    args = (jax.ShapeDtypeStruct((rows, 4096), jnp.bfloat16), jax.ShapeDtypeStruct((4096, 6144), w_dtype))
    with use_abstract_mesh(mesh):
        text = matmul.trace(*args, fmt=fmt).lower(lowering_platforms=(platform,)).as_text()
    (ir,) = re.findall(r'ir = "(.*?)"', text)
    return ir


def test_rows_per_dot_follow_the_platform_the_kernel_is_lowered_for():
    """At 4 rows both platforms get the same kernel (16-row dots); at 64, CUDA's (one 64-row dot)
    differs from ROCm's (four 16-row dots)."""
    assert _triton_ir("rocm", "gfx942", 4) == _triton_ir("cuda", "NVIDIA H200", 4)
    assert _triton_ir("rocm", "gfx942", 64) != _triton_ir("cuda", "NVIDIA H200", 64)


def test_fp8_weights_take_cudas_own_conversion_there_and_the_bit_decode_on_rocm():
    """At 4 rows the platforms' int8 kernels are one; their fp8 kernels differ (NATIVE_FP8)."""
    assert _triton_ir("rocm", "gfx942", 4, "int8") == _triton_ir("cuda", "NVIDIA H200", 4, "int8")
    assert _triton_ir("rocm", "gfx942", 4, "fp8") != _triton_ir("cuda", "NVIDIA H200", 4, "fp8")
