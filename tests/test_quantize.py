"""8-bit weights: the rounding each scheme promises; a quantized model computes what its
dequantized weights say, through XLA and through the kernel; speculation stays lossless with
respect to the quantized target's own plain output; bad settings are refused by name."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_models import save_tiny

import jaxspec
import jaxspec.model.forward as forward_module
from jaxspec.model import layout
from jaxspec.defaults import CHECKPOINTS
from jaxspec.model.cache import KVCache
from jaxspec.model.checkpoint import convert_hf_checkpoint, read_checkpoint, write_checkpoint
from jaxspec.model.config import load_config
from jaxspec.model.forward import forward
from jaxspec.model.quantize import Quantized, dequantize, quantize

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
HF = CHECKPOINTS / "hf"
PROMPTS = ["def fibonacci(n):", "import os\n\ndef list_files(path):\n    ", "class Queue:\n    def put(self, x):"]


@pytest.fixture(scope="module")
def quantized_pairs():
    """{scheme: (target, draft)}, the embedded pair in float32 with 8-bit projections."""
    return {s: (jaxspec.load(HF / "code-target-16m", dtype="float32", quantize=s),
                jaxspec.load(HF / "code-draft-4m", dtype="float32", quantize=s)) for s in ("int8", "fp8")}


@pytest.mark.parametrize("contract, stacked", [(1, False), (2, False), (1, True)])
def test_each_scheme_rounds_within_its_promise(contract, stacked):
    w = jnp.asarray(np.random.default_rng(0).standard_normal((3, 32, 8, 16)), jnp.float32)
    w = w if stacked else w[0]
    lead = 1 if stacked else 0
    for fmt, half_step in (("int8", None), ("fp8", 2.0 ** -4)):
        q = quantize(w, contract, fmt, stacked)
        out_axes = w.shape[lead + contract:]
        assert q.scale.shape == w.shape[:lead] + out_axes  # values channels first: [lead, out, contracted]
        assert q.values.shape == w.shape[:lead] + out_axes + w.shape[lead: lead + contract]
        back, scale = dequantize(q, stacked=stacked), jnp.expand_dims(q.scale, tuple(range(lead, lead + contract)))
        if half_step is None:  # int8: within half a step of the grid
            assert jnp.all(jnp.abs(back - w) <= 0.5 * scale * (1 + 1e-6))
        else:  # fp8 e4m3: 3 mantissa bits, relative half-ulp (normal range) or half the smallest step
            assert jnp.all(jnp.abs(back - w) <= jnp.maximum(half_step * jnp.abs(w), 2.0 ** -10 * scale))
        # the largest magnitude of each output channel is stored exactly at the format's limit
        assert jnp.allclose(jnp.max(jnp.abs(back), axis=tuple(range(lead, lead + contract))),
                            jnp.max(jnp.abs(w), axis=tuple(range(lead, lead + contract))), rtol=1e-6)


def _dequantized(weights):
    """The same weights with every Quantized replaced by the float32 weight it stands for."""
    stacked = not isinstance(weights.layers, tuple)

    def undo(x, is_layer):
        return dequantize(x, stacked=stacked and is_layer) if isinstance(x, Quantized) else x
    layers = jax.tree.map(lambda x: undo(x, True), weights.layers, is_leaf=lambda x: isinstance(x, Quantized))
    return weights.replace(layers=layers, lm_head=undo(weights.lm_head, False))


def _logits(model, weights, tokens):
    cache = KVCache.create(model.config, 1, 64, jnp.float32, stacked=not isinstance(weights.layers, tuple))
    return forward(weights, model.config, jnp.asarray([tokens], jnp.int32), cache)[0]


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
def test_a_quantized_model_computes_what_its_dequantized_weights_say(quantized_pairs, scheme):
    target, _ = quantized_pairs[scheme]
    assert isinstance(target.weights.layers.wqkv, Quantized) and isinstance(target.weights.lm_head, Quantized)
    tokens = target.tokenizer.encode(PROMPTS[1])
    got = _logits(target, target.weights, tokens)
    want = _logits(target, _dequantized(target.weights), tokens)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(jnp.abs(want).max()))


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
def test_the_kernel_path_gives_the_xla_paths_logits(tmp_path, monkeypatch, scheme):
    """The accelerators' path (their layout, layers unrolled and gate/up one matrix; the 8-bit
    kernels in interpret mode, with the gated MLP's product, the residual adds and (matvec) the
    norms fused in) against XLA's, unfused: a twelve-token prefill, then one token, each through
    the kernel the engine's rows rule picks on a GPU (int8: the matmul kernel, then the one-row
    matvec kernel; fp8: XLA, then matvec)."""
    monkeypatch.setattr(layout, "scan_layers", lambda: False)
    monkeypatch.setattr(layout, "fuse_mlp", lambda: True)
    model = jaxspec.load(save_tiny(tmp_path / "tiny", "llama", {}), dtype="float32", quantize=scheme)
    assert not isinstance(model.weights.layers[0].w_gate_up, tuple)
    tokens = jnp.asarray([[5, 9, 33, 7, 100, 42, 8, 61, 2, 77, 19, 4]], jnp.int32)

    def run():
        cache = KVCache.create(model.config, 1, 64, jnp.float32, stacked=False)
        prefill, cache = forward(model.weights, model.config, tokens, cache)
        step, _ = forward(model.weights, model.config, tokens[:, :1], cache)
        return prefill[0], step[0]

    def top_level_ops(t):  # of a t-token pass: primitives, and jitted functions by name
        jaxpr = jax.make_jaxpr(lambda: forward(model.weights, model.config, tokens[:, :t], KVCache.create(
            model.config, 1, 64, jnp.float32, stacked=False)))()
        return [str(e.params.get("name", e.primitive.name)) for e in jaxpr.eqns]

    xla = run()
    assert "rsqrt" in top_level_ops(1) and "silu" in top_level_ops(1)
    monkeypatch.setattr(forward_module.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(forward_module, "_interpret", lambda: True)  # the kernels, in interpret mode
    picked = {t: forward_module._quantized_kernel(t, scheme, False) for t in (1, tokens.shape[1])}
    assert picked == {1: "matvec", 12: "matmul" if scheme == "int8" else "xla"}
    for t, kernel in picked.items():  # gated products in the kernels, norms in matvec's
        ops = top_level_ops(t)
        if kernel == "xla":
            assert "silu" in ops and not {"matmul", "matvec"} & set(ops)
            continue
        assert "silu" not in ops and ("rsqrt" in ops) == (kernel not in forward_module.NORM_FUSED_IN)
        assert ops.count(kernel) == 4 * model.config.num_layers + 1
    for got, want in zip(run(), xla):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(jnp.abs(want).max()))


@pytest.mark.parametrize("scheme, drafter", [("int8", "chain"), ("int8", "ngram"), ("fp8", "tree")])
def test_speculation_is_lossless_against_the_quantized_targets_own_output(quantized_pairs, real_pair, scheme, drafter):
    """A quantized draft's chain, an unquantized draft's tree, n-gram lookup: the quantized target's tokens."""
    target, draft = quantized_pairs[scheme]
    kw = dict(max_new_tokens=40)
    how = {"chain": dict(draft=draft, num_draft_tokens=3), "tree": dict(draft=real_pair[1], tree="binary-3"),
           "ngram": dict(draft="ngram", num_draft_tokens=4, warn_below_acceptance=0.0)}[drafter]
    plain = [c.token_ids for c in jaxspec.generate(PROMPTS, target, **kw)]
    assert [c.token_ids for c in jaxspec.generate(PROMPTS, target, **how, **kw)] == plain


