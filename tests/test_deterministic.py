"""Deterministic mode (issue 25): every row's result depends on that row alone, bit for bit, in
bfloat16. Its kernels against float32 references (Pallas interpret mode on the CPU), the
invariances they exist for, the engine's outputs alone / in a batch / speculative / under either
scheduler, the refusals, and ahead-of-time lowering for ROCm (gfx942) and CUDA (H200)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh
from tiny_models import TINY, save_tiny

import jaxspec
import jaxspec.model.layout
from jaxspec.bench.scale import forward_loop
from jaxspec.cli import build_parser, job_settings
from jaxspec.cli import main as cli_main
from jaxspec.errors import InputError
from jaxspec.jobs.settings import JobSettings
from jaxspec.model.cache import KVCache
from jaxspec.model.forward import DeterministicParts, deterministic_parts, forward
from pallas_kernels.causal_attention import causal_attention, causal_attention_reference
from pallas_kernels.rms_norm import rms_norm, rms_norm_reference

KEYS = jax.random.split(jax.random.PRNGKey(0), 8)


def _qkv(b, t, h, n, d, s, dtype):
    q = jax.random.normal(KEYS[0], (b, t, h, d), dtype)
    k = jax.random.normal(KEYS[1], (b, s, n, d), dtype)
    v = jax.random.normal(KEYS[2], (b, s, n, d), dtype)
    return q, k, v


@pytest.mark.parametrize("b, t, h, n, s, lengths, window", [
    (2, 1, 4, 2, 64, [5, 63], None),       # decode, one split
    (2, 5, 4, 2, 256, [3, 140], None),     # a chain's verify pass, two splits used of two
    (1, 17, 8, 1, 192, [40], None),        # MQA (8 heads per kv head), query blocks past one
    (1, 6, 7, 7, 128, [30], None),         # MHA, odd head count
    (2, 4, 4, 2, 256, [50, 200], 24),      # sliding window
])
def test_causal_attention_matches_the_float32_reference(b, t, h, n, s, lengths, window):
    q, k, v = _qkv(b, t, h, n, 16, s, jnp.float32)
    lengths = jnp.asarray(lengths, jnp.int32)
    out = causal_attention(q, k, v, lengths, sliding_window=window, interpret=True)
    ref = causal_attention_reference(q, k, v, lengths, window)
    np.testing.assert_allclose(out, ref, atol=2e-6, rtol=2e-6)


def test_causal_attention_in_bfloat16_is_within_its_rounding():
    q, k, v = _qkv(2, 5, 4, 2, 16, 256, jnp.bfloat16)
    lengths = jnp.asarray([3, 140], jnp.int32)
    out = causal_attention(q, k, v, lengths, interpret=True).astype(jnp.float32)
    ref = causal_attention_reference(q, k, v, lengths)
    np.testing.assert_allclose(out, ref, atol=2 ** -7, rtol=2 ** -7)  # bf16 rounding of the output and p


def test_a_token_attends_the_same_bits_alone_in_a_chunk_at_any_capacity_and_beside_any_row():
    q, k, v = _qkv(2, 6, 4, 2, 16, 256, jnp.bfloat16)
    lengths = jnp.asarray([70, 185], jnp.int32)
    whole = causal_attention(q, k, v, lengths, interpret=True)
    for i in range(6):  # decoded alone at its position: its keys are in the cache already
        alone = causal_attention(q[:, i : i + 1], k, v, lengths + i, interpret=True)
        np.testing.assert_array_equal(alone, whole[:, i : i + 1])
    wider = causal_attention(q, jnp.pad(k, ((0, 0), (0, 192), (0, 0), (0, 0))),
                             jnp.pad(v, ((0, 0), (0, 192), (0, 0), (0, 0))), lengths, interpret=True)
    np.testing.assert_array_equal(wider, whole)  # more splits, all past the rows: exact zeros
    neighbour = causal_attention(q[:1], k[:1], v[:1], lengths[:1], interpret=True)
    np.testing.assert_array_equal(neighbour, whole[:1])
    # ... and the property is not free: other split lengths sum in another order
    other = causal_attention(q, k, v, lengths, split_len=64, interpret=True)
    assert not np.array_equal(np.asarray(other), np.asarray(whole))


@pytest.mark.parametrize("d, dtype, atol", [(64, jnp.float32, 1e-6), (3584, jnp.float32, 1e-6),
                                            (128, jnp.bfloat16, 2 ** -6)])
def test_rms_norm_matches_the_float32_reference_and_is_row_invariant(d, dtype, atol):
    x = 3 * jax.random.normal(KEYS[3], (5, d), dtype)
    w = (1 + 0.1 * jax.random.normal(KEYS[4], (d,))).astype(dtype)
    out = rms_norm(x, w, 1e-6, interpret=True)
    np.testing.assert_allclose(out.astype(jnp.float32), rms_norm_reference(x, w, 1e-6), atol=atol, rtol=atol)
    np.testing.assert_array_equal(rms_norm(x[3:4], w, 1e-6, interpret=True), out[3:4])


@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory):
    """A tiny Llama with small random weights (many near-ties: bf16 rounding decides argmaxes),
    loaded in bfloat16; and the same family with a tied head and one kv head (w_nk logits)."""
    root = tmp_path_factory.mktemp("det")
    small = dict(initializer_range=0.02)
    gqa = jaxspec.load(save_tiny(root / "gqa", "llama", small, seed=3), dtype="bfloat16")
    tied = jaxspec.load(save_tiny(root / "tied", "llama", dict(small, num_key_value_heads=1, tie_word_embeddings=True),
                                  seed=4), dtype="bfloat16")
    return gqa, tied


def _logits_after(model, prefix: np.ndarray, tokens: np.ndarray, attention: str):
    """Logits of `tokens` [b, t] after each row's `prefix` [b, p] has been prefilled."""
    b = tokens.shape[0]
    cache = KVCache.create(model.config, b, 128, model.dtype, stacked=not isinstance(model.weights.layers, tuple))
    _, cache = forward(model.weights, model.config, jnp.asarray(prefix), cache, attention=attention)
    cache = cache.replace(lengths=jnp.full((b,), prefix.shape[1], jnp.int32))
    return forward(model.weights, model.config, jnp.asarray(tokens), cache, attention=attention)[0]


