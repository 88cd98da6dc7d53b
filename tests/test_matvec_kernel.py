"""The one-row 8-bit kernel (pallas_kernels/matvec.py): against the float32 reference in interpret
mode on the CPU, its exact conversions, clear errors, and ahead-of-time lowering for ROCm (gfx942)
and CUDA (H200), whose fp8 weights take the GPU's own conversion."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

from pallas_kernels.matmul import fused_reference
from pallas_kernels.matvec import INT8_PTX, MAX_ROWS, _to_f32, default_block_k, matvec, matvec_reference

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def weights(rng, n, k, fmt):
    """(w [n, k] as the kernel takes it, scale [n])."""
    scale = jnp.asarray(rng.uniform(1e-3, 1e-2, n), jnp.float32)
    if fmt == "int8":
        return jnp.asarray(rng.integers(-128, 128, (n, k)), jnp.int8), scale
    w = jnp.asarray(rng.standard_normal((n, k)) * 8, jnp.float8_e4m3fn)
    return jax.lax.bitcast_convert_type(w, jnp.uint8), scale


def test_every_8bit_weight_becomes_its_exact_float32_value():
    """int8 through the 2^23 + 128 bit trick; fp8 through the bit decode (the value / 2^8) and
    through the fp8 cast (the value) alike."""
    ints = jnp.arange(-128, 128, dtype=jnp.int32).astype(jnp.int8)
    assert np.array_equal(np.asarray(_to_f32(ints, "int8", False)), np.arange(-128, 128))
    bits = jnp.arange(256, dtype=jnp.uint8)
    exact = np.asarray(jax.lax.bitcast_convert_type(bits, jnp.float8_e4m3fn).astype(jnp.float32))
    finite = ~np.isnan(exact)
    assert np.array_equal((np.asarray(_to_f32(bits, "fp8", False)) * 2.0 ** 8)[finite], exact[finite])
    assert np.array_equal(np.asarray(_to_f32(bits, "fp8", True))[finite], exact[finite])


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("m, n, k, split_k, block_k", [(1, 48, 256, 1, 64), (3, 40, 256, 2, 64), (4, 37, 128, 1, None)])
def test_kernel_matches_the_float32_reference(fmt, m, n, k, split_k, block_k):
    """Rows up to MAX_ROWS, k splits, a column count no power of two divides (37: one-column tiles)."""
    rng = np.random.default_rng(m * 100 + n)
    w, scale = weights(rng, n, k, fmt)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    got = matvec(x, w, scale, fmt=fmt, block_n=16, block_k=block_k, split_k=split_k, interpret=True)
    want = matvec_reference(x, w, scale, fmt)
    assert got.shape == (m, n) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))


def test_bf16_activations_give_bf16_rows_of_the_reference():
    rng = np.random.default_rng(7)
    w, scale = weights(rng, 64, 512, "fp8")
    x = jnp.asarray(rng.standard_normal((1, 512)), jnp.bfloat16)
    got = matvec(x, w, scale, fmt="fp8", interpret=True)
    want = matvec_reference(x, w, scale, "fp8").astype(jnp.bfloat16)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=1e-2)


def fusion_operands(rng, m, n, k, fusions):
    """(norm [k] or None, residual [m, n] or None, gated) for a fusions string like "norm+gated"."""
    norm = jnp.asarray(rng.uniform(0.5, 1.5, k), jnp.float32) if "norm" in fusions else None
    residual = jnp.asarray(rng.standard_normal((m, n)), jnp.float32) if "residual" in fusions else None
    return norm, residual, "gated" in fusions


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("m, split_k, fusions", [(1, 1, "norm+gated"), (3, 1, "norm+residual"), (1, 2, "gated"),
                                                 (2, 2, "residual")])
def test_fusions_match_the_float32_reference(fmt, m, split_k, fusions):
    """The norm, gate/up and residual fusions (pallas_kernels/fused.py), whole or in k splits."""
    rng = np.random.default_rng(m * 10 + split_k)
    norm, residual, gated = fusion_operands(rng, m, 24, 256, fusions)
    w, scale = weights(rng, 48 if gated else 24, 256, fmt)
    x = jnp.asarray(rng.standard_normal((m, 256)), jnp.float32)
    got = matvec(x, w, scale, norm, residual, fmt=fmt, gated=gated, block_k=64, split_k=split_k, interpret=True)
    want = fused_reference(x, w, scale, fmt, norm, residual, gated)
    assert got.shape == (m, 24)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))


def test_block_k_follows_the_row_length():
    """8B: q/k/v, o and gate/up (rows of 4096) 1024; down (14336) 2048."""
    assert [default_block_k(k) for k in (4096, 8192, 14336)] == [1024, 1024, 2048]


@pytest.mark.parametrize("x_shape, w, kwargs, message", [
    ((1, 64), jnp.ones((32, 64), jnp.int8), {"fmt": "int4"}, "fmt must be one of"),
    ((1, 64), jnp.ones((32, 64), jnp.int8), {"fmt": "fp8"}, "must be uint8"),
    ((MAX_ROWS + 1, 64), jnp.ones((32, 64), jnp.int8), {"fmt": "int8"}, f"1 to {MAX_ROWS} rows"),
    ((1, 64), jnp.ones((64, 32), jnp.int8), {"fmt": "int8"}, r"w must be \[n, k=64\]"),
    ((1, 64), jnp.ones((32, 64), jnp.int8), {"fmt": "int8", "split_k": 3}, "split_k must divide"),
    ((1, 64), jnp.ones((32, 64), jnp.int8), {"fmt": "int8", "norm": jnp.ones(32)}, r"norm must be \[k=64\]"),
    ((1, 64), jnp.ones((32, 64), jnp.int8), {"fmt": "int8", "norm": jnp.ones(64), "split_k": 2},
     "norm without k splits only"),
    ((2, 64), jnp.ones((32, 64), jnp.int8), {"fmt": "int8", "gated": True, "residual": jnp.ones((2, 32))},
     r"residual must be \[m=2, n=16\]"),
    ((1, 64), jnp.ones((31, 64), jnp.int8), {"fmt": "int8", "gated": True}, "an even number of rows"),
])
def test_bad_operands_are_refused_by_name(x_shape, w, kwargs, message):
    with pytest.raises(ValueError, match=message):
        matvec(jnp.ones(x_shape, jnp.bfloat16), w, jnp.ones((w.shape[0],), jnp.float32), interpret=True, **kwargs)


def _lowered(platform, device_kind, fmt, fused=False):
    """fused: as the gate/up projection runs, its norm and product fused."""
    mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(device_kind, None, platform))
    args = (jax.ShapeDtypeStruct((1, 4096), jnp.bfloat16),
            jax.ShapeDtypeStruct((6144, 4096), jnp.int8 if fmt == "int8" else jnp.uint8),
            jax.ShapeDtypeStruct((6144,), jnp.float32))
    if fused:
        args += (jax.ShapeDtypeStruct((4096,), jnp.bfloat16),)
    with use_abstract_mesh(mesh):
        return matvec.trace(*args, fmt=fmt, gated=fused).lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("platform, device_kind", [("rocm", "gfx942"), ("cuda", "NVIDIA H200")])
@pytest.mark.parametrize("fmt, fused", [("int8", False), ("fp8", False), ("fp8", True)])
def test_kernel_lowers_ahead_of_time(platform, device_kind, fmt, fused):
    """No GPU needed: a Triton custom call for MI300X (ROCm) and H200, plain and fused."""
    text = _lowered(platform, device_kind, fmt, fused)
    assert "__gpu$xla.gpu.triton" in text and f"matvec_{fmt}" in text


def test_cuda_converts_with_its_own_instructions_and_rocm_portably():
    """CUDA's fp8 kernel converts with the GPU's fp8 cast and its int8 kernel with INT8_PTX, whose
    sums are chains of PTX fused multiply-adds (CHAINED); ROCm's decode the bits with plain integer
    and float work and leave the multiply-adds to the compiler."""
    def ir(platform, device_kind, fmt):
        (found,) = re.findall(r'ir = "(.*?)"', _lowered(platform, device_kind, fmt))
        return found
    assert "prmt.b32" in ir("cuda", "NVIDIA H200", "int8") and "prmt.b32" not in ir("rocm", "gfx942", "int8")
    assert "fma.rn.f32" in ir("cuda", "NVIDIA H200", "int8") and "fma.rn.f32" not in ir("rocm", "gfx942", "int8")
    assert "fma.rn.f32" not in ir("cuda", "NVIDIA H200", "fp8")
    assert ir("rocm", "gfx942", "fp8") != ir("cuda", "NVIDIA H200", "fp8")


def _run_int8_ptx(word: int) -> list[float]:
    """INT8_PTX's instructions (xor, prmt, sub.f32 only) on one 32-bit register, as PTX defines
    them: prmt picks each result byte from the eight bytes of {b, a} by one selector nibble."""
    regs = {"$4": word}
    as_f32 = lambda bits: float(np.array([bits], np.uint32).view(np.float32)[0])
    value = lambda s: int(s, 16) if s.startswith("0x") else regs[s]
    for line in INT8_PTX.replace(";", "").splitlines():
        op, *args = line.replace(",", " ").split()
        if op == "xor.b32":
            regs[args[0]] = value(args[1]) ^ value(args[2])
        elif op == "prmt.b32":
            pool = value(args[1]) | value(args[2]) << 32
            sel = value(args[3])
            regs[args[0]] = sum(((pool >> 8 * (sel >> 4 * i & 7)) & 0xFF) << 8 * i for i in range(4))
        elif op == "sub.f32":
            const = np.array([int(args[2][2:], 16)], np.uint32).view(np.float32)[0]
            regs[args[0]] = int(np.array([np.float32(as_f32(regs[args[1]])) - const], np.float32).view(np.uint32)[0])
        else:
            assert op in ("{", "}", ".reg"), op
    return [as_f32(regs[f"${i}"]) for i in range(4)]


def test_int8_ptx_gives_each_of_four_weights_its_exact_value():
    """Every int8 value in every byte of the register (little-endian: byte i is weight i)."""
    values = np.arange(-128, 128)
    for shift in range(4):
        for chunk in np.split(values, 64):
            word = int(np.array(np.roll(np.resize(chunk, 4), shift), np.int8).view(np.uint32)[0])
            expected = np.array([word], np.uint32).view(np.int8).astype(float).tolist()
            assert _run_int8_ptx(word) == expected