def test_an_unknown_scheme_is_refused_by_name():
    with pytest.raises(jaxspec.InputError, match="quantize must be one of int8, fp8"):
        jaxspec.load(HF / "code-draft-4m", quantize="int4")


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
def test_convert_stores_8_bits_and_loads_the_same_weights_as_quantizing_on_load(tmp_path, quantized_pairs, scheme):
    out = convert_hf_checkpoint(HF / "code-draft-4m", tmp_path / scheme, quantize=scheme)
    stored = read_checkpoint(out, load_config(out))
    assert stored["layers.wq"].dtype == {"int8": np.int8, "fp8": np.uint8}[scheme]
    assert stored["layers.wq.scale"].dtype == np.float32 and stored["embed"].dtype != np.float32  # bf16 as the source
    loaded = jaxspec.load(out, dtype="float32")
    assert loaded.quantize == scheme
    same = jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), np.asarray(b)), loaded.weights,
                        quantized_pairs[scheme][1].weights)
    assert all(jax.tree.leaves(same))
    other = "fp8" if scheme == "int8" else "int8"
    with pytest.raises(jaxspec.InputError, match=f"stores its weights in {scheme}"):
        jaxspec.load(out, quantize=other)


def test_a_checkpoint_whose_scales_do_not_fit_its_weights_is_refused(tmp_path):
    out = convert_hf_checkpoint(HF / "code-draft-4m", tmp_path / "int8", quantize="int8")
    fields = read_checkpoint(out, load_config(out))
    good = fields["layers.wq.scale"]  # [layers, heads, head_dim]
    bad = {"shape": good[:, :1], "dtype": good.astype(np.float16)}
    for what, scale in bad.items():
        write_checkpoint({**fields, "layers.wq.scale": scale}, out, tmp_path / what, quantize="int8")
    with pytest.raises(jaxspec.CheckpointError, match=r"field layers.wq.scale in .*shape/weights has shape "
                       r"\(2, 1, 64\) float32; the config and jaxspec.json imply \(2, 4, 64\) float32"):
        jaxspec.load(tmp_path / "shape")
    with pytest.raises(jaxspec.CheckpointError, match=r"field layers.wq.scale .* \(2, 4, 64\) float16; .* float32"):
        jaxspec.load(tmp_path / "dtype")
    write_checkpoint({**fields, "bogus": fields["final_norm"]}, out, tmp_path / "extra", quantize="int8")
    with pytest.raises(jaxspec.CheckpointError, match=r"unexpected field\(s\) bogus in .*extra/weights"):
        jaxspec.load(tmp_path / "extra")
    del fields["final_norm"]
    write_checkpoint(fields, out, tmp_path / "missing", quantize="int8")
    with pytest.raises(jaxspec.CheckpointError, match=r"field\(s\) final_norm missing from .*missing/weights"):
        jaxspec.load(tmp_path / "missing")
    marker = tmp_path / "int8" / "jaxspec.json"
    marker.write_text(marker.read_text().replace('"int8"', '"int4"'))
    with pytest.raises(jaxspec.CheckpointError, match="quantize 'int4' is not one of int8, fp8"):
        jaxspec.load(tmp_path / "int8")


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def fp8_folder(tmp_path, per_channel: bool, method: str = "fp8", source=HF / "code-draft-4m"):
    """The embedded draft (or the HF folder `source`) as an FP8 checkpoint as published for vLLM:
    every layer projection (a Qwen3-MoE's experts too) in float8_e4m3fn with a weight_scale (per
    output channel [out, 1], or one per tensor) and an input_scale; lm_head left in bf16, as
    exporters leave it."""
    import shutil

    import safetensors.torch
    import torch

    out = tmp_path / f"fp8-{method}-{'channel' if per_channel else 'tensor'}"
    shutil.copytree(source, out, ignore=shutil.ignore_patterns("*.safetensors"))
    shutil.copytree(out, out.with_name(out.name + "-dequantized"))
    tensors = safetensors.torch.load_file(source / "model.safetensors")
    dequantized = {n: t.float() for n, t in tensors.items()}
    for name in [n for n in tensors if any(p in n for p in PROJECTIONS)]:
        w = tensors[name].float()
        amax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().amax().reshape(1)
        scale = amax / 448.0
        tensors[name] = (w / (scale if per_channel else scale[0])).to(torch.float8_e4m3fn)
        tensors[name.replace(".weight", ".weight_scale")] = scale.float()
        tensors[name.replace(".weight", ".input_scale")] = torch.ones(1)
        dequantized[name] = tensors[name].float() * (scale if per_channel else scale[0])
    safetensors.torch.save_file(tensors, out / "model.safetensors")
    safetensors.torch.save_file(dequantized, out.with_name(out.name + "-dequantized") / "model.safetensors")
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static"} if method == "fp8" else {
        "quant_method": "compressed-tensors", "config_groups": {"group_0": {
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel" if per_channel else "tensor"}}}}
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("per_channel, method", [(True, "fp8"), (False, "compressed-tensors")])
def test_a_published_fp8_checkpoint_computes_what_its_dequantized_weights_say(tmp_path, per_channel, method):
    """Against the same weights dequantized by torch and stored in float32 as a plain HF folder."""
    folder = fp8_folder(tmp_path, per_channel, method)
    model = jaxspec.load(folder, dtype="float32")
    assert model.quantize == "fp8" and isinstance(model.weights.layers.wqkv, Quantized)
    assert not isinstance(model.weights.lm_head, Quantized)  # left in bf16 there
    reference = jaxspec.load(folder.with_name(folder.name + "-dequantized"), dtype="float32")
    tokens = model.tokenizer.encode(PROMPTS[1])
    want = _logits(reference, reference.weights, tokens)
    np.testing.assert_allclose(_logits(model, model.weights, tokens), want, rtol=1e-4,
                               atol=1e-4 * float(jnp.abs(want).max()))


def test_fp8_checkpoints_decode_losslessly_and_convert_to_the_same_weights(tmp_path, real_pair):
    folder = fp8_folder(tmp_path, per_channel=False, method="compressed-tensors")
    model = jaxspec.load(folder, dtype="float32")
    kw = dict(max_new_tokens=24)
    plain = [c.token_ids for c in jaxspec.generate(PROMPTS, model, **kw)]
    assert [c.token_ids for c in jaxspec.generate(PROMPTS, model, real_pair[1], num_draft_tokens=3, **kw)] == plain
    converted = jaxspec.load(convert_hf_checkpoint(folder, tmp_path / "conv"), dtype="float32")
    assert converted.quantize == "fp8"
    assert all(jax.tree.leaves(jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), np.asarray(b)),
                                            converted.weights, model.weights)))