@pytest.mark.parametrize("which", [0, 1])
def test_a_row_gives_the_same_logits_alone_in_a_batch_and_in_a_verify_pass(tiny_bf16, which):
    model = tiny_bf16[which]
    rng = np.random.default_rng(which)
    prefix = rng.integers(3, 384, (5, 21))
    tokens = rng.integers(3, 384, (5, 4))
    alone = _logits_after(model, prefix[:1], tokens[:1, :1], "deterministic")
    in_batch = _logits_after(model, prefix, tokens[:, :1], "deterministic")  # four other rows beside it
    others = rng.integers(3, 384, (4, 21))  # ... and four different ones
    in_other_batch = _logits_after(model, np.concatenate([prefix[:1], others]), tokens[:, :1], "deterministic")
    in_verify = _logits_after(model, prefix[:1], tokens[:1], "deterministic")  # the row's token first of 4
    np.testing.assert_array_equal(in_batch[:1], alone)
    np.testing.assert_array_equal(in_other_batch[:1], alone)
    np.testing.assert_array_equal(in_verify[:, :1], alone)
    # the verify pass's later tokens equal decode steps at their positions
    step = _logits_after(model, np.concatenate([prefix[:1], tokens[:1, :2]], axis=1), tokens[:1, 2:3], "deterministic")
    np.testing.assert_array_equal(in_verify[:, 2:3], step)
    # and deterministic mode computes the same model: close to XLA's logits
    np.testing.assert_allclose(alone, _logits_after(model, prefix[:1], tokens[:1, :1], "xla"), atol=0.05)


