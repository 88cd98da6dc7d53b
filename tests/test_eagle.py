"""EAGLE-3 heads (jaxspec.model.eagle, jaxspec.decoding.eagle): the published folder layout loads,
the head's layer matches an independent torch transcription of SGLang's, the target's features
match transformers' hidden states, the drafter's incremental bookkeeping proposes what a full
recompute proposes after rounds of any acceptance, and speculative output equals plain output."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_models import request

import jaxspec
from jaxspec.decoding.drafting import Round
from jaxspec.decoding.method import DecodeMethod
from jaxspec.decoding.tree_verify import TreePlan
from jaxspec.decoding.trees import ancestor_mask
from jaxspec.errors import InputError
from jaxspec.model.cache import KVCache
from jaxspec.model.eagle import (
    fuse_features,
    head_cache,
    head_forward,
    random_eagle_folder,
)
from jaxspec.model.forward import forward, rms_norm
from jaxspec.serving.batching import make_batch

HF = Path(__file__).resolve().parents[1] / "checkpoints" / "hf"
PROMPTS = ["def fibonacci(n):", "import os\n\ndef list_files(path):\n    ", "class Queue:\n    def put(self, x):"]


@pytest.fixture(scope="module")
def target():
    return jaxspec.load(HF / "code-target-16m", dtype="float32")


@pytest.fixture(scope="module")
def head(target, tmp_path_factory):
    folder = random_eagle_folder(tmp_path_factory.mktemp("eagle"), target.config, draft_vocab_size=1024, seed=3,
                                 intermediate_size=512)
    return jaxspec.load(folder, dtype="float32")


def test_features_are_the_hidden_states_entering_each_layer(tmp_path):
    torch = pytest.importorskip("torch")
    from tiny_models import save_tiny

    folder = save_tiny(tmp_path / "m", "llama", {"num_hidden_layers": 4})
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model = jaxspec.load(folder, dtype="float32")
    tokens = np.array([[5, 17, 42, 7, 99, 3]], np.int32)
    with torch.no_grad():
        want = hf(torch.tensor(tokens, dtype=torch.long), output_hidden_states=True).hidden_states
    cache = KVCache.create(model.config, 1, 64, jnp.float32)
    _, _, feats = forward(model.weights, model.config, jnp.asarray(tokens), cache, features_at=(0, 2, 3, 4))
    for j, layer in enumerate((0, 2, 3, 4)):
        got = feats[..., j * 64:(j + 1) * 64]
        if layer == 4:  # the last layer's output: transformers lists it after the final norm
            got = rms_norm(got, model.weights.final_norm, model.config.rms_norm_eps)
        np.testing.assert_allclose(np.asarray(got), want[layer].numpy(), rtol=1e-4, atol=1e-4)


def test_the_head_layer_matches_a_torch_transcription_of_sglang(head, target):
    """SGLang's LlamaForCausalLMEagle3 midlayer, written out in torch from the folder's tensors."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file

    t = load_file(str(head.path / "model.safetensors"))
    c = head.config.layer
    rng = np.random.default_rng(0)
    T, d = 5, c.hidden_size
    tokens = rng.integers(0, c.vocab_size, (1, T)).astype(np.int32)
    feats = rng.standard_normal((1, T, 3 * d)).astype(np.float32)

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps) * w

    emb = torch.tensor(np.asarray(target.weights.embed))[torch.tensor(tokens, dtype=torch.long)]
    hidden = torch.tensor(feats) @ t["fc.weight"].T
    x = torch.cat([rms(emb, t["midlayer.input_layernorm.weight"]), rms(hidden, t["midlayer.hidden_norm.weight"])], -1)
    nh, nkv, hd = c.num_heads, c.num_kv_heads, c.head_dim
    q = (x @ t["midlayer.self_attn.q_proj.weight"].T).view(1, T, nh, hd).transpose(1, 2)
    k = (x @ t["midlayer.self_attn.k_proj.weight"].T).view(1, T, nkv, hd).transpose(1, 2)
    v = (x @ t["midlayer.self_attn.v_proj.weight"].T).view(1, T, nkv, hd).transpose(1, 2)
    inv = 1.0 / (c.rope.theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    ang = torch.arange(T, dtype=torch.float32)[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    rot = lambda y: torch.cat([-y[..., hd // 2:], y[..., : hd // 2]], -1)  # noqa: E731
    q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
    k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
    att = (q @ k.transpose(-1, -2)) / hd ** 0.5 + torch.triu(torch.full((T, T), float("-inf")), 1)
    o = (att.softmax(-1) @ v).transpose(1, 2).reshape(1, T, nh * hd) @ t["midlayer.self_attn.o_proj.weight"].T
    res = hidden + o
    m = rms(res, t["midlayer.post_attention_layernorm.weight"])
    mlp = (torch.nn.functional.silu(m @ t["midlayer.mlp.gate_proj.weight"].T) * (m @ t["midlayer.mlp.up_proj.weight"].T))
    out = res + mlp @ t["midlayer.mlp.down_proj.weight"].T
    logits = rms(out, t["norm.weight"]) @ t["lm_head.weight"].T

    w = head.weights
    got_logits, got_out, _ = head_forward(w, head.config, target.weights.embed, jnp.asarray(tokens),
                                          fuse_features(w, jnp.asarray(feats)), head_cache(head.config, 1, 64, jnp.float32))
    np.testing.assert_allclose(np.asarray(got_out), out.numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(got_logits), logits.numpy(), rtol=1e-4, atol=1e-4)


def _reference_start(head, target, layers, seq):
    """The head from scratch after committed tokens seq (s[n-1] pending): the target's features of
    seq[:-1], then every pair through the head in one pass -> (logits, h, head cache)."""
    w, c = head.weights, head.config
    cache = KVCache.create(target.config, 1, 256, jnp.float32)
    _, _, feats = forward(target.weights, target.config, jnp.asarray([seq[:-1]]), cache, features_at=layers)
    logits, out, hcache = head_forward(w, c, target.weights.embed, jnp.asarray([seq[1:]]), fuse_features(w, feats),
                                       head_cache(c, 1, 256, jnp.float32))
    return logits[:, -1], out[:, -1:], hcache.replace(lengths=jnp.asarray([len(seq) - 1]))


def _reference_distributions(head, target, start, drafts):
    """The head's distributions over the target's vocabulary for each of `drafts` from `start`
    (_reference_start): one step per draft on its own output."""
    w, c = head.weights, head.config
    logits, h, hcache = start
    qs = []
    for token in drafts:
        qs.append(jnp.zeros(c.layer.vocab_size).at[w.d2t].set(jax.nn.softmax(logits[0])))
        logits, h, hcache = head_forward(w, c, target.weights.embed, jnp.asarray([[token]]), h, hcache)
        logits = logits[:, 0]
        hcache = hcache.replace(lengths=hcache.lengths + 1)
    return jnp.stack(qs)


@pytest.mark.parametrize("tree", [None, (-1, 0, 0, 1, 1, 2, 3, 5)])
def test_drafts_equal_a_full_recompute_after_rounds_of_any_acceptance(head, target, tree):
    """Rounds are played by hand on a fixed text, accepting 0, 3, 1 and 2 drafts: after each, the
    distributions the drafter drew each node from must be what the head computes from scratch
    on everything committed and the node's ancestors (sampling at temperature 1, so they are
    whole distributions); for a chain, its drafts are those ancestors."""
    method = DecodeMethod.of(head, 3, tree)
    plan = TreePlan.of(method.parents)
    K, t = plan.max_depth, plan.size
    drafter, params = method.drafter(head, target)
    layers = drafter.feature_layers
    text = list(target.tokenizer.encode(PROMPTS[1] + "return [f for f in os.listdir(path) if f.endswith('.py')]"))
    P = 8
    batch = jax.tree.map(jnp.asarray, make_batch([request(text[:P], 64, temperature=1.0)], 1, P, 0))
    sampling = batch.sampling
    cache = KVCache.create(target.config, 1, 64, jnp.float32)
    _, _, feats = forward(target.weights, target.config, batch.tokens, cache, features_at=layers)
    state = drafter.init(params, batch, 64, 32, jnp.asarray([text[P]]), features=feats)
    n = P + 1  # committed: the prompt and its first token
    for i, accepted in enumerate((0, 3, 1, 2)):
        keys = jax.random.split(jax.random.PRNGKey(i), t - 1)[None]
        r = Round(jnp.asarray([n]), jnp.asarray([text[n - 2]]), jnp.asarray([text[n - 1]]), keys, sampling, False,
                  "xla")
        drafts, q, state = drafter.propose(params, state, r)
        drafts = [int(x) for x in drafts[0]]
        start = _reference_start(head, target, layers, text[:n])  # what every node's reference starts from
        for node in range(1, t):  # its ancestors below the root, then itself
            line = [a for a in range(1, t) if ancestor_mask(plan.parents)[node, a]]
            want = _reference_distributions(head, target, start, [drafts[a] for a in line])
            np.testing.assert_allclose(np.asarray(q[0, node - 1]), np.asarray(want[-1]), atol=1e-5)
        # The target verified [s[n-1], K tokens of the text]; the first `accepted` count as drafts.
        cache = KVCache.create(target.config, 1, 64, jnp.float32)
        _, _, feats = forward(target.weights, target.config, jnp.asarray([text[: n + K]]), cache, features_at=layers)
        path = jnp.arange(K + 1)[None]
        emitted = jnp.asarray([text[n : n + K + 1]])
        state = drafter.commit(params, state, r, path, emitted, jnp.asarray([accepted + 1]),
                               features=feats[:, n - 1 : n + K])
        n += accepted + 1


@pytest.mark.parametrize("batch_size,tree", [(1, None), (3, None), (1, "sparse"), (3, "binary-3")])
def test_speculative_output_equals_plain_output(head, target, batch_size, tree):
    plain = jaxspec.generate(PROMPTS, target, max_new_tokens=20, max_batch_size=batch_size)
    spec = jaxspec.generate(PROMPTS, target, head, num_draft_tokens=3, max_new_tokens=20, max_batch_size=batch_size,
                            tree=tree, warn_below_acceptance=0.0)
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
    assert all(c.stats.drafted > 0 for c in spec)


def test_a_head_that_does_not_fit_its_target_is_refused_by_name(target, tmp_path):
    folder = random_eagle_folder(tmp_path / "wide", target.config, draft_vocab_size=256, fc_width=3 * 512)
    wide = jaxspec.load(folder, dtype="float32")
    with pytest.raises(InputError, match=r"fc.weight reads 1536 features = 3 x 512, but code-target-16m's hidden size is 384"):
        jaxspec.generate(PROMPTS[:1], target, wide, max_new_tokens=4)


def test_jit_sees_one_graph_for_the_drafter(head, target):
    """The drafter is static and hashable: the loop's jit keys on it."""
    a, _ = DecodeMethod.of(head, 3).drafter(head, target)
    b, _ = DecodeMethod.of(head, 3).drafter(head, target)
    assert hash(a) == hash(b) and a == b and jax.tree.leaves(a) == [a]


def test_training_time_test_steps_are_what_drafting_computes(target, tmp_path):
    """scripts/train_eagle.py's unrolled steps (jaxspec.model.eagle_train) against the engine's
    head on the saved folder: step 1 at every position is the head over the true pairs; step s
    at position i is the engine's s-th draft step there, after true pairs up to i - s + 1."""
    import dataclasses

    from jaxspec.model.eagle import default_feature_layers, save_eagle_folder
    from jaxspec.model.eagle_train import init_params, to_published, ttt_logits

    c = target.config
    layers = default_feature_layers(c.num_layers)
    draft_ids = np.arange(0, c.vocab_size, 4)
    params = init_params(target, draft_ids, 256, seed=1)
    params = jax.tree.map(lambda a: a + 0.05 * jax.random.normal(jax.random.PRNGKey(2), a.shape), params)
    head = jaxspec.load(save_eagle_folder(tmp_path / "h", c, to_published(params, c, draft_ids), layers),
                        dtype="float32")
    config = dataclasses.replace(c, num_layers=1, intermediate_size=256)
    tokens = jnp.asarray([target.tokenizer.encode("def add(a, b):\n    return a + b\n")[:12]], jnp.int32)
    T = tokens.shape[1]
    _, _, feats = forward(target.weights, c, tokens, KVCache.create(c, 1, 64, jnp.float32), features_at=layers)
    steps = ttt_logits(params, config, target.weights.embed, feats, tokens, 3)

    w, embed = head.weights, target.weights.embed
    logits1, out1, _ = head_forward(w, head.config, embed, tokens[:, 1:], fuse_features(w, feats[:, : T - 1]),
                                    head_cache(head.config, 1, 64, jnp.float32))
    np.testing.assert_allclose(np.asarray(steps[0]), np.asarray(logits1), rtol=2e-4, atol=2e-4)
    for i in (4, 9):
        for s in (2, 3):
            start = i - s + 2  # the chain's first own step: true pairs 0 .. start - 1 are cached
            cache = head_cache(head.config, 1, 64, jnp.float32)
            _, _, cache = head_forward(w, head.config, embed, tokens[:, 1 : start + 1],
                                       fuse_features(w, feats[:, :start]), cache)
            cache = cache.replace(lengths=jnp.asarray([start]))
            h = out1[:, start - 1 : start]
            for p in range(start, i + 1):
                logits, h, cache = head_forward(w, head.config, embed, tokens[:, p + 1 : p + 2], h, cache)
                cache = cache.replace(lengths=cache.lengths + 1)
            np.testing.assert_allclose(np.asarray(steps[s - 1][:, i]), np.asarray(logits[:, 0]), rtol=2e-4, atol=2e-4)


def test_the_training_script_writes_a_head_that_drafts(target, tmp_path):
    """scripts/train_eagle.py end to end at toy size: a corpus folder in, a published-layout
    folder out that loads and drafts losslessly."""
    import importlib.util

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    source = Path(jaxspec.__file__).parent
    for f in sorted(source.glob("decoding/*.py"))[:6]:
        (corpus / f.name).write_text(f.read_text())
    spec = importlib.util.spec_from_file_location("train_eagle", Path(__file__).parents[1] / "scripts" / "train_eagle.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "head"
    assert script.main(["--corpus", str(corpus), "--out", str(out), "--steps", "2", "--batch-size", "2",
                        "--seq-len", "32", "--draft-vocab", "512", "--intermediate-size", "128",
                        "--feature-layers", "1", "3", "5", "--eval-prompts", "0"]) == 0
    # published ids name layers' outputs (the last one's among them); inside, forward's features_at
    assert json.loads((out / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"] \
        == [1, 3, 5]
    head = jaxspec.load(out, dtype="float32")
    assert head.config.draft_vocab_size == 512 and head.config.feature_layers == (2, 4, 6)
    plain = jaxspec.generate(PROMPTS[:1], target, max_new_tokens=8)
    assert jaxspec.generate(PROMPTS[:1], target, head, max_new_tokens=8, warn_below_acceptance=0)[0].token_ids \
        == plain[0].token_ids


def test_the_canary_tries_the_head_at_each_k_and_tree(head):
    from jaxspec.jobs.canary import candidates
    from jaxspec.jobs.settings import JobSettings

    settings = JobSettings(auto=True, auto_trees=("sparse",))
    methods = candidates(head, settings)
    assert methods[0] == DecodeMethod()
    assert [m.name for m in methods if m.kind == "eagle"] == [f"eagle K={k}" for k in settings.auto_ks] + [
        "eagle tree sparse"]
    assert all(m.settings is None or m.kind == "ngram" for m in methods)


def test_the_conversion_script_converts_a_head(head, target, tmp_path):
    """convert_hf_checkpoint on an EAGLE-3 folder: checked, cast to bfloat16, still the published
    layout; it loads and drafts as the source does. Quantizing a head is refused by name."""
    from jaxspec.model.checkpoint import convert_hf_checkpoint

    out = convert_hf_checkpoint(head.path, tmp_path / "head-bf16", dtype="bfloat16")
    converted = jaxspec.load(out, dtype="float32")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    to_bf16 = lambda a: a.astype(jnp.bfloat16).astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a  # noqa: E731
    want = jax.tree.map(lambda a: np.asarray(to_bf16(a)), head.weights)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, converted.weights), want)
    with pytest.raises(jaxspec.errors.CheckpointError, match="EAGLE-3 head: quantize applies to models"):
        convert_hf_checkpoint(head.path, tmp_path / "q", quantize="int8")


def test_a_batch_job_warns_when_the_heads_acceptance_is_low(head, target, tmp_path, caplog):
    """The random head accepts little: the job warns once, as for a draft model, and records it."""
    import logging

    from jaxspec.batch import JobSettings, run_job

    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate(PROMPTS)))
    with caplog.at_level(logging.WARNING, logger="jaxspec"):
        s = run_job(src, tmp_path / "out.jsonl", target, head, JobSettings(
            num_draft_tokens=3, max_new_tokens=8, batch_size=2, warn_below_acceptance=0.99, metrics_log=None,
            plot_path=None, progress=False))
    warnings = [r.getMessage() for r in caplog.records if "acceptance rate" in r.getMessage()]
    assert len(warnings) == 1 and "is below 0.99" in warnings[0] and head.name in warnings[0]
    assert s["settings"]["method"] == "eagle K=3" and s["totals"]["acceptance_rate"] < 0.99


def test_a_job_given_a_draft_model_and_a_head_lets_the_canary_choose(real_pair, tmp_path):
    """`jaxspec batch --draft MODEL --draft HEAD --auto`: the canary times both drafters (and
    n-gram lookup, and plain decoding), the job runs the one it picks, losslessly; two drafts
    without the canary are refused by name."""
    from jaxspec.batch import JobSettings, read_output, run_job
    from jaxspec.cli import main as cli_main
    from jaxspec.defaults import CHECKPOINTS, DEFAULT_EAGLE

    target, draft = real_pair
    shipped = jaxspec.load(CHECKPOINTS / "hf" / DEFAULT_EAGLE, dtype="float32")
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate(PROMPTS * 2)))
    out = tmp_path / "out.jsonl"
    assert cli_main(["batch", str(src), str(out), "--draft", str(CHECKPOINTS / "hf" / "code-draft-4m"),
                     "--draft", str(CHECKPOINTS / "hf" / DEFAULT_EAGLE), "--auto", "--auto-k", "2",
                     "--auto-ngram-k", "2", "--auto-sample", "2", "--auto-repeats", "1", "--batch-size", "2", "--max-new-tokens", "12",
                     "--dtype", "float32", "--no-progress", "--no-plot", "--no-metrics-log"]) == 0
    summary = json.loads((tmp_path / "out.summary.json").read_text())
    tried = [c["method"] for c in summary["canary"]["candidates"]]
    assert tried == ["plain", "speculative K=2", "eagle K=2", "ngram K=2"]
    assert summary["settings"]["draft"] == f"code-draft-4m + {DEFAULT_EAGLE}"
    plain = {i: c.token_ids for i, c in enumerate(jaxspec.generate(PROMPTS * 2, target, max_new_tokens=12))}
    assert {int(r["id"]): r["token_ids"] for r in read_output(out)} == plain
    with pytest.raises(InputError, match=r"2 drafts \(code-draft-4m \+ code-eagle-16m\) need auto=True"):
        run_job(src, tmp_path / "two.jsonl", target, [draft, shipped], JobSettings(progress=False))
    with pytest.raises(InputError, match="at most one draft model, one EAGLE-3 head"):
        run_job(src, tmp_path / "two.jsonl", target, [draft, draft], JobSettings(auto=True, progress=False))