def test_unsupported_fp8_layouts_are_refused_by_name(tmp_path):
    folder = fp8_folder(tmp_path, per_channel=True)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"quantization_config": {
        "quant_method": "compressed-tensors", "config_groups": {"group_0": {"weights": {
            "num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128]}}}}}))
    with pytest.raises(jaxspec.CheckpointError, match="compressed-tensors' and weights num_bits 8, type 'float', "
                       "strategy 'block' is not supported"):
        jaxspec.load(folder)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(jaxspec.InputError, match="stores its weights in fp8"):
        jaxspec.load(folder, quantize="int8")


def test_rows_rules_parse_and_reach_the_engine_as_a_setting(monkeypatch):
    """JAXSPEC_ROWS_RULE (what scripts/gpu_probes/bench_rows_rule.py sets, to measure another 8-bit
    rows rule end to end): rules read first match, ending with a kernel for the remaining rows; a
    bad one is named."""
    assert forward_module.parse_rows_rule("fp8=1:matvec,16:matmul,xla") == (
        "fp8", ((1, "matvec"), (16, "matmul"), (None, "xla")))
    for bad, named in (("fp9=xla", "must start with one of int8, fp8"), ("int8=1:matmul", "must end with"),
                       ("int8=2:cublas,xla", "KERNEL in matvec, matmul, xla")):
        with pytest.raises(jaxspec.InputError, match=named):
            forward_module.parse_rows_rule(bad)
    for steps in forward_module.DEFAULT_ROW_RULES.values():
        assert steps[-1][0] is None and all(kernel in forward_module.QUANTIZED_KERNELS for _, kernel in steps)
    rules = forward_module.row_rules("int8=1:matvec,4:xla,matmul")
    assert rules == {**forward_module.DEFAULT_ROW_RULES, "int8": ((1, "matvec"), (4, "xla"), (None, "matmul"))}
    monkeypatch.setattr(forward_module, "ROW_RULES", rules)
    monkeypatch.setattr(forward_module.jax, "default_backend", lambda: "gpu")
    assert [forward_module._quantized_kernel(r, "int8", False) for r in (1, 4, 5)] == ["matvec", "xla", "matmul"]
    assert forward_module._quantized_kernel(1, "int8", True) == "matmul"  # deterministic: one summation order
    # the variable, in a process of its own, through the script
    script = Path(__file__).parents[1] / "scripts" / "gpu_probes" / "bench_rows_rule.py"
    out = subprocess.run([sys.executable, str(script), "--rule", "fp8=2:matmul,xla", "--", "--help"],
                         capture_output=True, text=True, check=True).stdout
    assert "'fp8': ((2, 'matmul'), (None, 'xla'))" in out and "convert,generate,batch,bench" in out
    probe = "from jaxspec.model import forward; print(forward.ROW_RULES['fp8'])"
    got = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                         env={**os.environ, forward_module.ROWS_RULE_ENV: "fp8=2:matmul,xla"}).stdout
    assert got.strip() == "((2, 'matmul'), (None, 'xla'))"


def test_a_ray_replica_loads_the_drivers_model_in_its_8_bits(quantized_pairs):
    """A batch job's Ray replica rebuilds the target from the driver's load() arguments; it once
    left out quantize and served the job in the full dtype."""
    from jaxspec.jobs.ray_workers import Replica, _spec

    target, draft = quantized_pairs["int8"]
    replica = Replica(_spec(target), _spec(draft))
    for theirs, ours in ((replica.target, target), (replica.draft, draft)):
        assert theirs.quantize == "int8" and theirs.dtype == ours.dtype
        assert jax.tree.all(jax.tree.map(lambda a, b: bool((np.asarray(a) == np.asarray(b)).all()),
                                         theirs.weights, ours.weights))
