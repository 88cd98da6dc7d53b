"""Prompt-lookup (n-gram) drafting: the search against a plain-Python reference, lossless greedy
output, the exact sampling distribution with point-mass proposals, and its errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_speculative_distribution import (
    SETTINGS,
    chi2_pvalue,
    exact_joint,
    sampled_joint,
    sampled_with,
)
from test_speculative_distribution import pair as tiny_pair  # noqa: F401  (fixture)
from tiny_models import TINY, request, save_tiny

import jaxspec
from jaxspec.decoding.ngram import (
    Ngram,
    NgramDrafter,
    continuations,
    distinct,
    ngram_tree,
)
from jaxspec.decoding.loop import decode
from jaxspec.decoding.speculative import SpeculativeLoop

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
MAX_NEW = 64


def reference_proposal(seq: list[int], lo: int, hi: int, k: int) -> list[int]:
    """The longest suffix (hi down to lo tokens) with an earlier occurrence; the k tokens after
    its most recent one, repeating with the period where they run into the suffix; else the
    last token k times."""
    n = len(seq)
    for size in range(hi, lo - 1, -1):
        if size > n - 1:
            continue
        suffix = seq[n - size:]
        for end in range(n - 2, size - 2, -1):  # end of an earlier occurrence, most recent first
            if seq[end - size + 1 : end + 1] == suffix:
                period = n - 1 - end
                return [seq[end + 1 + i % period] for i in range(k)]
    return [seq[-1]] * k


def test_search_matches_a_python_reference():
    rng = np.random.default_rng(0)
    for trial in range(40):
        b, width = 6, 40
        lo, hi, k = [(1, 3, 4), (2, 2, 3), (1, 1, 6), (2, 4, 5)][trial % 4]
        vocab = int(rng.integers(2, 6))  # few symbols: many repeats and overlaps
        history = rng.integers(0, vocab, (b, width)).astype(np.int32)
        n = rng.integers(2, width + 1, b).astype(np.int32)
        masked = np.where(np.arange(width)[None] < n[:, None], history, -1)
        tokens, _ = continuations(jnp.asarray(masked), jnp.asarray(n), lo, hi, k, 1)
        for row in range(b):
            want = reference_proposal(history[row, : n[row]].tolist(), lo, hi, k)
            assert np.asarray(tokens)[row, 0].tolist() == want, (history[row, : n[row]].tolist(), lo, hi, k)


def test_branches_take_distinct_continuations_most_recent_first():
    seq = [5, 1, 2, 9, 5, 1, 3, 9, 5, 1, 2, 8, 5, 1]  # "5 1" was followed by 2 9, 3 9, 2 8
    history = jnp.asarray([seq + [-1] * 4], jnp.int32)
    n = jnp.asarray([len(seq)], jnp.int32)
    tokens, found = continuations(history, n, 1, 2, 2, 8)
    picked = np.asarray(distinct(tokens, found, 4))[0].tolist()
    # most recent first; the fourth branch repeats the first (no fourth distinct continuation)
    assert picked == [[2, 8], [3, 9], [2, 9], [2, 8]]
    assert ngram_tree(2, 3) == (-1, 0, 1, 0, 3, 0, 5)


@pytest.fixture(scope="module")
def prompts(humaneval20):
    return humaneval20


@pytest.fixture(scope="module")
def plain(real_pair, prompts):
    return jaxspec.generate(prompts, real_pair[0], max_new_tokens=MAX_NEW, max_batch_size=32)


@pytest.mark.parametrize("k, branches, batch_size", [(2, 1, 8), (8, 1, 8), (4, 3, 8), (4, 1, 1)])
def test_greedy_equals_target_on_humaneval(real_pair, prompts, plain, k, branches, batch_size):
    target = real_pair[0]
    n = 20 if batch_size > 1 else 4
    outs = jaxspec.generate(prompts[:n], target, "ngram", num_draft_tokens=k, ngram_branches=branches,
                            max_new_tokens=MAX_NEW, max_batch_size=batch_size, warn_below_acceptance=0.0)
    for i, (a, b) in enumerate(zip(outs, plain)):
        assert a.token_ids == b.token_ids, f"prompt {i}"
        assert a.finish_reason == b.finish_reason
    # Code repeats its own names: lookup commits well over one token per target pass here.
    assert outs.metrics.tokens_per_step > 1.3
    for out in outs:
        s = out.stats
        assert s.drafted == k * (s.target_steps - 1)
        assert list(s.accepted_per_position) == sorted(s.accepted_per_position, reverse=True)


@pytest.mark.parametrize("family", ["qwen3", "mistral_swa"])
def test_greedy_for_tiny_models(tmp_path, family):
    kind, overrides = TINY[family]
    target = jaxspec.load(save_tiny(tmp_path / "t", kind, overrides, seed=1), dtype="float32")
    prompts = [[5, 9, 33, 7, 5, 9, 33], list(range(3, 40)), [100] * 19]
    ref = jaxspec.generate(prompts, target, max_new_tokens=40)
    for k, branches in ((3, 1), (2, 3)):
        outs = jaxspec.generate(prompts, target, "ngram", num_draft_tokens=k, ngram_branches=branches,
                                max_new_tokens=40, warn_below_acceptance=0.0)
        assert [o.token_ids for o in outs] == [o.token_ids for o in ref]


@pytest.mark.parametrize("branches, setting", [(1, SETTINGS[0]), (1, SETTINGS[2]), (3, SETTINGS[1])],
                         ids=["chain-T0.8", "chain-top_p", "tree-top_k"])
def test_sampling_matches_target_distribution(tiny_pair, branches, setting):  # noqa: F811
    """Tokens 2 and 3 come from one lookup round of K = 2 (point-mass proposals, accepted with
    probability p, else p without them); their joint must be the target's."""
    target, _ = tiny_pair
    counts = sampled_joint(target, Ngram(branches=branches), setting)
    assert chi2_pvalue(counts, exact_joint(target, setting)) > 1e-4


