"""Adaptive K (adaptive_k=True): the set of K values, a paused draft model's catch-up against a
prefill of the same tokens, greedy output equal to plain decoding while K changes between
segments (0 included, so the draft model catches up), per-position counts that record the K
mix, the exact sampling distribution of paused rounds, and the settings' errors."""

import itertools
import json

import jax.numpy as jnp
import numpy as np
import pytest
from test_deterministic import PROMPTS as DET_PROMPTS
from test_deterministic import tiny_bf16  # noqa: F401  (fixture)
from test_speculative_distribution import N, PROMPT, SETTINGS, chi2_pvalue, exact_joint
from test_speculative_distribution import pair as tiny_pair  # noqa: F401  (fixture)

import jaxspec
from jaxspec.batch import JobSettings, read_output, run_job
from jaxspec.decoding.adaptive import k_choices
from jaxspec.decoding.draft_model import CATCH_UP_CHUNK, ModelDrafter
from jaxspec.decoding.method import DecodeMethod
from jaxspec.decoding.state import prefill
from jaxspec.decoding.trees import chain
from jaxspec.errors import InputError
from jaxspec.sampling_params import SamplingParams
from jaxspec.serving import adaptive_k, continuous
from jaxspec.serving.generate import build_requests
from jaxspec.serving.requests import Request
from jaxspec.serving.runner import run

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def test_k_choices_halve_down_to_plain():
    assert k_choices(3) == (0, 1, 3)
    assert k_choices(5) == (0, 1, 2, 5)
    assert k_choices(8) == (0, 1, 2, 4, 8)
    assert k_choices(1) == (0, 1)


def test_catch_up_gives_the_cache_a_prefill_gives(real_pair):
    """Row 0's draft cache, left at its prompt's end, catches up over 2.5 chunks of output; row 1's,
    whole to slot 45 of 57, catches up to 53 with a chunk started early (it may not pass the
    cache's end). Every slot below n - 2 then holds what a prefill of the same tokens writes."""
    _, draft = real_pair
    rng = np.random.default_rng(0)
    max_out, capacity = 48, 57
    prompt_lens, whole_to, n = np.array([5, 9]), [5, 45], np.array([5 + 2 * CATCH_UP_CHUNK + 8, 55])
    rows = [rng.integers(1, draft.config.vocab_size, size=p + max_out).tolist() for p in prompt_lens]
    batch = build_batch(draft, [r[:w] for r, w in zip(rows, whole_to)], capacity)
    cache = prefill(draft.weights, draft.config, batch, capacity)[1]
    out_tokens = jnp.asarray([r[p : p + max_out] for r, p in zip(rows, prompt_lens)], jnp.int32)
    caught = ModelDrafter(draft.config, chain(3)).catch_up(draft.weights, cache, out_tokens,
                                                           jnp.asarray(prompt_lens, jnp.int32), jnp.asarray(n, jnp.int32),
                                                           jnp.ones(2, bool))
    assert caught.k.ndim == 5  # [layers, rows, slots, heads, dim]: the CPU's stacked layout
    for row, m in enumerate(n - 2):
        ref = prefill(draft.weights, draft.config, build_batch(draft, [rows[row][:m]], capacity), capacity)[1]
        for got, want in ((caught.k, ref.k), (caught.v, ref.v)):
            np.testing.assert_allclose(np.asarray(got)[:, row : row + 1, :m], np.asarray(want)[:, :, :m],
                                       rtol=2e-5, atol=2e-5)
    assert (np.asarray(caught.lengths) == n - 2).all()


def build_batch(model, prompts, capacity):
    from jaxspec.serving.batching import make_batch, stop_plan

    reqs = build_requests(prompts, model, SamplingParams(max_tokens=capacity - max(map(len, prompts))))
    return make_batch(reqs, len(reqs), max(map(len, prompts)), model.config.pad_token_id, stop_plan(reqs, model))


def cycling(monkeypatch, ks):
    """Each segment's K from `ks` in turn (no timing), in place of the chooser's."""
    order = itertools.cycle(ks)
    monkeypatch.setattr(adaptive_k.AdaptiveK, "next", lambda self, rows: (next(order), False))


@pytest.mark.parametrize("draft_kind", ["model", "ngram", "suffix"])
def test_greedy_output_is_plain_while_k_changes(real_pair, humaneval20, monkeypatch, draft_kind):
    target, model = real_pair
    draft = model if draft_kind == "model" else draft_kind
    kw = dict(max_new_tokens=40, max_batch_size=4)
    prompts = humaneval20[:10]
    plain = jaxspec.generate(prompts, target, **kw)
    cycling(monkeypatch, (3, 0, 0, 1, 0, 3, 3))
    rows = []
    shrink = continuous._Slots.shrink

    def shrinking(self):  # the loop's row counts, as the job drains
        shrink(self)
        rows.append(len(self.holder))

    monkeypatch.setattr(continuous._Slots, "shrink", shrinking)
    out = jaxspec.generate(prompts, target, draft, adaptive_k=True, **kw)
    assert [o.token_ids for o in out] == [o.token_ids for o in plain]
    assert rows[0] == 4 and {2, 1} <= set(rows)  # the last rows ran in loops of 2, then 1
    for o in out:
        s = o.stats
        rounds = s.target_steps - 1
        assert len(s.drafted_per_position) == 3 and rounds >= s.drafted_per_position[0] >= s.drafted_per_position[2]
        assert s.drafted == sum(s.drafted_per_position) and s.accepted <= s.drafted
    # rounds at K = 0, 1 and 3 all happened, within rows
    d = np.array([o.stats.drafted_per_position for o in out])
    steps = np.array([o.stats.target_steps - 1 for o in out])
    assert (steps > d[:, 0]).any() and (d[:, 0] > d[:, 1]).any() and (d[:, 2] > 0).any()


