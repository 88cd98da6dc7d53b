"""Suffix drafting (draft="suffix"): the lookup over the shared corpus and the row against a
plain-Python reference, the bounded corpus, lossless greedy output that drafts from earlier
outputs, the exact sampling distribution, and batch jobs."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from test_ngram import reference_proposal
from test_speculative_distribution import SETTINGS, chi2_pvalue, exact_joint, sampled_joint
from test_speculative_distribution import pair as tiny_pair  # noqa: F401  (fixture)

import jaxspec
from jaxspec import cli
from jaxspec.batch import JobSettings, read_output, run_job
from jaxspec.decoding.drafting import Round
from jaxspec.decoding.suffix import CORPUS_DEPTHS, SEPARATOR, SuffixCorpus, SuffixDrafter
from jaxspec.decoding.method import DecodeMethod
from jaxspec.ngram import Ngram
from jaxspec.sampling_params import SamplingParams
from jaxspec.serving.generate import build_requests
from jaxspec.serving.runner import run
from jaxspec.suffix import Suffix

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def bucket(newest_first: list[int], table_size: int) -> int:
    return sum(t * pow(0x01000193, j, 1 << 32) for j, t in enumerate(newest_first)) % (1 << 32) & (table_size - 1)


def reference_corpus(corpus: list[int], seq: list[int], k: int, table_size: int):
    """(length, continuation) of the deepest CORPUS_DEPTHS last tokens of `seq` whose bucket's most
    recent corpus n-gram (separator-free, followed by a token) is that n-gram; (0, None) if none."""
    for depth in CORPUS_DEPTHS:
        if len(seq) < depth:
            continue
        want = seq[-depth:]
        ends = [e for e in range(depth - 1, len(corpus) - 1)
                if min(corpus[e - depth + 1 : e + 2]) >= 0
                and bucket(corpus[e - depth + 1 : e + 1][::-1], table_size) == bucket(want[::-1], table_size)]
        if ends and corpus[max(ends) - depth + 1 : max(ends) + 1] == want:
            e = max(ends)
            return depth, [corpus[e + 1 + i] if e + 1 + i < len(corpus) else SEPARATOR for i in range(k)]
    return 0, None


def reference_row(seq: list[int], lo: int, hi: int, k: int):
    """(length, continuation) of n-gram lookup in the row (test_ngram's reference, with its length)."""
    for size in range(min(hi, len(seq) - 1), lo - 1, -1):
        if any(seq[end - size + 1 : end + 1] == seq[-size:] for end in range(len(seq) - 2, size - 2, -1)):
            return size, reference_proposal(seq, lo, hi, k)
    return 0, reference_proposal(seq, lo, hi, k)


def test_lookup_matches_a_python_reference_over_corpus_and_row():
    rng = np.random.default_rng(1)
    from_corpus = 0
    for trial in range(40):
        k = [4, 3, 5][trial % 3]
        vocab = int(rng.integers(2, 5))  # few symbols: 4- and 8-token matches are common
        corpus = SuffixCorpus.empty(64)
        corpus.add([rng.integers(0, vocab, int(rng.integers(1, 24))).tolist() for _ in range(3)])
        b, width = 4, 30
        history = rng.integers(0, vocab, (b, width)).astype(np.int32)
        n = rng.integers(2, width + 1, b).astype(np.int32)
        masked = np.where(np.arange(width)[None] < n[:, None], history, -1)
        r = Round(n=jnp.asarray(n), prev=jnp.asarray(history[np.arange(b), n - 2]),
                  last=jnp.asarray(history[np.arange(b), n - 1]), keys=None, sampling=None, greedy_only=True,
                  attention="xla")
        tokens = np.asarray(SuffixDrafter(k, 1, 1, 3).propose(corpus, jnp.asarray(masked), r)[0])
        for row in range(b):
            seq = history[row, : n[row]].tolist()
            depth, other = reference_corpus(corpus.host.tolist(), seq, k, corpus.tables.shape[1])
            length, own = reference_row(seq, 1, 3, k)
            want = [t if t != SEPARATOR else seq[-1] for t in other] if depth > length else own
            from_corpus += depth > length
            assert tokens[row].tolist() == [seq[-1], *want], (trial, row)
    assert from_corpus > 20  # the corpus' matches were exercised


def test_the_corpus_keeps_the_newest_tokens_within_its_bound():
    corpus = SuffixCorpus.empty(16)
    assert corpus.host.tolist() == [SEPARATOR] * 16
    corpus.add([[1, 2, 3], [], [4, 5]])
    assert corpus.host.tolist() == [SEPARATOR] * 9 + [1, 2, 3, SEPARATOR, 4, 5, SEPARATOR]
    corpus.add([list(range(10, 22))])
    assert corpus.host.tolist() == [4, 5, SEPARATOR, *range(10, 22), SEPARATOR] and corpus.size == 16
    assert np.asarray(corpus.tokens).tolist() == corpus.host.tolist()  # the device copy follows
    with pytest.raises(jaxspec.InputError, match=r"corpus_tokens must be an integer in \[16, 4194304\]"):
        Suffix(corpus_tokens=8)
    with pytest.raises(jaxspec.InputError, match=r"ngram_min \(4\) must not exceed ngram_max \(2\)"):
        Suffix(ngram_min=4, ngram_max=2)


def test_greedy_equals_plain_and_drafts_from_finished_outputs(real_pair, humaneval20):
    """Three prompts, then the same three again, through one slot in arrival order: the second
    round's rows find the first round's outputs in the corpus (a finished output reaches it at
    the next return to the host)."""
    target = real_pair[0]
    requests = build_requests(humaneval20[:3] * 2, target, SamplingParams(temperature=0.0, max_tokens=32, seed=0))

    def decode(draft):
        method = DecodeMethod.of(draft, 4)
        return run(target, requests, 1, method, draft, scheduler="continuous", admit_order="arrival")

    plain, ngram, suffix = decode(None), decode(Ngram()), decode(Suffix())
    assert [o.token_ids for o in suffix] == [o.token_ids for o in plain] == [o.token_ids for o in ngram]
    assert suffix.metrics.tokens_per_step > 1.3 * ngram.metrics.tokens_per_step


def test_sampling_matches_target_distribution(tiny_pair):  # noqa: F811
    """40,000 requests of one prompt in batches of 8,192: later batches draft from earlier
    batches' outputs (a corpus of 64 tokens); tokens 2 and 3 come from one round of K = 2, a
    tree of two branches."""
    target, _ = tiny_pair
    counts = sampled_joint(target, Suffix(branches=2, corpus_tokens=64), SETTINGS[0])
    assert chi2_pvalue(counts, exact_joint(target, SETTINGS[0])) > 1e-4


def test_batch_job_and_command_line(tmp_path, real_pair, humaneval20):
    target = real_pair[0]
    prompts = [p[:200] for p in humaneval20[:3] for _ in range(2)]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate(prompts)))
    ref = jaxspec.generate(prompts, target, max_new_tokens=24)
    s = run_job(src, tmp_path / "out.jsonl", target, "suffix", JobSettings(
        num_draft_tokens=4, max_new_tokens=24, batch_size=2, scheduler="static", plot_path=None, progress=False))
    got = {r["id"]: r for r in read_output(tmp_path / "out.jsonl")}
    assert [got[i]["token_ids"] for i in range(len(prompts))] == [r.token_ids for r in ref]
    assert (s["settings"]["method"], s["settings"]["draft"], s["settings"]["drafter"]) == ("suffix K=4", "suffix", "suffix")
    out = tmp_path / "cli.jsonl"
    assert cli.main(["batch", str(src), str(out), "--draft", "suffix", "--suffix-corpus-tokens", "512", "--auto",
                     "--auto-sample", "2", "--auto-ngram-k", "3", "--auto-repeats", "1", "--max-new-tokens", "24",
                     "--batch-size", "1", "--no-progress", "--no-plot"]) == 0
    summary = json.loads((tmp_path / "cli.summary.json").read_text())
    assert [c["method"] for c in summary["canary"]["candidates"]] == ["plain", "ngram K=3", "suffix K=3"]
    assert cli.main(["batch", str(src), str(tmp_path / "bad.jsonl"), "--draft", "suffix", "--suffix-corpus-tokens",
                     "4", "--no-progress"]) == 2