def test_one_compiled_loop(real_pair):
    from jaxspec.serving.batching import make_batch

    target = real_pair[0]
    batch = make_batch([request((1, 2, 3, 1, 2), 8)], 1, 16, 0)
    jaxpr = jax.make_jaxpr(lambda t, b: decode(
        t, None, b, loop=SpeculativeLoop(target.config, NgramDrafter(4, 2)), capacity=32, max_out=16,
        greedy_only=False))(target.weights, batch)
    names = [e.primitive.name for e in jaxpr.eqns[0].params["jaxpr"].jaxpr.eqns]
    assert names.count("while") == 1 and "callback" not in str(jaxpr)


@pytest.mark.parametrize("kw, match", [
    (dict(draft="ngrams"), 'draft must be a model from jaxspec.load, "ngram", "suffix" or None'),
    (dict(draft="ngram", ngram_min=3, ngram_max=2), r"ngram_min \(3\) must not exceed ngram_max \(2\)"),
    (dict(draft="ngram", ngram_max=0), r"ngram_max must be an integer in \[1, 16\]"),
    (dict(draft="ngram", ngram_branches=8, num_draft_tokens=8), "a round drafts at most 63 tokens; ngram K=8 x8 drafts 64"),
    (dict(draft="ngram", tree="sparse"), "tree is for a draft model or an EAGLE-3 head; ngram builds its own"),
    (dict(draft="ngram", num_draft_tokens=0), r"num_draft_tokens must be an integer in \[1, 32\]"),
])
def test_bad_settings_are_refused(real_pair, kw, match):
    with pytest.raises(jaxspec.InputError, match=match):
        jaxspec.generate(["x"], real_pair[0], **kw)


