"""The canary: benchmarks a sample of the user's own job plain and speculatively, picks the faster.

Whether speculation pays depends on the token mix (acceptance), the batch size and the hardware,
so it is measured, not guessed: every candidate decodes the same sample at the job's batch
size, candidates taking turns so that a burst of load on a shared machine hits them alike, and
each keeps its best (least) decode time, compile excluded. A speculative candidate whose greedy
output differs from plain decoding's on any greedy record is disqualified (it would not be
lossless). Speculation is chosen only when it beats plain decoding by `min_speedup`.
"""

from __future__ import annotations

import dataclasses
import logging
import math

from jaxspec.decoding.method import DecodeMethod
from jaxspec.decoding.ngram import Ngram
from jaxspec.errors import InputError
from jaxspec.jobs.settings import check_sample
from jaxspec.model.loading import Model
from jaxspec.serving.batching import bucket
from jaxspec.serving.options import RunOptions
from jaxspec.serving.requests import Request
from jaxspec.serving.runner import run
from jaxspec.serving.stats import Completions

log = logging.getLogger("jaxspec")
MIN_SAMPLE = 8  # records; with at least two batches, so one slow batch cannot decide alone


def sample_size(pending: int, sample: float | int, batch_size: int) -> int:
    """Records in the sample: a fraction (float in (0, 1]; at least MIN_SAMPLE records and two
    batches) or a count (int >= 1) of the pending records, rounded up to whole batches so that
    every timed batch is as full as the job's."""
    sample = check_sample(sample)
    n = max(math.ceil(sample * pending), MIN_SAMPLE, 2 * batch_size) if isinstance(sample, float) else sample
    return min(pending, batch_size * math.ceil(n / batch_size))