@pytest.mark.parametrize("family", ["qwen3", "llama_bias", "mistral_swa"])
def test_deterministic_mode_computes_the_same_model_in_float32(tmp_path, family):
    """Its kernels (the norm fused into the projections, q/k norms, biases, a sliding window)
    give the XLA path's logits to float32 rounding, for a prefill and a verify pass."""
    kind, overrides = TINY[family]
    model = jaxspec.load(save_tiny(tmp_path / family, kind, overrides), dtype="float32")
    rng = np.random.default_rng(2)
    prefix, tokens = rng.integers(3, 384, (2, 19)), rng.integers(3, 384, (2, 4))
    got = _logits_after(model, prefix, tokens, "deterministic")
    np.testing.assert_allclose(got, _logits_after(model, prefix, tokens, "xla"), atol=2e-4, rtol=1e-4)


PROMPTS = [[5, 9, 14, 9, 14, 9, 30, 31, 9, 14], [7, 7, 8, 100, 7, 7, 8], [200, 201, 202, 203, 204, 205, 206, 207, 208],
           [11, 12, 11, 12, 11, 12, 11], [40, 41, 42], [300, 17, 300, 17, 300]]


def _tokens(outs):
    return [c.token_ids for c in outs]


def test_deterministic_output_is_the_same_alone_in_any_batch_speculative_or_under_either_scheduler(tiny_bf16):
    target = tiny_bf16[0]
    det = dict(max_new_tokens=24, deterministic=True, warn_below_acceptance=0.0)
    plain = _tokens(jaxspec.generate(PROMPTS, target, **det, max_batch_size=8))
    alone = [_tokens(jaxspec.generate([p], target, **det))[0] for p in PROMPTS[:3]]
    assert alone == plain[:3]
    self_draft = _tokens(jaxspec.generate(PROMPTS, target, target, num_draft_tokens=3, **det, max_batch_size=8))
    assert self_draft == plain
    ngram = jaxspec.generate(PROMPTS, target, "ngram", num_draft_tokens=4, **det, max_batch_size=8)
    assert _tokens(ngram) == plain
    assert ngram.metrics.accepted > 0  # the lookups were tried and some kept, so verify rows made tokens
    continuous = _tokens(jaxspec.generate(PROMPTS, target, **det, max_batch_size=2))  # 6 prompts, 2 slots, refilled
    assert continuous == plain


def test_stops_and_penalties_keep_the_bits_under_speculation(tiny_bf16):
    """bfloat16, deterministic: with stop ids and penalties set, speculation (the target drafting for
    itself, unpenalized: it agrees where the penalties leave the argmax) gives plain decoding's
    tokens and logprobs bit for bit."""
    target = tiny_bf16[0]
    det = dict(max_new_tokens=24, deterministic=True, warn_below_acceptance=0.0, repetition_penalty=1.3,
               presence_penalty=0.4, frequency_penalty=0.2, logprobs=2, max_batch_size=8)
    free = _tokens(jaxspec.generate(PROMPTS, target, max_new_tokens=24, deterministic=True))
    det["stop_token_ids"] = [[free[0][7]], [free[1][3]], [], [], [], []]
    plain = jaxspec.generate(PROMPTS, target, **det)
    spec = jaxspec.generate(PROMPTS, target, target, num_draft_tokens=3, **det)
    assert _tokens(spec) == _tokens(plain) and spec.metrics.accepted > 0
    for a, b in zip(spec, plain):
        for x, y in zip(a.logprobs, b.logprobs):
            assert x == y
    assert [c.finish_reason for c in plain[:2]] == ["stop", "stop"]


