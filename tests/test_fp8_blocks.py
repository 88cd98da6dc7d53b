"""fp8 checkpoints with block-wise scales (Qwen3-*-FP8, DeepSeek-V3's layout): each linear weight
float8_e4m3fn [out, in] beside weight_scale_inv, one float32 per block. Built here with torch from
tiny random models (blocks that do not divide the weights: partial last blocks), they load as
exactly the weights torch dequantizes (one rounding to the model's dtype), dense and MoE alike,
split over devices too, convert to the same weights, and requantize per channel from float32
when quantize= asks; what is not supported is refused by name."""

import json
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.torch
import torch
from test_hf_numerics import engine_logits
from tiny_models import TINY, save_tiny

import jaxspec
from jaxspec.model.checkpoint import convert_hf_checkpoint
from jaxspec.model.quantize import dequantize_blocks, expand_block_scales

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
TOKENS = [[5, 9, 33, 7, 100, 42, 8, 61, 2, 77, 19, 4]]
# Linear weights stored in fp8 (every projection, the experts' too, as published); routers stay in
# float. lm_head: published Qwen3-FP8 leaves it in bf16; the dense case below stores it in fp8 too.
FP8_WEIGHTS = ("_proj.weight", ".w1.weight", ".w2.weight", ".w3.weight")
# name: (family, config overrides, weight_block_size, lm_head in fp8)
CASES = {
    "llama": ("llama", dict(intermediate_size=96), [24, 40], True),  # partial blocks on both axes
    "qwen3_moe": (*TINY["qwen3_moe"], [16, 40], False),
    "mixtral": (*TINY["mixtral"], [32, 48], False),
    "qwen3_128": ("qwen3", dict(head_dim=32, intermediate_size=192), [128, 128], False),  # 192 rows: 2 blocks
}


def block_quantize(w: torch.Tensor, block) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp8 values, scale_inv grid, the float32 weight they stand for): each block's largest
    magnitude maps to e4m3's 448, the last blocks partial."""
    (out, inp), (r, c) = w.shape, block
    rows, cols = -(-out // r), -(-inp // c)
    padded = torch.zeros(rows * r, cols * c)
    padded[:out, :inp] = w
    amax = padded.reshape(rows, r, cols, c).abs().amax(dim=(1, 3))
    scale_inv = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    expanded = scale_inv.repeat_interleave(r, 0).repeat_interleave(c, 1)[:out, :inp]
    values = (w / expanded).to(torch.float8_e4m3fn)
    return values, scale_inv, values.float() * expanded


def write_block_fp8(root, case: str):
    """(the block-fp8 folder, a float32 folder of the weights torch dequantizes from it)."""
    family, overrides, block, head = CASES[case]
    src = save_tiny(root / "float", family, overrides)
    fp8, dequantized = {}, {}
    for name, w in safetensors.torch.load_file(src / "model.safetensors").items():
        fp8[name] = dequantized[name] = w
        if name.endswith(FP8_WEIGHTS) or (head and name == "lm_head.weight"):
            fp8[name], fp8[name + "_scale_inv"], dequantized[name] = block_quantize(w, block)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": block}
    for folder, tensors, cfg in ((root / "fp8", fp8, config), (root / "dequantized", dequantized, None)):
        shutil.copytree(src, folder, ignore=shutil.ignore_patterns("*.safetensors"))
        safetensors.torch.save_file(tensors, folder / "model.safetensors")
        if cfg:
            (folder / "config.json").write_text(json.dumps(cfg))
    return root / "fp8", root / "dequantized"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    made = {}

    def get(case):
        if case not in made:
            made[case] = write_block_fp8(tmp_path_factory.mktemp(case), case)
        return made[case]
    return get


def same_weights(a, b) -> bool:
    la, lb = jax.tree.leaves(a.weights), jax.tree.leaves(b.weights)
    return len(la) == len(lb) and all(
        x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))


def test_block_scales_expand_over_partial_blocks_in_numpy_and_jax():
    grid = np.arange(1, 7, dtype=np.float32).reshape(2, 3)  # a [3, 7] weight in (2, 3) blocks
    want = np.array([[1, 1, 1, 2, 2, 2, 3]] * 2 + [[4, 4, 4, 5, 5, 5, 6]], np.float32)
    np.testing.assert_array_equal(expand_block_scales(grid, (3, 7), (2, 3)), want)
    np.testing.assert_array_equal(expand_block_scales(jnp.asarray(grid), (3, 7), (2, 3)), want)
    np.testing.assert_array_equal(expand_block_scales(grid, (3, 3), (2, 1)), want[:, ::3])  # rows only
    values = np.linspace(-2, 2, 21, dtype=np.float32).reshape(3, 7).astype(jnp.float8_e4m3fn)
    bits = values.view(np.uint8)
    for got in (dequantize_blocks(values, grid, (2, 3)), dequantize_blocks(bits, grid, (2, 3)),
                dequantize_blocks(jnp.asarray(bits), jnp.asarray(grid), (2, 3))):
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, values.astype(np.float32) * want)


@pytest.mark.parametrize("case", list(CASES))
def test_a_block_fp8_folder_loads_the_weights_torch_dequantizes(folders, case):
    """Weights equal to the dequantized folder's, bit for bit (float32 and one rounding to
    bfloat16), so the logits are too; MoE experts included."""
    fp8, dequantized = folders(case)
    model = jaxspec.load(fp8, dtype="float32")
    reference = jaxspec.load(dequantized, dtype="float32")
    assert model.quantize is None and same_weights(model, reference)
    np.testing.assert_array_equal(engine_logits(model, TOKENS), engine_logits(reference, TOKENS))
    if case == "llama":
        assert same_weights(jaxspec.load(fp8, dtype="bfloat16"), jaxspec.load(dequantized, dtype="bfloat16"))


