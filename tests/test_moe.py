"""Mixture-of-experts targets (issue 51, first step): Qwen3-MoE and Mixtral load from HF folders
and converted checkpoints (logits against transformers: tests/test_hf_numerics.py runs both
families), and every drafter stays lossless on them: greedy output equals plain decoding's.
8-bit experts compute what their dequantized weights say on every expert path."""

import dataclasses
import shutil

import jax
import numpy as np
import pytest
from test_hf_numerics import MAX_REL_ERR, engine_logits, hf_logits, rel_err
from tiny_models import TINY, build_tiny_hf, save_tiny

import jaxspec
import jaxspec.model.forward as forward
from jaxspec.model.checkpoint import convert_hf_checkpoint, read_checkpoint
from jaxspec.model.config import load_config
from jaxspec.model.quantize import Quantized, dequantize

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
PROMPTS = [[5, 9, 33, 7], list(range(3, 40)), [100] * 19]


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def moe(request, tmp_path_factory):
    """(an MoE target, a dense draft of the same vocabulary, the target's folder)."""
    kind, overrides = TINY[request.param]
    root = tmp_path_factory.mktemp(request.param)
    target = jaxspec.load(save_tiny(root / "t", kind, overrides, seed=1), dtype="float32")
    draft = jaxspec.load(save_tiny(root / "d", "llama", {"num_hidden_layers": 1}, seed=2), dtype="float32")
    return target, draft, root / "t"


def test_every_drafter_gives_plain_greedy_output(moe, tmp_path):
    """A dense draft model's chain and tree, the target drafting for itself (long accepted runs:
    verify passes whose tokens route to many experts at once), n-gram and suffix lookup and a
    random EAGLE-3 head, in one batch of three prompts."""
    from jaxspec.model.eagle import random_eagle_folder

    target, draft, _ = moe
    head = jaxspec.load(random_eagle_folder(tmp_path / "head", target.config, draft_vocab_size=256, seed=5),
                        dtype="float32")
    plain = [o.token_ids for o in jaxspec.generate(PROMPTS, target, max_new_tokens=24)]
    for how, kw in [(draft, dict(num_draft_tokens=3)), (draft, dict(tree="binary-3")),
                    (target, dict(num_draft_tokens=4)), ("ngram", dict(num_draft_tokens=3)),
                    ("suffix", dict(num_draft_tokens=3)),
                    (head, dict(num_draft_tokens=3))]:
        spec = jaxspec.generate(PROMPTS, target, how, max_new_tokens=24, warn_below_acceptance=0.0, **kw)
        assert [o.token_ids for o in spec] == plain, how
    self_drafted = jaxspec.generate(PROMPTS, target, target, max_new_tokens=24, num_draft_tokens=4)
    assert self_drafted.metrics.acceptance_rate > 0.9  # the verify passes ran many tokens through the experts
    # a verify pass of 5 tokens reads between 2 (top-2) and all 4 experts per layer; plain steps report none
    c = target.config
    for o in self_drafted:
        assert c.experts_per_token < o.stats.experts_per_layer <= c.num_experts
    assert c.experts_per_token < self_drafted.metrics.experts_per_layer <= c.num_experts
    assert jaxspec.generate(PROMPTS[:1], target, max_new_tokens=4)[0].stats.experts_per_layer is None


@pytest.mark.parametrize("path, router", [(p, "xla") for p in forward.EXPERT_PATHS] + [("kernel", "kernel")])
def test_every_expert_path_matches_transformers(moe, path, router):
    """The grouped expert kernel (interpret mode), each (token, expert) pair's weights gathered,
    or the pairs grouped by expert (jax.lax.ragged_dot), forced for every call, and the router in
    one kernel (pallas_kernels/router.py) before the expert kernel: teacher-forced logits of 3 x 20
    tokens within transformers' float32 rounding."""
    target, _, _ = moe
    kind, overrides = TINY[target.config.model_type]
    hf = build_tiny_hf(kind, overrides, seed=1)
    tokens = np.random.default_rng(3).integers(0, target.config.vocab_size, (3, 20))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(forward, "FORCED_EXPERT_PATH", path)
        mp.setattr(forward, "ROUTER_PATH", router)
        jax.clear_caches()
        got = engine_logits(target, tokens)
    jax.clear_caches()
    assert rel_err(got, hf_logits(hf, tokens)) < MAX_REL_ERR


