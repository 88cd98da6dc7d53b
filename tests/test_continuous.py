"""Continuous batching: slots refilled as rows finish give, per record, exactly what the static
scheduler and generate() on that record alone give (tokens, statistics, seeded samples)."""

import dataclasses

import jax
import numpy as np
import pytest
from tiny_models import request

import jaxspec
from jaxspec.decoding.ngram import Ngram
from jaxspec.errors import InputError
from jaxspec.batch import JobSettings, read_output, run_job
from jaxspec.bench.workloads import lognormal_budgets, write_humaneval_jsonl
from jaxspec.decoding.loop import advance
from jaxspec.decoding.method import DecodeMethod
from jaxspec.decoding.plain import PlainLoop
from jaxspec.serving.requests import Request
from jaxspec.serving.runner import run

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def requests_(real_pair, humaneval20):
    """20 HumanEval prompts with chat-like budgets (fixed-seed lognormal, 3 to 120 tokens)."""
    target = real_pair[0]
    budgets = lognormal_budgets(20, median=30, sigma=0.8, cap=120, seed=1)
    return [request(target.tokenizer.encode(p), b) for p, b in zip(humaneval20, budgets)]


def _same(a, b):
    return [x.token_ids for x in a] == [x.token_ids for x in b] and [x.stats for x in a] == [x.stats for x in b] and [
        x.finish_reason for x in a] == [x.finish_reason for x in b]


@pytest.mark.parametrize("how", ["plain", "model K=3", "model tree", "ngram K=4"])
def test_continuous_equals_static_and_alone(real_pair, requests_, how):
    target, draft = real_pair
    kw = {"plain": {}, "model K=3": dict(method=DecodeMethod("draft", 3), draft=draft),
          "model tree": dict(method=DecodeMethod("draft", tree=(-1, 0, 0, 1)), draft=draft),
          "ngram K=4": dict(method=DecodeMethod("ngram", 4, settings=Ngram()))}[how]
    static = run(target, requests_, 4, scheduler="static", **kw)
    continuous = run(target, requests_, 4, scheduler="continuous", **kw)
    assert _same(continuous, static)
    alone = [run(target, [r], 1, **kw)[0] for r in requests_[:3]]
    assert _same(continuous[:3], alone)
    assert [len(c.token_ids) for c in continuous] == [min(r.max_new_tokens, len(c.token_ids)) for r, c in
                                                        zip(requests_, continuous)]


def test_refill_policy_and_sampling_do_not_change_outputs(real_pair, requests_):
    target, draft = real_pair
    # 10 records in slots of 4: refills of every policy. Half their budgets (5-31 tokens: rows
    # still end at different steps): this test's runs execute the 16M pair 5 times, unoptimized.
    mixed = [request(r.token_ids, r.max_new_tokens // 2, 100 + i, **(dict(temperature=0.9, top_p=0.95) if i % 2 else {}))
             for i, r in enumerate(requests_[:10])]
    k2 = DecodeMethod("draft", 2)
    static = run(target, mixed, 4, k2, draft, scheduler="static")
    for refill_at, order in ((1, "longest"), (4, "longest"), (2, "arrival")):
        outs = run(target, mixed, 4, k2, draft, scheduler="continuous", refill_at=refill_at,
                   admit_order=order)
        assert _same(outs, static)
    with pytest.raises(InputError, match="admit_order must be one of longest, arrival; got 'fifo'"):
        run(target, mixed, 4, scheduler="continuous", admit_order="fifo")
    reseeded = Request(mixed[1].token_ids, dataclasses.replace(mixed[1].sampling, seed=7))  # the sampled rows really sample
    assert static[1].token_ids != run(target, [reseeded], 1, k2, draft)[0].token_ids


def test_generate_past_one_batch_uses_slots(real_pair, requests_):
    target = real_pair[0]
    prompts = [list(r.token_ids) for r in requests_[:9]]
    outs = jaxspec.generate(prompts, target, max_new_tokens=24, max_batch_size=4)
    assert [o.token_ids for o in outs] == [o.token_ids for o in jaxspec.generate(prompts, target, max_new_tokens=24,
                                                                                 max_batch_size=9)]


def test_the_loop_returns_only_when_rows_free_up(real_pair):
    """One while_loop, no host callbacks; it stops after `need` rows finished."""
    target = real_pair[0]
    from jaxspec.decoding.slots import admit, begin
    from jaxspec.serving.batching import make_batch

    loop = PlainLoop(target.config)
    static = dict(loop=loop, capacity=64, max_out=32, greedy_only=True)
    reqs = [request((5, 6, 7), budget) for budget in (3, 9, 30, 30)]
    state, batch = begin(target.weights, None, make_batch([], 4, 1, 0), **static)
    state, batch = admit(target.weights, None, state, batch, make_batch(reqs, 4, 16, 0), jax.numpy.arange(4), **static)
    kw = dict(loop=loop, greedy_only=True, attention="xla")
    jaxpr = str(jax.make_jaxpr(lambda s: advance(target.weights, None, batch, s, 1, 1000, **kw))(state))
    assert jaxpr.count("while[") == 1 and "callback" not in jaxpr
    state = advance(target.weights, None, batch, state, 1, 1000, **kw)
    assert np.asarray(state.num_generated).tolist() == [3, 3, 3, 3]  # the first row's budget ended it
    state = advance(target.weights, None, batch, state, 2, 1000, **kw)
    assert np.asarray(state.num_generated).tolist() == [3, 9, 30, 30]


def test_batch_job_schedulers_agree(tmp_path, real_pair):
    target = real_pair[0]
    src = write_humaneval_jsonl(tmp_path / "in.jsonl", limit=10, lognormal=dict(median=12, cap=40))
    got = {}
    for scheduler in ("continuous", "static"):
        s = run_job(src, tmp_path / f"{scheduler}.jsonl", target, settings=JobSettings(
            max_new_tokens=8, batch_size=4, scheduler=scheduler, plot_path=None, progress=False))
        assert s["settings"]["scheduler"] == scheduler and s["totals"]["ok"] == 10
        got[scheduler] = {r["id"]: r["token_ids"] for r in read_output(tmp_path / f"{scheduler}.jsonl")}
    assert got["continuous"] == got["static"]
    assert len({len(t) for t in got["static"].values()}) > 2  # the records' own budgets, not the default
    with pytest.raises(jaxspec.InputError, match="scheduler must be one of static, continuous"):
        run_job(src, tmp_path / "x.jsonl", target, settings=JobSettings(scheduler="dynamic", progress=False))
