"""Shared prompt prefixes prefilled once (issue 50): the plan, output identical with sharing on and
off (float32; deterministic bf16 is in test_deterministic), the prefill tokens it spares, and
batch jobs' summaries and usage."""

from __future__ import annotations

import json

import pytest

import jaxspec
from jaxspec import cli
from jaxspec.batch import JobSettings, read_output, run_job
from jaxspec.bench.humaneval import load_prompts
from jaxspec.serving.prefixes import plan_prefixes

A = list(range(100, 140))  # 40 tokens


def test_plan_shares_each_prompts_deepest_common_whole_blocks():
    prompts = [A + [1, 2], A + [3], A[:20] + [9] * 30, [7] * 50, A[:17], A[:16]]
    plan = plan_prefixes(prompts, block=16, min_saved=1)
    # p0 and p1 share two blocks; p2 and p4 only the first; p3 nothing; p5 would share its
    # first block but must run its last token itself.
    assert plan.entries == (tuple(A[:32]), tuple(A[:16]))
    assert plan.of == {0: (0, 32), 1: (0, 32), 2: (1, 16), 4: (1, 16)}
    kept = plan_prefixes(prompts, block=16, min_saved=20)  # the second saves 16 tokens: dropped
    assert kept.entries == (tuple(A[:32]),) and set(kept.of) == {0, 1}
    assert plan_prefixes(prompts, block=16, min_saved=1, max_entries=1).entries == kept.entries
    # The store's shape (bucketed rows x width) stays within max_tokens: 1 x 32 fits 32, 2 x 32 does not.
    assert plan_prefixes(prompts, block=16, min_saved=1, max_tokens=63).entries == kept.entries
    assert plan_prefixes(prompts, block=16, min_saved=1, max_tokens=64).entries == plan.entries
    with pytest.raises(jaxspec.InputError, match=r"prefix_cache_tokens must be an integer >= 16"):
        jaxspec.RunOptions(prefix_cache_tokens=8)
    assert plan_prefixes([A + [1], [5] + A], block=16, min_saved=1).entries == ()


@pytest.fixture(scope="module")
def shared_prompts(real_pair):
    """Five code prompts after one preamble of about 180 tokens."""
    stubs = load_prompts(limit=12)
    preamble = "# Helpers used below.\n" + stubs[0] + stubs[1][:200]
    prompts = [preamble + s[:160] for s in stubs[5:10]]
    ids = [real_pair[0].tokenizer.encode(p) for p in prompts]
    return prompts, ids


@pytest.mark.parametrize("drafter, batch", [(None, 8), ("draft", 2), ("ngram", 8)])
def test_output_is_identical_with_sharing_on_and_off(real_pair, shared_prompts, drafter, batch):
    """float32, greedy: the same tokens under each scheduler (batch 2 runs five prompts through
    continuous slots), with each request's cached_tokens and the call's prefill tokens."""
    target, draft = real_pair
    draft = {"draft": draft, None: None, "ngram": "ngram"}[drafter]
    prompts, ids = shared_prompts
    kw = dict(max_new_tokens=12, max_batch_size=batch, num_draft_tokens=3, warn_below_acceptance=0.0)
    on = jaxspec.generate(prompts, target, draft, **kw)
    off = jaxspec.generate(prompts, target, draft, prefix_cache=False, **kw)
    assert [c.token_ids for c in on] == [c.token_ids for c in off]
    (shared,) = plan_prefixes(ids).entries
    n, total = len(shared), sum(map(len, ids))
    assert n >= 160 and sorted(c.stats.cached_tokens for c in on) == [0] + [n] * 4
    assert (on.metrics.prompt_tokens, on.metrics.prefill_tokens, on.metrics.cached_tokens) == (total, total - 4 * n, 4 * n)
    assert (off.metrics.prefill_tokens, off.metrics.cached_tokens) == (total, 0)


def test_n_samples_prefill_their_prompt_once(real_pair):
    """n=3 sampled: the three share every whole block but the last token's, and sample as they do
    without sharing."""
    target = real_pair[0]
    prompt = load_prompts(limit=11)[10]  # 189 tokens
    length = len(target.tokenizer.encode(prompt))
    assert length >= 145
    sampling = jaxspec.SamplingParams(n=3, temperature=1.0, max_tokens=10, seed=5)
    on = jaxspec.generate([prompt], target, sampling=sampling)
    off = jaxspec.generate([prompt], target, sampling=sampling, prefix_cache=False)
    assert [c.token_ids for c in on] == [c.token_ids for c in off] and [c.index for c in on] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in on}) > 1  # distinct seeded samples
    shared = (length - 1) // 16 * 16
    assert on.metrics.prefill_tokens == 3 * length - 2 * shared


def test_a_job_reports_prefill_and_reused_tokens(tmp_path, real_pair, shared_prompts):
    """The summary and each record count the tokens a shared prefix spared;
    --no-prefix-cache writes the same records with none spared."""
    target = real_pair[0]
    prompts, ids = shared_prompts
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate(prompts)))
    summary = run_job(src, tmp_path / "on.jsonl", target, settings=JobSettings(max_new_tokens=6, progress=False))
    n, total = len(plan_prefixes(ids).entries[0]), sum(map(len, ids))
    t = summary["totals"]
    assert (t["prompt_tokens"], t["prefill_tokens"], t["cached_tokens"]) == (total, total - 4 * n, 4 * n)
    assert cli.main(["batch", str(src), str(tmp_path / "off.jsonl"), "--target", str(target.path),
                     "--max-new-tokens", "6", "--no-prefix-cache", "--no-progress"]) == 0
    on, off = read_output(tmp_path / "on.jsonl"), read_output(tmp_path / "off.jsonl")
    assert {r["id"]: r["token_ids"] for r in on} == {r["id"]: r["token_ids"] for r in off}
    assert sum(r["stats"]["cached_tokens"] for r in off) == 0