def test_a_converted_checkpoint_gives_the_folders_logits(moe, tmp_path):
    target, _, folder = moe
    converted = jaxspec.load(convert_hf_checkpoint(folder, tmp_path / "ckpt"), dtype="float32")
    tokens = np.asarray([PROMPTS[1][:16]])
    np.testing.assert_array_equal(engine_logits(converted, tokens), engine_logits(target, tokens))


def _experts_dequantized(model):
    """The same model with its 8-bit experts replaced by the float32 weights they stand for."""
    layers = model.weights.layers  # stacked on the CPU
    layers = layers.replace(**{name: dequantize(getattr(layers, name), stacked=True)
                               for name in ("experts_gate_up", "experts_down")})
    return dataclasses.replace(model, weights=model.weights.replace(layers=layers))


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
def test_8bit_experts_compute_what_their_dequantized_weights_say_on_every_path(moe, scheme):
    """quantize= puts each expert in 8 bits with its own per-channel scales (the router stays in
    the model's dtype); teacher-forced logits of 2 x 12 tokens through the grouped kernel
    (interpret mode), the gathered pairs and ragged_dot, each within the 8-bit tests' tolerance
    of the model with its experts dequantized to float32."""
    _, _, folder = moe
    model = jaxspec.load(folder, dtype="float32", quantize=scheme)
    gate_up = model.weights.layers.experts_gate_up
    assert isinstance(gate_up, Quantized) and gate_up.fmt == scheme and not isinstance(model.weights.layers.router,
                                                                                        Quantized)
    c = model.config
    assert gate_up.scale.shape == (c.num_layers, c.num_experts, 2, c.moe_intermediate_size)
    assert model.weights.layers.experts_down.scale.shape == (c.num_layers, c.num_experts, c.hidden_size)
    tokens = np.random.default_rng(3).integers(0, c.vocab_size, (2, 12))
    want = engine_logits(_experts_dequantized(model), tokens)
    for path in forward.EXPERT_PATHS:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(forward, "FORCED_EXPERT_PATH", path)
            jax.clear_caches()
            got = engine_logits(model, tokens)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()), err_msg=path)
    jax.clear_caches()


def test_an_8bit_moe_converts_loads_back_the_same_and_speculates_losslessly(moe, tmp_path):
    """convert --quantize stores each expert's 8-bit values with its scales; the checkpoint loads
    back the weights quantize= gives; greedy n-gram speculation gives plain decoding's tokens."""
    target, _, folder = moe
    scheme = "int8" if target.config.model_type == "qwen3_moe" else "fp8"
    out = convert_hf_checkpoint(folder, tmp_path / "ckpt", quantize=scheme)
    stored = read_checkpoint(out, load_config(out))
    assert stored["layers.e_gate0"].dtype == {"int8": np.int8, "fp8": np.uint8}[scheme]
    assert stored["layers.e_down3.scale"].shape == (target.config.num_layers, target.config.hidden_size)
    converted, loaded = jaxspec.load(out, dtype="float32"), jaxspec.load(folder, dtype="float32", quantize=scheme)
    assert converted.quantize == scheme
    assert all(jax.tree.leaves(jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), np.asarray(b)),
                                            converted.weights, loaded.weights)))
    plain = [o.token_ids for o in jaxspec.generate(PROMPTS, converted, max_new_tokens=16)]
    ngram = jaxspec.generate(PROMPTS, converted, "ngram", num_draft_tokens=3, max_new_tokens=16,
                             warn_below_acceptance=0.0)
    assert [o.token_ids for o in ngram] == plain


