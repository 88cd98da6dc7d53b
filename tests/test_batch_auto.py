"""The --auto canary measures the job's own prompts: plain decoding for a useless (random) draft,
speculation for the real pair on code; and the observability around it (metrics log, warning)."""

import json
import logging
from pathlib import Path

import pytest
from tiny_models import save_tiny

import jaxspec
from jaxspec.defaults import CHECKPOINTS
from jaxspec.errors import InputError
from jaxspec.jobs.canary import pick_sample, sample_size, spread
from jaxspec.batch import JobSettings, read_output, run_job
from jaxspec.jobs.metrics_log import AcceptanceWatch, read_log

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

# Code prompts (one length bucket, so few graphs to compile).
CODE = [
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n",
    "import os\nimport sys\nimport json\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n    def __repr__(self):\n",
    'def is_even(n):\n    """Return True if n is even."""\n',
    "for i in range(10):\n    print(i)\nfor j in range(10):\n",
    "def fibonacci(n):\n",
    "def quicksort(xs):\n",
    "numbers = [1, 2, 3, 4, 5, 6, 7, 8,",
    "def read_lines(path):\n",
    "class Stack:\n    def __init__(self):\n",
]


@pytest.fixture(scope="module")
def target():
    return jaxspec.load(CHECKPOINTS / "hf" / "code-target-16m", dtype="float32")


@pytest.fixture(scope="module")
def draft():
    return jaxspec.load(CHECKPOINTS / "hf" / "code-draft-4m", dtype="float32")


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory):
    """Random weights, the target's vocabulary: a draft that is useless but valid."""
    path = save_tiny(tmp_path_factory.mktemp("models") / "random-draft", "llama", {
        "vocab_size": 8192, "eos_token_id": 0, "pad_token_id": 0, "bos_token_id": 0,
        "max_position_embeddings": 2048,
    }, seed=0)
    return jaxspec.load(path, dtype="float32")


def job_file(path: Path, prompts) -> Path:
    path.write_text("".join(json.dumps({"id": f"c{i}", "prompt": p}) + "\n" for i, p in enumerate(prompts)))
    return path


def check_lossless(out: Path, target, prompts, max_new: int) -> list[dict]:
    """Every id once, and every output is the target's own greedy output."""
    got = {r["id"]: r for r in read_output(out)}
    assert sorted(got) == sorted(f"c{i}" for i in range(len(prompts)))
    ref = jaxspec.generate(prompts, target, max_new_tokens=max_new)
    for i, r in enumerate(ref):
        assert got[f"c{i}"]["token_ids"] == r.token_ids, i
    return list(got.values())


@pytest.mark.timing
def test_auto_falls_back_to_plain_with_a_random_draft(tmp_path, target, random_draft):
    src = job_file(tmp_path / "in.jsonl", CODE)
    out = tmp_path / "out.jsonl"
    s = run_job(src, out, target, random_draft, JobSettings(
        max_new_tokens=32, batch_size=1, auto=True, auto_sample=4, auto_ks=(2, 3), auto_trees=("binary-3",),
        auto_ngram_ks=(), progress=False))
    canary = s["canary"]
    assert canary["chosen"] == "plain" and s["settings"]["method"] == "plain"
    assert "speculation does not pay" in canary["reason"] and canary["sample_records"] == 4
    spec = [c for c in canary["candidates"] if c["num_draft_tokens"]]
    assert len(spec) == 3 and all(c["acceptance_rate"] < 0.2 and c["greedy_identical"] for c in spec)
    assert [c["tree"] for c in spec] == [None, None, "binary-3"]
    plain = canary["candidates"][0]
    assert all(c["tokens_per_s"] < plain["tokens_per_s"] for c in spec)
    lines = check_lossless(out, target, CODE, 32)
    assert {r["method"] for r in lines} == {"plain"}
    events = read_log(tmp_path / "out.metrics.jsonl")
    decision = next(e for e in events if e["event"] == "decision")
    assert decision["chosen"] == "plain" and decision["draft"] == "random-draft"
    assert {e["method"] for e in events if e["event"] == "canary"} == {
        "plain", "speculative K=2", "speculative K=3", "tree binary-3"}