def test_deterministic_bf16_keeps_the_bits_while_k_changes(tiny_bf16, monkeypatch):  # noqa: F811
    """bfloat16, deterministic mode, the target drafting for itself: tokens and logprobs equal plain
    decoding's bit for bit while K moves between 3, 0 and 1 and the slots drain."""
    target = tiny_bf16[0]
    det = dict(max_new_tokens=24, deterministic=True, warn_below_acceptance=0.0, logprobs=2, max_batch_size=2)
    plain = jaxspec.generate(DET_PROMPTS, target, **det)
    cycling(monkeypatch, (3, 0, 1, 0, 3))
    spec = jaxspec.generate(DET_PROMPTS, target, target, adaptive_k=True, **det)
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain] and spec.metrics.accepted > 0
    assert [c.logprobs for c in spec] == [c.logprobs for c in plain]


def test_the_chooser_times_each_k_then_picks_by_tokens_per_second(real_pair, humaneval20, caplog):
    target, draft = real_pair
    prompts = humaneval20[:8]
    plain = jaxspec.generate(prompts, target, max_new_tokens=32, max_batch_size=4)
    with caplog.at_level("INFO", logger="jaxspec"):
        out = jaxspec.generate(prompts, target, draft, adaptive_k=True, max_new_tokens=32, max_batch_size=4)
    assert [o.token_ids for o in out] == [o.token_ids for o in plain]
    assert any("round costs at 4 rows measured (K=0:" in r.message and "K=3:" in r.message for r in caplog.records)
    chooser = adaptive_k.AdaptiveK((0, 1, 3), 3)
    for k, ms in ((3, 30.0), (1, 22.0), (0, 20.0)):
        assert chooser.next(16) == (k, True)
        chooser.timed(k, 16, ms * 4e-3, 4)
    chooser.record(np.array([8, 6, 4]), np.array([10, 10, 10]))  # 1 + 0.8 + 0.6 + 0.4 tokens
    assert chooser.next(16) == (3, False)  # 2.8 / 30 > 1.8 / 22 > 1 / 20
    chooser.record(np.array([0, 0, 0]), np.array([90, 90, 90]))  # acceptance falls to 0.08 ...
    assert chooser.next(16) == (0, False)
    assert chooser.next(4) == (3, True)  # fewer rows: timed afresh


def test_paused_rounds_sample_the_target_distribution(tiny_pair, monkeypatch):  # noqa: F811
    """Rounds at K = 0 (the draft model paused) through the adaptive loops: tokens 2 and 3 follow
    the target's own sampling (test_speculative_distribution's check)."""

    target, draft = tiny_pair
    cycling(monkeypatch, (0,))
    setting = SETTINGS[0]
    reqs = [Request(PROMPT, setting.updated({"max_tokens": 3, "seed": seed})) for seed in range(N)]
    outs = run(target, reqs, 8192, DecodeMethod.of(draft, 2), draft, scheduler="continuous", adaptive_k=True)
    counts = np.zeros((16, 16))
    for o in outs:
        counts[o.token_ids[1], o.token_ids[2]] += 1
        assert o.stats.drafted == 0 and o.stats.target_steps == 3
    assert chi2_pvalue(counts, exact_joint(target, setting)) > 1e-4


def test_bad_settings_are_named(real_pair, tmp_path):
    target, draft = real_pair
    with pytest.raises(InputError, match="adaptive_k chooses K as the continuous scheduler"):
        JobSettings(adaptive_k=True, scheduler="static")
    with pytest.raises(InputError, match="adaptive_k must be True or False"):
        jaxspec.RunOptions(adaptive_k="yes")
    with pytest.raises(InputError, match="a draft tree is fixed"):
        jaxspec.generate(["def f():"], target, draft, tree="binary-3", adaptive_k=True, max_new_tokens=4)


def test_a_batch_job_with_adaptive_k_writes_plain_output(real_pair, humaneval20, tmp_path):
    target, draft = real_pair
    records = tmp_path / "in.jsonl"
    records.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate(humaneval20[:6])))
    outs = {}
    for name, adaptive in (("plain", False), ("adaptive", True)):
        settings = JobSettings(batch_size=4, max_new_tokens=24, adaptive_k=adaptive, progress=False)
        run_job(records, tmp_path / f"{name}.jsonl", target, draft if adaptive else None, settings)
        outs[name] = {x["id"]: x["token_ids"] for x in read_output(tmp_path / f"{name}.jsonl")}
    assert outs["adaptive"] == outs["plain"]
    events = [json.loads(line) for line in (tmp_path / "adaptive.metrics.jsonl").read_text().splitlines()]
    batches = [e for e in events if e["event"] == "batch"]
    assert batches and all(sum(e["rounds_per_k"].values()) > 0 for e in batches)