def test_a_published_per_channel_fp8_moe_checkpoint_computes_what_its_dequantized_weights_say(tmp_path):
    """A Qwen3-MoE folder in FP8 as published for vLLM (each expert's projections with their
    per-channel weight_scale) keeps its bits: logits as the same weights dequantized by torch."""
    from test_quantize import fp8_folder

    kind, overrides = TINY["qwen3_moe"]
    folder = fp8_folder(tmp_path, per_channel=True, source=save_tiny(tmp_path / "src", kind, overrides, seed=1))
    model = jaxspec.load(folder, dtype="float32")
    assert model.quantize == "fp8" and isinstance(model.weights.layers.experts_down, Quantized)
    tokens = np.random.default_rng(3).integers(0, model.config.vocab_size, (2, 12))
    want = engine_logits(jaxspec.load(folder.with_name(folder.name + "-dequantized"), dtype="float32"), tokens)
    np.testing.assert_allclose(engine_logits(model, tokens), want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))


def test_what_moe_does_not_do_yet_is_refused(moe, tmp_path):
    target, _, folder = moe
    kind, overrides = TINY[target.config.model_type]
    key = "num_local_experts" if kind == "mixtral" else "num_experts"
    too_many = save_tiny(tmp_path / "topk", kind, {**overrides, key: 2, "num_experts_per_tok": 3})
    with pytest.raises(jaxspec.ConfigError, match=r"num_experts_per_tok must be in \[1, 2\] \(the experts\); got 3"):
        jaxspec.load(too_many)
    gone = tmp_path / "gone"
    shutil.copytree(folder, gone)
    from safetensors.numpy import load_file, save_file

    tensors = {k: v for k, v in load_file(gone / "model.safetensors").items() if ".experts.3." not in k}
    save_file(tensors, gone / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(jaxspec.CheckpointError, match=r"missing tensor\(s\) in .*experts\.3\."):
        jaxspec.load(gone)


def test_expert_parallel_is_refused_where_there_are_no_experts_to_split(capsys):
    """Checked before any device count or weight (tests/test_tensor_parallel.py splits experts)."""
    from jaxspec import cli
    from jaxspec.defaults import CHECKPOINTS

    dense = CHECKPOINTS / "hf" / "code-target-16m"
    with pytest.raises(jaxspec.InputError, match="expert_parallel must be True or False; got 'yes'"):
        jaxspec.load(dense, expert_parallel="yes")
    assert cli.main(["generate", "x", "--target", str(dense), "--tensor-parallel", "2", "--expert-parallel"]) == 2
    assert ("expert_parallel: code-target-16m is a dense model (llama, num_experts 0); only a mixture of experts "
            "(qwen3_moe, mixtral) splits by expert") in capsys.readouterr().err


def test_sampling_on_an_moe_target_is_exact(tmp_path):
    """The exact distribution test (tests/test_speculative_distribution.py) with a tiny Qwen3-MoE
    target on a 16-token vocabulary, its tokens routed to 2 of 4 experts, drafted by a dense
    model: the joint of tokens 2 and 3 is the target's own sampling distribution."""
    import test_speculative_distribution as exact

    base = dict(vocab_size=16, eos_token_id=None, bos_token_id=None, pad_token_id=0, initializer_range=0.5)
    kind, overrides = TINY["qwen3_moe"]
    target = jaxspec.load(save_tiny(tmp_path / "t", kind, {**overrides, **base}, seed=3), dtype="float32")
    draft = jaxspec.load(save_tiny(tmp_path / "d", "llama", {**base, "num_hidden_layers": 1}, seed=4), dtype="float32")
    setting = exact.SETTINGS[0]
    assert exact.chi2_pvalue(exact.sampled_joint(target, draft, setting), exact.exact_joint(target, setting)) > 1e-4


def test_a_batch_job_and_its_canary_run_an_moe_target(moe, tmp_path):
    """`jaxspec batch --auto` over token-id prompts: the canary times its candidates on the MoE
    target and the job writes every record, as plain decoding would."""
    import json

    from jaxspec import cli
    from jaxspec.batch import read_output

    target, _, folder = moe
    draft_folder = save_tiny(tmp_path / "d", "llama", {"num_hidden_layers": 1}, seed=2)
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"id": str(i), "prompt": p}) + "\n" for i, p in enumerate(PROMPTS * 4)))
    assert cli.main(["batch", str(src), str(out), "--target", str(folder), "--draft", str(draft_folder), "--auto",
                     "--max-new-tokens", "12", "--batch-size", "4", "--no-plot", "--no-progress"]) == 0
    got = {r["id"]: r["token_ids"] for r in read_output(out)}
    plain = jaxspec.generate(PROMPTS, target, max_new_tokens=12)
    assert got == {str(i): plain[i % 3].token_ids for i in range(12)}
    assert json.loads(out.with_suffix(".summary.json").read_text())["canary"]["candidates"]