@pytest.mark.timing
def test_auto_picks_speculation_with_the_real_pair_on_code(tmp_path, target, draft):
    src = job_file(tmp_path / "in.jsonl", CODE)
    out = tmp_path / "out.jsonl"
    # Three passes: a 2-core machine shared with other work is noisy; the real gain is ~1.15x.
    s = run_job(src, out, target, draft, JobSettings(
        max_new_tokens=64, batch_size=1, auto=True, auto_sample=6, auto_ks=(2, 3), auto_ngram_ks=(),
        auto_repeats=3, progress=False))
    canary = s["canary"]
    assert canary["chosen"].startswith("speculative K="), canary["reason"]
    k = canary["num_draft_tokens"]
    chosen = next(c for c in canary["candidates"] if c["num_draft_tokens"] == k)
    plain = canary["candidates"][0]
    assert chosen["tokens_per_s"] >= 1.05 * plain["tokens_per_s"] and chosen["greedy_identical"]
    assert chosen["acceptance_rate"] > 0.5 and len(chosen["per_position_acceptance"]) == k
    assert s["settings"]["method"] == f"speculative K={k}" and s["totals"]["acceptance_rate"] > 0.5
    lines = check_lossless(out, target, CODE, 64)
    assert {r["method"] for r in lines} == {f"speculative K={k}"}
    assert all(r["stats"]["drafted"] == k * (r["stats"]["target_steps"] - 1) for r in lines)
    assert len(s["totals"]["per_position_acceptance"]) == k


def test_low_acceptance_warning_and_metrics_log(tmp_path, target, random_draft, caplog):
    src = job_file(tmp_path / "in.jsonl", CODE[:4])
    log_path = tmp_path / "metrics.jsonl"
    with caplog.at_level(logging.WARNING, logger="jaxspec"):
        s = run_job(src, tmp_path / "out.jsonl", target, random_draft, JobSettings(
            num_draft_tokens=2, max_new_tokens=8, batch_size=2, metrics_log=log_path, plot_path=None,
            progress=False))
    warnings = [r.getMessage() for r in caplog.records if "acceptance rate" in r.getMessage()]
    assert len(warnings) == 1 and "is below 0.60" in warnings[0] and "'random-draft'" in warnings[0]
    batches = [e for e in read_log(log_path) if e["event"] == "batch"]
    assert len(batches) >= 2 and sum(e["records"] for e in batches) == 4  # warned once, not per batch
    for e in batches:
        assert (e["model"], e["draft"], e["method"], e["num_draft_tokens"]) == (
            "code-target-16m", "random-draft", "speculative K=2", 2)
        assert e["low_acceptance"] and e["acceptance_rate"] < 0.6 and e["tokens_per_s"] > 0
        assert e["prompt_version"] == "unversioned" and len(e["per_position_acceptance"]) == 2
    assert s["totals"]["acceptance_rate"] < 0.6

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="jaxspec"):
        run_job(src, tmp_path / "out2.jsonl", target, random_draft, JobSettings(
            num_draft_tokens=2, max_new_tokens=8, batch_size=2, warn_below_acceptance=0.0, metrics_log=None,
            plot_path=None, progress=False))
    assert not [r for r in caplog.records if "acceptance rate" in r.getMessage()]


def test_acceptance_watch_warns_on_each_fall_below(caplog):
    w = AcceptanceWatch(0.5, "d", "t")
    with caplog.at_level(logging.WARNING, logger="jaxspec"):
        assert not w.update(9, 10)
        assert w.update(0, 30)  # running 9/40: falls below, warns
        assert w.update(1, 10)  # 10/50, still below: no second warning
        assert not w.update(34, 34)  # 44/84 = 0.52: above, but not clear by the 0.05 hysteresis
        assert w.update(0, 5)  # 44/89 = 0.49: below again, no warning (it never got clear)
        assert not w.update(60, 60)  # 104/149 = 0.70: clear of the threshold
        assert w.update(0, 200)  # 104/349 = 0.30: falls again, warns again
    assert w.warnings == 2 and len(caplog.records) == 2


def test_sample_size_spread_and_pick():
    assert sample_size(164, 0.05, 8) == 16  # 9, raised to two batches of 8
    assert sample_size(164, 0.1, 1) == 17
    assert sample_size(164, 0.05, 1) == 9
    assert sample_size(100, 0.01, 1) == 8  # at least 8 records
    assert sample_size(5, 16, 8) == 5  # never more than the job
    assert sample_size(100, 3, 4) == 4  # a count, rounded up to a whole batch
    for bad in (0, 0.0, 1.5, -2, True, "0.1"):
        with pytest.raises(InputError):
            sample_size(10, bad, 1)
    assert spread(10, 4) == [0, 2, 5, 7] and spread(3, 3) == [0, 1, 2] and spread(5, 0) == []
    # Prompt lengths: bucket 16 holds items 0, 4, 5, 7; the other buckets one item each.
    lengths = [10, 100, 30, 200, 12, 15, 300, 14]
    assert pick_sample(lengths, 3) == [0, 4, 5]
    assert pick_sample(lengths, 4) == [0, 4, 5, 7]
    assert len(pick_sample(lengths, 6)) == 6 and set(pick_sample(lengths, 8)) == set(range(8))


def test_the_rate_is_shown_with_the_digits_that_put_it_below():
    from jaxspec.serving.warnings import below

    assert below(0.5996, 0.6) == "0.5996 is below 0.60" and below(0.42, 0.6) == "0.42 is below 0.60"
