"""Speculative decoding is lossless: greedy output equals the target's own, token for token."""

import dataclasses

import jax
import pytest
from tiny_models import TINY, request, save_tiny

import jaxspec
from jaxspec.decoding.draft_model import ModelDrafter
from jaxspec.decoding.loop import decode
from jaxspec.decoding.method import DecodeMethod
from jaxspec.decoding.speculative import SpeculativeLoop
from jaxspec.decoding.trees import chain

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
MAX_NEW = 48


@pytest.fixture(scope="module")
def pair(real_pair):
    return real_pair


@pytest.fixture(scope="module")
def prompts(humaneval20):
    return humaneval20


@pytest.fixture(scope="module")
def plain(pair, prompts):
    return jaxspec.generate(prompts, pair[0], max_new_tokens=MAX_NEW, max_batch_size=32)


# Every K in batches of 8; one K one prompt at a time (a lone row's own graph).
@pytest.mark.parametrize("k, batch_size", [(1, 8), (2, 8), (4, 8), (8, 8), (3, 1)])
def test_greedy_equals_target_on_humaneval(pair, prompts, plain, k, batch_size):
    target, draft = pair
    spec = jaxspec.generate(
        prompts, target, draft, max_new_tokens=MAX_NEW, num_draft_tokens=k, max_batch_size=batch_size
    )
    for i, (a, b) in enumerate(zip(spec, plain)):
        assert a.token_ids == b.token_ids, f"prompt {i}"
        assert a.finish_reason == b.finish_reason
    assert spec.metrics.tokens_per_step > 1.2  # the real pair agrees on ~72 % of tokens
    for out in spec:
        s = out.stats
        assert s.drafted == k * (s.target_steps - 1)
        assert s.accepted == sum(s.accepted_per_position) <= s.drafted
        # Accepting position j needs position j-1 accepted first.
        assert list(s.accepted_per_position) == sorted(s.accepted_per_position, reverse=True)


def test_draft_equal_to_target_accepts_everything(pair, prompts):
    target, _ = pair
    outs = jaxspec.generate(prompts[:4], target, target, max_new_tokens=40, num_draft_tokens=4)
    for out in outs:
        assert out.stats.per_position_acceptance == (1.0, 1.0, 1.0, 1.0)
        assert out.stats.acceptance_rate == 1.0


@pytest.mark.parametrize("max_new", [1, 2, 5, 17])
def test_max_new_tokens_is_exact(pair, prompts, max_new):
    target, draft = pair
    spec = jaxspec.generate(prompts[:3], target, draft, max_new_tokens=max_new, num_draft_tokens=4)
    ref = jaxspec.generate(prompts[:3], target, max_new_tokens=max_new)
    assert [o.token_ids for o in spec] == [o.token_ids for o in ref]
    assert all(len(o.token_ids) <= max_new for o in spec)


def test_eos_inside_an_accepted_run_ends_the_row(pair, prompts):
    """Declare a token that the draft gets right mid-run an EOS: the row must stop right there."""
    target, draft = pair
    free = jaxspec.generate(prompts[:4], target, draft, max_new_tokens=MAX_NEW, num_draft_tokens=8)
    stop = free[0].token_ids[9]
    config = dataclasses.replace(target.config, eos_token_ids=(stop,))
    stopping = dataclasses.replace(target, config=config)
    spec = jaxspec.generate(prompts[:4], stopping, draft, max_new_tokens=MAX_NEW, num_draft_tokens=8)
    ref = jaxspec.generate(prompts[:4], stopping, max_new_tokens=MAX_NEW)
    assert [o.token_ids for o in spec] == [o.token_ids for o in ref]
    assert [o.finish_reason for o in spec] == [o.finish_reason for o in ref]
    assert spec[0].finish_reason == "stop" and spec[0].token_ids[-1] == stop


@pytest.mark.parametrize("drafter", ["model K=8", "ngram K=8", "model tree"])
def test_stop_token_ids_end_rows_as_plain_decoding_does(pair, prompts, drafter):
    """Each prompt's own stop ids, one of them a token the draft gets right mid-run: every row ends
    where plain decoding with the same stops ends it, "stop" with stop_reason the id, its text
    without the stop token, and no round after the one that generated it."""
    target, draft = pair
    free = jaxspec.generate(prompts[:4], target, max_new_tokens=MAX_NEW)
    stops = [[free[0].token_ids[9]], [free[1].token_ids[4], 7], [], [free[3].token_ids[20]]]
    sampling = [jaxspec.SamplingParams(temperature=0, max_tokens=MAX_NEW, seed=0, stop_token_ids=s) for s in stops]
    how = {"model K=8": dict(draft=draft, num_draft_tokens=8), "ngram K=8": dict(draft="ngram", num_draft_tokens=8),
           "model tree": dict(draft=draft, tree="binary-3")}[drafter]
    draft_arg = how.pop("draft")
    spec = jaxspec.generate(prompts[:4], target, draft_arg, sampling=sampling, **how)
    ref = jaxspec.generate(prompts[:4], target, sampling=sampling)
    assert [o.token_ids for o in spec] == [o.token_ids for o in ref]
    for out, plain_out, own, full in zip(spec, ref, stops, free):
        assert (out.finish_reason, out.stop_reason, out.text) == (plain_out.finish_reason, plain_out.stop_reason,
                                                                  plain_out.text)
        if own:
            assert out.finish_reason == "stop" and out.stop_reason == out.token_ids[-1] in own
            assert out.text == target.tokenizer.decode(out.token_ids[:-1], skip_special_tokens=True)
            assert out.stats.target_steps - 1 <= len(out.token_ids)  # no round past the stop
        else:
            assert out.token_ids == full.token_ids
    assert spec[0].token_ids == free[0].token_ids[:10]