def test_deterministic_moe_gives_a_row_the_same_bits_alone_batched_and_speculative(tmp_path):
    """bfloat16, deterministic mode (router through the matmul kernel, experts through the grouped
    expert kernel): a row's logits are the same alone, beside other rows and in a verify pass, and
    greedy tokens alone = batched = speculative (n-gram lookup) = under the continuous scheduler."""
    from test_deterministic import _logits_after

    kind, overrides = TINY["qwen3_moe"]
    target = jaxspec.load(save_tiny(tmp_path / "t", kind, {**overrides, "initializer_range": 0.02}, seed=3),
                          dtype="bfloat16")
    rng = np.random.default_rng(4)
    prefix, tokens = rng.integers(3, 384, (4, 13)), rng.integers(3, 384, (4, 4))
    alone = _logits_after(target, prefix[:1], tokens[:1, :1], "deterministic")
    np.testing.assert_array_equal(_logits_after(target, prefix, tokens[:, :1], "deterministic")[:1], alone)
    np.testing.assert_array_equal(_logits_after(target, prefix[:1], tokens[:1], "deterministic")[:, :1], alone)
    prompts = [[5, 9, 14, 9, 14, 9, 30], [7, 7, 8, 100, 7, 7, 8], [40, 41, 42], [11, 12, 11, 12, 11]]
    det = dict(max_new_tokens=16, deterministic=True, warn_below_acceptance=0.0)
    plain = [o.token_ids for o in jaxspec.generate(prompts, target, **det, max_batch_size=4)]
    assert [o.token_ids for o in jaxspec.generate(prompts[:1], target, **det)] == plain[:1]
    ngram = jaxspec.generate(prompts, target, "ngram", num_draft_tokens=3, **det, max_batch_size=4)
    assert [o.token_ids for o in ngram] == plain and ngram.metrics.accepted > 0
    assert [o.token_ids for o in jaxspec.generate(prompts, target, **det, max_batch_size=2)] == plain


def test_qwen3_moe_dense_layers_follow_transformers_rule():
    """Layer i is sparse unless mlp_only_layers names it or decoder_sparse_step does not divide
    i + 1 (Qwen3MoeDecoderLayer); configs the rule cannot read, or that leave no sparse layer,
    are refused by name."""
    from jaxspec.model.families.qwen3_moe import dense_layers

    assert dense_layers({"num_hidden_layers": 4}) == ()
    assert dense_layers({"num_hidden_layers": 5, "decoder_sparse_step": 2}) == (0, 2, 4)
    assert dense_layers({"num_hidden_layers": 5, "decoder_sparse_step": 2, "mlp_only_layers": [3]}) == (0, 2, 3, 4)
    for bad, named in (({"decoder_sparse_step": 0}, "decoder_sparse_step must be an integer >= 1; got 0"),
                       ({"mlp_only_layers": [4]}, r"mlp_only_layers must be a list of layer indices in \[0, 4\)"),
                       ({"decoder_sparse_step": 5}, "every layer dense .* load it as model_type qwen3")):
        with pytest.raises(jaxspec.ConfigError, match=named):
            dense_layers({"num_hidden_layers": 4, **bad})