def test_shared_prefixes_keep_the_bits(tiny_bf16):
    """bfloat16, deterministic: prompts after one 64-token preamble, prefilled once and copied
    (the default) or each whole, give the same tokens and logprobs bit for bit, plain and
    speculative."""
    target = tiny_bf16[0]
    preamble = np.random.default_rng(7).integers(3, 384, 64).tolist()
    prompts = [preamble + p for p in PROMPTS]
    det = dict(max_new_tokens=16, deterministic=True, warn_below_acceptance=0.0, logprobs=2, max_batch_size=8)
    for draft in (None, target):
        on = jaxspec.generate(prompts, target, draft, **det)
        off = jaxspec.generate(prompts, target, draft, prefix_cache=False, **det)
        assert on.metrics.cached_tokens == 5 * 64 and off.metrics.cached_tokens == 0
        assert _tokens(on) == _tokens(off)
        assert [c.logprobs for c in on] == [c.logprobs for c in off]


def test_trees_and_other_attention_are_refused_in_deterministic_mode(tiny_bf16):
    target = tiny_bf16[0]
    with pytest.raises(InputError, match="chains only"):
        jaxspec.generate(PROMPTS[:1], target, target, tree="binary-3", deterministic=True, max_new_tokens=4)
    with pytest.raises(InputError, match="chains only"):
        jaxspec.generate(PROMPTS[:1], target, "ngram", ngram_branches=2, deterministic=True, max_new_tokens=4)
    with pytest.raises(InputError, match="leave attention 'auto'"):
        jaxspec.generate(PROMPTS[:1], target, deterministic=True, attention="xla", max_new_tokens=4)
    with pytest.raises(InputError, match="deterministic must be True or False"):
        jaxspec.generate(PROMPTS[:1], target, deterministic="yes", max_new_tokens=4)
    with pytest.raises(InputError, match="auto_trees must be empty with deterministic"):
        JobSettings(deterministic=True, auto=True, auto_trees=("sparse",))
    with pytest.raises(InputError, match="chains only"):
        cache = KVCache.create(target.config, 1, 64, target.dtype, stacked=True)
        forward(target.weights, target.config, jnp.ones((1, 2), jnp.int32), cache, chunk_mask=jnp.ones((2, 2), bool),
                attention="deterministic")


@pytest.mark.parametrize("platform, device_kind", [("rocm", "gfx942"), ("cuda", "NVIDIA H200")])
@pytest.mark.parametrize("s", [128, 512])  # one split (the kernel writes out), several (partials and a merge)
def test_kernels_lower_ahead_of_time(platform, device_kind, s):
    """No GPU needed: both kernels lower to Triton custom calls for MI300X (ROCm) and H200."""
    q = jax.ShapeDtypeStruct((2, 4, 32, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, s, 8, 128), jnp.bfloat16)
    lengths = jax.ShapeDtypeStruct((2,), jnp.int32)
    x = jax.ShapeDtypeStruct((5, 4096), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((4096,), jnp.bfloat16)
    mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(device_kind, None, platform))
    for fn, args, names in [(causal_attention, (q, kv, kv, lengths), ["causal_attention"]),
                            (rms_norm, (x, w, 1e-5), ["rms_norm"])]:
        with use_abstract_mesh(mesh):
            text = fn.trace(*args).lower(lowering_platforms=(platform,)).as_text()
        assert "__gpu$xla.gpu.triton" in text and all(n in text for n in names), (fn, platform)
        if fn is causal_attention and s > 128:
            assert "causal_attention_merge" in text


@pytest.mark.multi_device
def test_a_split_target_is_deterministic_too(tmp_path):
    """Split two ways (the accelerators' layout: layers unrolled, gate/up fused), the o and down
    products' parts are added in shard order: a prompt's tokens alone equal its tokens in a
    batch and speculatively."""
    path = save_tiny(tmp_path / "gqa", "llama", dict(initializer_range=0.02), seed=5)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(jaxspec.model.layout, "scan_layers", lambda: False)
        mp.setattr(jaxspec.model.layout, "fuse_mlp", lambda: True)
        split = jaxspec.load(path, dtype="bfloat16", tensor_parallel=2)
        assert isinstance(split.weights.layers, tuple) and split.mesh is not None
        det = dict(max_new_tokens=16, deterministic=True, warn_below_acceptance=0.0)
        batch = _tokens(jaxspec.generate(PROMPTS[:4], split, **det))
        assert _tokens(jaxspec.generate(PROMPTS[1:2], split, **det)) == batch[1:2]
        assert _tokens(jaxspec.generate(PROMPTS[:4], split, "ngram", num_draft_tokens=3, **det)) == batch