def spread(n_items: int, n: int) -> list[int]:
    """`n` indices spread evenly over range(n_items): a sample that covers the whole file
    (early and late records often differ) and is the same on every run."""
    return sorted({i * n_items // n for i in range(n)}) if n else []


def pick_sample(lengths: list[int], n: int) -> list[int]:
    """Indices of `n` items (prompt lengths given), spread over the file but taken from the most
    common prompt-length buckets first: every candidate compiles one graph per bucket, and
    compiling dominates a small canary."""
    groups: dict[int, list[int]] = {}
    for i, length in enumerate(lengths):
        groups.setdefault(bucket(length), []).append(i)
    pool: list[int] = []
    for g in sorted(groups.values(), key=len, reverse=True):
        if len(pool) >= n:
            break
        pool += g
    pool.sort()
    return [pool[j] for j in spread(len(pool), n)]


@dataclasses.dataclass
class Trial:
    """One candidate method: its outputs (first pass) and best time per chunk of the sample."""

    method: DecodeMethod
    outputs: list[Completions] = dataclasses.field(default_factory=list)  # one per chunk
    best_s: list[float] = dataclasses.field(default_factory=list)  # least decode time per chunk
    passes: int = 0
    compile_s: float = 0.0
    mismatched: int = 0  # greedy sample records whose output differs from plain decoding's

    @property
    def completions(self) -> list:
        return [c for outs in self.outputs for c in outs]

    @property
    def new_tokens(self) -> int:
        return sum(o.metrics.new_tokens for o in self.outputs)

    @property
    def best_decode_s(self) -> float:
        return sum(self.best_s)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.best_decode_s if self.best_decode_s > 0 else 0.0

    @property
    def acceptance_rate(self) -> float | None:
        drafted = sum(c.stats.drafted for c in self.completions)
        return sum(c.stats.accepted for c in self.completions) / drafted if drafted else None

    def record(self, chunk: int, outs: Completions) -> None:
        self.compile_s += outs.metrics.compile_s
        if chunk == len(self.outputs):
            self.outputs.append(outs)
            self.best_s.append(outs.metrics.decode_s)
        else:
            self.best_s[chunk] = min(self.best_s[chunk], outs.metrics.decode_s)

    def as_dict(self) -> dict:
        comps = self.completions
        steps = sum(c.stats.target_steps for c in comps)
        return {
            **method_fields(self.method), "tokens_per_s": self.tokens_per_s,
            "best_decode_s": self.best_decode_s, "passes": self.passes, "new_tokens": self.new_tokens,
            "compile_s": self.compile_s, "acceptance_rate": self.acceptance_rate,
            "tokens_per_step": self.new_tokens / steps if steps else None,
            "per_position_acceptance": per_position(comps),
            "greedy_identical": not self.mismatched, "greedy_mismatches": self.mismatched,
        }


def method_fields(method: DecodeMethod) -> dict:
    """How summaries, logs and decisions name a method."""
    return {"method": method.name, "num_draft_tokens": method.k,
            "tree": method.tree if isinstance(method.tree, str) or method.tree is None else list(method.tree),
            "drafter": method.drafter_kind}


@dataclasses.dataclass
class Decision:
    chosen: Trial
    reason: str
    trials: list[Trial]
    sample_records: int

    @property
    def method(self) -> DecodeMethod:
        return self.chosen.method

    @property
    def speedup(self) -> float:
        """The chosen method's tokens/s over plain decoding's, on the sample."""
        plain = self.trials[0].tokens_per_s
        return self.chosen.tokens_per_s / plain if plain > 0 else 0.0

    def as_dict(self) -> dict:
        fields = method_fields(self.method)
        return {
            "chosen": fields.pop("method"), **fields, "speedup": self.speedup, "reason": self.reason,
            "sample_records": self.sample_records, "candidates": [t.as_dict() for t in self.trials],
        }


def per_position(completions) -> list[float]:
    """Acceptance at each draft position, pooled over records."""
    accepted = [sum(col) for col in zip(*(c.stats.accepted_per_position for c in completions))]
    drafted = [sum(col) for col in zip(*(c.stats.drafted_per_position for c in completions))]
    return [a / d if d else 0.0 for a, d in zip(accepted, drafted)]


def _mismatches(outs: Completions, plain: Completions, requests: list[Request]) -> int:
    return sum(r.sampling.greedy and a.token_ids != b.token_ids for a, b, r in zip(outs, plain, requests))


def _decide(trials: list[Trial], min_speedup: float) -> tuple[Trial, str]:
    plain = trials[0]
    lossless = [t for t in trials[1:] if not t.mismatched]
    if not lossless:
        return plain, "plain decoding: no speculative setting reproduced plain greedy output on the sample"
    best = max(lossless, key=lambda t: t.tokens_per_s)
    speedup = best.tokens_per_s / plain.tokens_per_s
    numbers = (
        f"{best.method.name} {best.tokens_per_s:.1f} tokens/s (acceptance {best.acceptance_rate:.2f}) vs plain "
        f"{plain.tokens_per_s:.1f} tokens/s = {speedup:.2f}x"
    )
    if speedup >= min_speedup:
        return best, f"{best.method.name}: {numbers}"
    return plain, f"plain decoding: speculation does not pay, best was {numbers} (needs {min_speedup:.2f}x)"


def drafts_by_kind(draft) -> dict:
    """A job's drafts by the decode-method kind that runs each ("draft", "eagle", "ngram", "suffix"):
    one draft (a draft model, an EAGLE-3 head, "ngram" / Ngram or "suffix" / Suffix settings), or a list of them with at
    most one of each kind, for the canary to choose among; None: {}."""
    drafts = {}
    for d in draft if isinstance(draft, (list, tuple)) else [] if draft is None else [draft]:
        kind = DecodeMethod.of(d, 1).kind
        if kind == "plain":
            raise InputError("draft: None in a list of drafts; leave it out")
        if kind in drafts:
            raise InputError(f"draft: at most one draft model, one EAGLE-3 head, one n-gram and one suffix setting; "
                             f"got {_name(drafts[kind])} and {_name(d)}")
        drafts[kind] = d
    return drafts


def _name(draft) -> str:
    return draft if isinstance(draft, str) else draft.name  # "ngram", or a model's / head's / Ngram's name


def drafts_name(drafts: dict) -> str | None:
    """How summaries and logs name a job's drafts: "code-draft-4m", "code-draft-4m + code-eagle-16m"."""
    return " + ".join(map(_name, drafts.values())) if drafts else None


def candidates(draft, settings) -> list[DecodeMethod]:
    """The canary's methods: plain first, then each draft given (a draft model, an EAGLE-3 head,
    or both: see drafts_by_kind) at each of settings.auto_ks and each named tree in
    settings.auto_trees, and n-gram lookup at each of settings.auto_ngram_ks (with the Ngram
    settings given among the drafts, else the defaults); with adaptive K, no trees or heads."""
    drafts = drafts_by_kind(draft)
    methods = [DecodeMethod()]
    for kind in ("draft", "eagle"):
        if kind in drafts:
            methods += [DecodeMethod(kind, k) for k in settings.auto_ks]
            methods += [DecodeMethod(kind, tree=name) for name in settings.auto_trees]
    ngram = drafts.get("ngram")
    methods += [DecodeMethod("ngram", k, settings=ngram if isinstance(ngram, Ngram) else None)
                for k in settings.auto_ngram_ks]
    if "suffix" in drafts:  # suffix drafting, when given, at the n-gram lookup's Ks
        suffix = drafts["suffix"]
        methods += [DecodeMethod("suffix", k, settings=None if isinstance(suffix, str) else suffix)
                    for k in settings.auto_ngram_ks]
    if settings.options.adaptive_k:  # the job will vary a chain's K: only methods that have one
        methods = [m for m in methods if m.kind != "eagle" and m.tree is None]
    return list(dict.fromkeys(methods))


def run_canary(
    target: Model, draft, chunks: list[list[Request]], batch_size: int,
    methods: list[DecodeMethod], *, repeats: int = 2, min_speedup: float = 1.05, keep_within: float = 0.9,
    on_pass=None, deterministic: bool = False,
) -> Decision:
    """Times each of `methods` (the first: plain decoding, the baseline) on the sample `chunks`
    (lists of requests, each run as one call of at most batch_size rows); `draft`: the draft
    model and/or EAGLE-3 head the methods of those kinds use (drafts_by_kind).

    Candidates take turns chunk by chunk and each chunk keeps its least time over `repeats`
    passes, so a burst of load on a shared machine costs one chunk's sample, not a candidate's
    whole pass. After the first pass, candidates slower than `keep_within` x the fastest (or not
    lossless) are dropped, and the canary stops once only plain decoding is left: a useless
    draft, or a batch size where speculation clearly loses, costs one pass, not all of them.
    on_pass(trial, pass_number, new_tokens, decode_s, compile_s): called after each candidate's pass.
    deterministic: the candidates run in deterministic mode, as the job will.
    Returns the Decision; `decision.chosen.outputs` are the sample's completions, per chunk.
    """
    chunks = [c for c in chunks if c]
    if not chunks:
        raise InputError("the canary needs at least one request")
    if repeats < 1:
        raise InputError(f"auto_repeats must be >= 1; got {repeats!r}")
    if not methods or methods[0].speculative:
        raise InputError("the canary's first method must be plain decoding, its baseline")
    drafts = drafts_by_kind(draft)
    for m in methods:
        if m.kind in ("draft", "eagle") and m.kind not in drafts:
            raise InputError(f"the canary's candidate {m.name!r} needs a "
                             f"{'draft model' if m.kind == 'draft' else 'EAGLE-3 head'} among the drafts")
    attention = RunOptions("auto", deterministic).attention_impl  # the fused kernel on GPUs, as the job runs
    trials = [Trial(m) for m in methods]
    active = list(trials)
    for p in range(repeats):
        spent = {id(t): [0, 0.0, 0.0] for t in active}
        for ci, chunk in enumerate(chunks):
            for t in active:
                outs = run(target, chunk, batch_size, t.method, drafts.get(t.method.kind), attention=attention)
                t.record(ci, outs)
                if p == 0 and t.method.speculative:
                    t.mismatched += _mismatches(outs, trials[0].outputs[ci], chunk)
                acc = spent[id(t)]
                acc[0] += outs.metrics.new_tokens
                acc[1] += outs.metrics.decode_s
                acc[2] += outs.metrics.compile_s
        for t in active:
            t.passes += 1
            if on_pass is not None:
                on_pass(t, t.passes, *spent[id(t)])
        fastest = max(t.tokens_per_s for t in active)
        # Plain decoding stays in as the baseline; so do near-fastest, lossless settings.
        active = [t for t in active
                  if not t.method.speculative or (not t.mismatched and t.tokens_per_s >= keep_within * fastest)]
        if len(active) == 1:  # only plain decoding is left: nothing to compare any more
            break
    best, reason = _decide(trials, min_speedup)
    n = sum(len(c) for c in chunks)
    for t in trials:
        if t.mismatched:
            log.warning("canary: %s differs from plain greedy output on %d of %d sample records; not used",
                        t.method.name, t.mismatched, n)
    return Decision(best, reason, trials, n)