@pytest.mark.parametrize("family", ["llama3_rope", "mistral_swa", "qwen2", "qwen3"])
def test_greedy_equals_target_for_tiny_pairs_of_other_families(tmp_path, family):
    kind, overrides = TINY[family]
    target = jaxspec.load(save_tiny(tmp_path / "t", kind, overrides, seed=1), dtype="float32")
    draft_overrides = {**overrides, "num_hidden_layers": 1}
    draft = jaxspec.load(save_tiny(tmp_path / "d", kind, draft_overrides, seed=2), dtype="float32")
    prompts = [[5, 9, 33, 7], list(range(3, 40)), [100] * 19]
    ref = jaxspec.generate(prompts, target, max_new_tokens=40)
    # Draft == target drives long accepted runs; a random draft drives constant rejections.
    for d in (draft, target):
        for k in (1, 3):
            spec = jaxspec.generate(prompts, target, d, max_new_tokens=40, num_draft_tokens=k)
            assert [o.token_ids for o in spec] == [o.token_ids for o in ref]


def test_seeded_sampling_does_not_depend_on_batch_mates(pair, prompts):
    target, draft = pair
    kw = dict(max_new_tokens=32, temperature=0.8, top_p=0.95, num_draft_tokens=3)
    alone = jaxspec.generate([prompts[3]], target, draft, seed=[11], **kw)[0].token_ids
    together = jaxspec.generate([prompts[0], prompts[3], prompts[5]], target, draft, seed=[1, 11, 2], **kw)
    assert together[1].token_ids == alone
    other = jaxspec.generate([prompts[3]], target, draft, seed=[12], **kw)[0].token_ids
    assert other != alone


def test_mixed_greedy_and_sampled_rows(pair, prompts):
    """A greedy row keeps the target's greedy output beside sampled rows."""
    target, draft = pair
    from jaxspec.serving.runner import run

    ids = [tuple(target.tokenizer.encode(p)) for p in prompts[:2]]
    reqs = [request(ids[0], 24), request(ids[1], 24, 3, temperature=1.0, top_k=20, top_p=0.9)]
    outs = run(target, reqs, 2, DecodeMethod("draft", 3), draft)
    ref = jaxspec.generate([list(ids[0])], target, max_new_tokens=24)
    assert outs[0].token_ids == ref[0].token_ids


def test_one_compiled_loop_and_no_host_round_trips(pair, prompts):
    """The whole generation is a single while_loop in one graph, with no host callbacks."""
    target, draft = pair
    from jaxspec.serving.batching import make_batch

    batch = make_batch([request((1, 2, 3), 8)], 1, 16, 0)
    jaxpr = jax.make_jaxpr(
        lambda t, d, b: decode(
            t, d, b, loop=SpeculativeLoop(target.config, ModelDrafter(draft.config, chain(4))), capacity=32,
            max_out=16, greedy_only=False,
        )
    )(target.weights, draft.weights, batch)
    inner = jaxpr.eqns[0].params["jaxpr"].jaxpr  # the jit
    names = [e.primitive.name for e in inner.eqns]
    assert names.count("while") == 1
    text = str(jaxpr)
    assert "callback" not in text and "infeed" not in text
    # And a second call with other prompt lengths in the same bucket compiles nothing.
    jaxspec.generate([prompts[0]], target, draft, max_new_tokens=16, num_draft_tokens=4)
    again = jaxspec.generate([prompts[0] + "    "], target, draft, max_new_tokens=16, num_draft_tokens=4)
    assert again.metrics.graphs_compiled == 0


@pytest.mark.parametrize("k", [0, 33, 2.0, True])
def test_bad_num_draft_tokens(pair, k):
    target, draft = pair
    with pytest.raises(jaxspec.InputError, match=r"num_draft_tokens must be an integer in \[1, 32\]"):
        jaxspec.generate(["x"], target, draft, num_draft_tokens=k)


def test_vocabulary_mismatch_is_refused(pair, tmp_path):
    target, _ = pair
    other = jaxspec.load(save_tiny(tmp_path / "tiny", *TINY["llama_gqa"]), dtype="float32")
    with pytest.raises(jaxspec.InputError, match="has vocab_size 384 but target 'code-target-16m' has 8192"):
        jaxspec.generate(["x"], target, other)


def test_sampling_settings_are_checked_on_the_speculative_path(pair):
    target, draft = pair
    with pytest.raises(jaxspec.InputError, match="top_p must be in"):
        jaxspec.generate(["x"], target, draft, top_p=0.0)


def test_low_acceptance_warns(pair, tmp_path, caplog):
    target, draft = pair
    with caplog.at_level("WARNING", logger="jaxspec"):
        jaxspec.generate(["def f(x):"], target, draft, max_new_tokens=16, num_draft_tokens=2,
                         warn_below_acceptance=1.0)  # a random pair accepts far less
    assert "may cost more than it saves" in caplog.text