def test_the_records_bench_counts_identical_records(tmp_path):
    """scripts/gpu_probes/bench_deterministic.py at toy size: random tiny target and draft, every
    run identical to its reference (in float32, where the default mode is exact too: its XLA
    graphs compile in a fraction of the interpret-mode kernels' time; deterministic mode's
    identities are test_deterministic_output_is_the_same_alone_in_any_batch_...), and its rows
    written."""
    path = Path(__file__).parents[1] / "scripts" / "gpu_probes" / "bench_deterministic.py"
    spec = importlib.util.spec_from_file_location("bench_deterministic", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "rows.json"
    rows = script.main(["--shape", "tiny", "--draft-shape", "tiny", "--records", "3", "--batch", "2", "--alone", "1",
                        "--max-budget", "6", "--k", "2", "--ngram-k", "2", "--modes", "default", "--dtype", "float32",
                        "--json", str(out)])
    assert [r["run"] for r in rows] == ["plain, static", "draft model K=2, static", "n-gram K=2, static",
                                        "plain, continuous refill 1", "plain, batch 1 (1 records)"]
    assert all(r["identical"] == r["records"] for r in rows)
    assert json.loads(out.read_text())["rows"] == rows


def test_the_cost_probe_runs_each_part_of_deterministic_mode_as_a_setting(capsys):
    """scripts/gpu_probes/deterministic_cost.py at toy size: its variants are DeterministicParts
    (forward's `attention`), not patches; "deterministic" is every part on. One step each."""
    assert deterministic_parts("deterministic") == DeterministicParts() == deterministic_parts(True)
    assert deterministic_parts("pallas") is None and deterministic_parts(False) is None
    path = Path(__file__).parents[1] / "scripts" / "gpu_probes" / "deterministic_cost.py"
    spec = importlib.util.spec_from_file_location("deterministic_cost", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    parts = [name for name, mode in script.VARIANTS.items() if isinstance(mode, DeterministicParts)]
    assert len(parts) == 4
    assert script.main(["--shape", "tiny", "--prefix", "8", "--steps", "1", "--repeats", "1", "--variants", *parts]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| tiny | B=1 |")]
    assert [row.split(" | ")[2] for row in rows] == parts and all(row.endswith(" ms |") for row in rows)


@pytest.mark.timing
def test_the_scale_bench_times_deterministic_mode_and_refuses_its_trees(tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = ["bench", "--shape", "tiny", "--no-hf", "--prompt-lens", "32", "--new-tokens", "8", "--batch-sizes", "1",
            "--repeats", "1", "--deterministic"]
    assert cli_main([*args, "--parts", "plain", "--json", str(out)]) == 0
    (plain,) = json.loads(out.read_text())["rows"]
    assert plain["part"] == "plain" and plain["ms_per_step"] > 0
    assert cli_main([*args, "--parts", "forward", "--verify-sizes", "1", "--trees", "binary-3"]) == 2
    assert "--trees: deterministic mode verifies chains only" in capsys.readouterr().err  # before any timing
    with pytest.raises(InputError, match="chains only"):  # the timed loop itself, for other callers
        forward_loop(None, 1, 32, np.ones((3, 3), bool), "deterministic", 1)


def test_the_command_line_passes_deterministic_to_generate_and_batch_jobs():
    parser = build_parser()
    assert job_settings(parser.parse_args(["batch", "in.jsonl", "out.jsonl", "--deterministic"])).options.deterministic
    assert not job_settings(parser.parse_args(["batch", "in.jsonl", "out.jsonl"])).options.deterministic
    assert parser.parse_args(["generate", "x", "--deterministic"]).deterministic
    assert parser.parse_args(["bench", "--deterministic"]).deterministic