def test_a_qwen3_moe_with_a_dense_layer_loads_converts_and_speculates(tmp_path, monkeypatch):
    """Layer 1 dense between two sparse ones (logits against transformers: test_hf_numerics runs
    this model too). Its layers stay apart on the CPU (no stack holds both kinds); a converted
    checkpoint, in float32 and int8, loads back the folder's weights; every drafter, and adaptive
    K switching between K = 3, 0 (the draft paused) and 1, gives plain decoding's tokens; a verify
    pass reports the experts of the two sparse layers."""
    import itertools

    from jaxspec.serving import adaptive_k

    kind, overrides = TINY["qwen3_moe_dense_layer"]
    folder = save_tiny(tmp_path / "t", kind, overrides, seed=1)
    target = jaxspec.load(folder, dtype="float32")
    c = target.config
    assert c.dense_layers == (1,) and c.sparse_layers == (0, 2)
    layers = target.weights.layers
    assert isinstance(layers, tuple) and layers[1].router is None and layers[0].w_down is None
    assert layers[1].w_down.shape == (c.intermediate_size, c.hidden_size)
    assert layers[2].experts_down.shape == (c.num_experts, c.moe_intermediate_size, c.hidden_size)
    same = lambda a, b: all(jax.tree.leaves(jax.tree.map(  # noqa: E731
        lambda x, y: np.array_equal(np.asarray(x), np.asarray(y)), a.weights, b.weights)))
    assert same(jaxspec.load(convert_hf_checkpoint(folder, tmp_path / "f32"), dtype="float32"), target)
    stored = read_checkpoint(convert_hf_checkpoint(folder, tmp_path / "int8", quantize="int8"),
                             load_config(folder))
    assert stored["layers.e_gate0"].shape[0] == 2 and stored["layers.w_gate"].shape[0] == 1  # each over its layers
    assert same(jaxspec.load(tmp_path / "int8", dtype="float32"), jaxspec.load(folder, dtype="float32", quantize="int8"))

    draft = jaxspec.load(save_tiny(tmp_path / "d", "llama", {"num_hidden_layers": 1}, seed=2), dtype="float32")
    plain = [o.token_ids for o in jaxspec.generate(PROMPTS, target, max_new_tokens=24)]
    for how, kw in [(draft, dict(num_draft_tokens=3)), (draft, dict(tree="binary-3")),
                    ("ngram", dict(num_draft_tokens=3))]:
        spec = jaxspec.generate(PROMPTS, target, how, max_new_tokens=24, warn_below_acceptance=0.0, **kw)
        assert [o.token_ids for o in spec] == plain, how
    self_drafted = jaxspec.generate(PROMPTS, target, target, max_new_tokens=24, num_draft_tokens=4)
    assert [o.token_ids for o in self_drafted] == plain
    assert c.experts_per_token < self_drafted.metrics.experts_per_layer <= c.num_experts
    order = itertools.cycle((3, 0, 1))  # each refill's K in turn, in place of the timed choice
    monkeypatch.setattr(adaptive_k.AdaptiveK, "next", lambda self, rows: (next(order), False))
    adaptive = jaxspec.generate(PROMPTS, target, draft, adaptive_k=True, num_draft_tokens=3, max_batch_size=2,
                                max_new_tokens=24, warn_below_acceptance=0.0)
    assert [o.token_ids for o in adaptive] == plain


def test_the_measurement_switches_refuse_unknown_values_by_name():
    from jaxspec.errors import InputError

    with pytest.raises(InputError, match="JAXSPEC_EXPERT_PATH must be one of kernel, gather, ragged_dot, xla"):
        forward._forced_expert_path("fast")
    with pytest.raises(InputError, match="JAXSPEC_ROUTER must be one of auto, xla, kernel"):
        forward._router_path("fused")
    with pytest.raises(InputError, match="JAXSPEC_PAD_ONE_ROW must be small or all"):
        forward._pad_one_row_rule("none")
    assert forward._router_path("") == "auto" and forward._forced_expert_path("") is None
    assert forward._pad_one_row_rule("") == "small"