def test_batch_job_with_ngram_lookup(tmp_path, real_pair):
    import json

    from jaxspec import cli
    from jaxspec.batch import JobSettings, read_output, run_job

    target = real_pair[0]
    prompts = ["def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n", "for i in range(3):\n    print(i)\nfor j in",
               "class Stack:\n    def __init__(self):\n"]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate(prompts)) + '{"id": 9}\n')
    ref = jaxspec.generate(prompts, target, max_new_tokens=24)
    s = run_job(src, tmp_path / "out.jsonl", target, Ngram(branches=2), JobSettings(
        num_draft_tokens=4, max_new_tokens=24, batch_size=2, plot_path=None, progress=False))
    got = {r["id"]: r for r in read_output(tmp_path / "out.jsonl")}
    assert sorted(got) == [0, 1, 2, 9] and "prompt is missing" in got[9]["error"]
    for i, r in enumerate(ref):
        assert got[i]["token_ids"] == r.token_ids and got[i]["method"] == "ngram K=4 x2"
        assert got[i]["stats"]["drafted"] == 4 * (got[i]["stats"]["target_steps"] - 1)
    assert (s["settings"]["draft"], s["settings"]["drafter"]) == ("ngram", "ngram")

    # The canary tries lookup beside the draft model, and keeps what it measured fastest.
    s = run_job(src, tmp_path / "auto.jsonl", target, real_pair[1], JobSettings(
        max_new_tokens=24, batch_size=1, auto=True, auto_sample=2, auto_ks=(2,), auto_ngram_ks=(4,),
        auto_repeats=1, plot_path=None, progress=False))
    cands = {c["method"]: c for c in s["canary"]["candidates"]}
    assert set(cands) == {"plain", "speculative K=2", "ngram K=4"}
    assert cands["ngram K=4"]["drafter"] == "ngram" and cands["ngram K=4"]["greedy_identical"]
    best = max(cands.values(), key=lambda c: c["tokens_per_s"])
    fast_enough = best["tokens_per_s"] >= 1.05 * cands["plain"]["tokens_per_s"]
    assert s["canary"]["chosen"] == (best["method"] if fast_enough else "plain")
    got = {r["id"]: r for r in read_output(tmp_path / "auto.jsonl")}
    assert all(got[i]["token_ids"] == r.token_ids for i, r in enumerate(ref))

    # The command line: --draft ngram, and the canary with lookup alone.
    out = tmp_path / "cli.jsonl"
    assert cli.main(["batch", str(src), str(out), "--draft", "ngram", "--auto", "--auto-sample", "2",
                     "--auto-ngram-k", "3", "--auto-repeats", "1", "--max-new-tokens", "24", "--batch-size", "1",
                     "--no-progress", "--no-plot"]) == 0
    summary = json.loads((tmp_path / "cli.summary.json").read_text())
    assert [c["method"] for c in summary["canary"]["candidates"]] == ["plain", "ngram K=3"]
    assert cli.main(["batch", str(src), str(tmp_path / "bad.jsonl"), "--draft", "ngram", "--ngram-min", "4",
                     "--no-progress"]) == 2


def test_generate_command_line(capsys):
    import json

    from jaxspec import cli

    assert cli.main(["generate", "x = [1, 2, 3]\ny = [1, 2, 3]\nz = [", "--draft", "ngram", "--num-draft-tokens",
                     "4", "--ngram-branches", "2", "--max-new-tokens", "12", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(out["token_ids"]) == 12 and out["stats"]["drafted"] == 4 * (out["stats"]["target_steps"] - 1)


def test_the_test_catches_a_residual_that_keeps_the_rejected_token(tiny_pair):  # noqa: F811
    """The classic point-mass mistake: on rejection, drawing from p itself (x not removed)."""
    import jaxspec.decoding.speculative as speculative
    from jaxspec.decoding.acceptance import leading_true

    def keeps_x(drafts, q, p, uniforms, keys):
        k = drafts.shape[1]
        accepted = leading_true(uniforms < jnp.take_along_axis(p[:, :k], drafts[..., None], axis=-1)[..., 0])
        p_at = jnp.take_along_axis(p, accepted[:, None, None], axis=1)[:, 0]
        return accepted, jax.vmap(lambda key, r: jax.random.categorical(key, jnp.log(r)))(keys, p_at).astype(jnp.int32)

    target, _ = tiny_pair
    setting = SETTINGS[0]
    counts = sampled_with(speculative, "accept_sampling", keeps_x, target, Ngram(), setting)
    assert chi2_pvalue(counts, exact_joint(target, setting)) < 1e-6