@pytest.mark.parametrize("case", ["llama", "qwen3_moe"])
def test_convert_gives_the_folders_weights(folders, tmp_path, case):
    fp8, _ = folders(case)
    converted = jaxspec.load(convert_hf_checkpoint(fp8, tmp_path / "ckpt"), dtype="float32")
    model = jaxspec.load(fp8, dtype="float32")
    assert same_weights(converted, model)
    np.testing.assert_array_equal(engine_logits(converted, TOKENS), engine_logits(model, TOKENS))


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
def test_quantize_requantizes_per_channel_from_the_float32_weights(folders, tmp_path, scheme):
    """quantize= on a block-fp8 folder: the per-channel 8 bits of its float32 dequantized weights
    (the head too: in fp8 blocks in one case, in float in the other), on load and through convert."""
    for case in ("llama", "qwen3_128"):
        fp8, dequantized = folders(case)
        model = jaxspec.load(fp8, dtype="bfloat16", quantize=scheme)
        assert model.quantize == scheme
        # bfloat16 everywhere but the projections, which come from float32 (no bfloat16 rounding first)
        want = jax.tree.leaves(jaxspec.load(dequantized, dtype="float32", quantize=scheme).weights)
        got = jax.tree.leaves(model.weights)
        for x, y in zip(got, want):
            assert np.array_equal(np.asarray(x), np.asarray(y.astype(x.dtype)))
    converted = jaxspec.load(convert_hf_checkpoint(fp8, tmp_path / "ckpt", dtype="bfloat16", quantize=scheme),
                             dtype="bfloat16")
    assert converted.quantize == scheme and same_weights(converted, model)


@pytest.mark.multi_device
def test_a_split_load_gives_each_device_its_slice_of_the_dequantized_weights(folders):
    """Blocks of 24 rows and 40 columns cut across every device's share of the heads and ffn
    columns: the split weights are the whole ones, and the greedy tokens the same."""
    fp8, _ = folders("llama")
    whole, split = jaxspec.load(fp8, dtype="float32"), jaxspec.load(fp8, dtype="float32", tensor_parallel=2)
    assert split.tensor_parallel == 2 and same_weights(split, whole)
    tokens = lambda m: [c.token_ids for c in jaxspec.generate(TOKENS, m, max_new_tokens=8)]  # noqa: E731
    assert tokens(split) == tokens(whole)


@pytest.mark.multi_device
def test_experts_split_by_expert_are_dequantized_on_their_own_devices(folders):
    """Expert parallelism over 2 devices: each expert's fp8 weights and scale grid go whole to its
    device and are dequantized there (or requantized to int8); the experts are the whole model's, and
    the greedy tokens too."""
    fp8, _ = folders("qwen3_moe")
    whole = jaxspec.load(fp8, dtype="float32")
    split = jaxspec.load(fp8, dtype="float32", tensor_parallel=2, expert_parallel=True)
    assert split.expert_parallel
    for name in ("experts_gate_up", "experts_down"):
        np.testing.assert_array_equal(*(np.asarray(getattr(m.weights.layers, name)) for m in (split, whole)))
    tokens = lambda m: [c.token_ids for c in jaxspec.generate(TOKENS, m, max_new_tokens=8)]  # noqa: E731
    assert tokens(split) == tokens(whole)
    whole, split = (jaxspec.load(fp8, dtype="float32", quantize="int8", **kw)  # requantized on each expert's device
                    for kw in ({}, dict(tensor_parallel=2, expert_parallel=True)))
    assert same_weights(split, whole) and tokens(split) == tokens(whole)


def test_what_block_fp8_does_not_support_is_refused_by_name(folders, tmp_path):
    fp8, _ = folders("llama")
    config = json.loads((fp8 / "config.json").read_text())
    qc = config["quantization_config"]

    def with_config(name, quantization_config):
        folder = tmp_path / name
        shutil.copytree(fp8, folder)
        (folder / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
        return folder

    for block in ([128], [128, 128, 128], [0, 128]):
        with pytest.raises(jaxspec.CheckpointError, match=r"quantization_config.weight_block_size must be two "
                           r"positive integers \[rows, columns\], as \[128, 128\]; got " + re.escape(str(block))):
            jaxspec.load(with_config(f"block{len(block)}-{block[0]}", {**qc, "weight_block_size": block}))
    with pytest.raises(jaxspec.CheckpointError, match=(
            r"tensor model.layers.0.self_attn.q_proj.weight_scale_inv in model.safetensors has shape \(3, 2\); "
            r"weight_block_size \[32, 32\] over its weight model.layers.0.self_attn.q_proj.weight of shape "
            r"\(64, 64\) implies \(2, 2\)")):
        jaxspec.load(with_config("grid", {**qc, "weight_block_size": [32, 32]}))
    with pytest.raises(jaxspec.CheckpointError, match="activation_scheme 'static' with weight_block_size is not "
                       "supported; block-wise fp8 is read with activation_scheme \"dynamic\""):
        jaxspec.load(with_config("static", {**qc, "activation_scheme": "static"}))
    blocks = {"quant_method": "compressed-tensors", "config_groups": {"group_0": {"weights": {
        "num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128]}}}}
    with pytest.raises(jaxspec.CheckpointError, match="quant_method 'compressed-tensors' and weights num_bits 8, "
                       "type 'float', strategy 'block' is not supported"):
        jaxspec.load(with_config("compressed", blocks))
