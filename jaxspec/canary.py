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

from jaxspec.errors import InputError
from jaxspec.generate import resolve_attention
from jaxspec.loading import Model
from jaxspec.ngram import Ngram
from jaxspec.requests import Request
from jaxspec.runner import bucket, run
from jaxspec.tree_speculative import TreePlan
from jaxspec.trees import resolve_tree
from jaxspec.stats import Completions

log = logging.getLogger("jaxspec")
PLAIN = "plain"


def method_name(num_draft: int, tree: str | None = None, ngram: Ngram | None = None) -> str:
    """"plain", "speculative K=3" (a draft model's chain), "tree sparse" (a named draft tree),
    "ngram K=4" or "ngram K=4 x3" (n-gram lookup, a tree of 3 branches)."""
    if ngram is not None and num_draft:
        return f"ngram K={num_draft}" + (f" x{ngram.branches}" if ngram.branches > 1 else "")
    if tree:
        return f"tree {tree}"
    return f"speculative K={num_draft}" if num_draft else PLAIN


MIN_SAMPLE = 8  # records; with at least two batches, so one slow batch cannot decide alone


def sample_size(pending: int, sample: float | int, batch_size: int) -> int:
    """Records in the sample: a fraction (float in (0, 1]; at least MIN_SAMPLE records and two
    batches) or a count (int >= 1) of the pending records, rounded up to whole batches so that
    every timed batch is as full as the job's."""
    if isinstance(sample, bool) or not isinstance(sample, (int, float)):
        raise InputError(f"auto_sample must be a fraction in (0, 1] or a count >= 1; got {sample!r}")
    if isinstance(sample, float):
        if not 0 < sample <= 1:
            raise InputError(f"auto_sample as a fraction must be in (0, 1]; got {sample!r}")
        n = max(math.ceil(sample * pending), MIN_SAMPLE, 2 * batch_size)
    elif sample < 1:
        raise InputError(f"auto_sample as a count must be >= 1; got {sample!r}")
    else:
        n = sample
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
    """One candidate setting: its outputs (first pass) and best time per chunk of the sample."""

    num_draft: int  # chain length; for a tree, its depth
    tree: str | None = None  # a name from jaxspec.trees.NAMED_TREES, or None for a chain
    ngram: Ngram | None = None  # n-gram lookup instead of the draft model
    outputs: list[Completions] = dataclasses.field(default_factory=list)  # one per chunk
    best_s: list[float] = dataclasses.field(default_factory=list)  # least decode time per chunk
    passes: int = 0
    compile_s: float = 0.0
    mismatched: int = 0  # greedy sample records whose output differs from plain decoding's

    @property
    def method(self) -> str:
        return method_name(self.num_draft, self.tree, self.ngram)

    @property
    def setting(self) -> tuple:
        return self.num_draft, self.tree, self.ngram

    def run(self, target: Model, draft: Model | None, chunk: list[Request], batch_size: int) -> Completions:
        attention = resolve_attention("auto")  # the fused kernel on GPUs, as the job itself runs
        if not self.num_draft:
            return run(target, chunk, batch_size, attention=attention)
        tree = resolve_tree(self.tree) if self.tree else None
        return run(target, chunk, batch_size, draft=self.ngram or draft, num_draft=self.num_draft, tree=tree,
                   attention=attention)

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
            "method": self.method, "num_draft_tokens": self.num_draft, "tree": self.tree,
            "drafter": "ngram" if self.ngram else "model" if self.num_draft else None, "tokens_per_s": self.tokens_per_s,
            "best_decode_s": self.best_decode_s, "passes": self.passes, "new_tokens": self.new_tokens,
            "compile_s": self.compile_s, "acceptance_rate": self.acceptance_rate,
            "tokens_per_step": self.new_tokens / steps if steps else None,
            "per_position_acceptance": per_position(comps),
            "greedy_identical": not self.mismatched, "greedy_mismatches": self.mismatched,
        }


@dataclasses.dataclass
class Decision:
    num_draft: int  # 0 = plain decoding
    tree: str | None
    ngram: Ngram | None  # the chosen setting drafts by n-gram lookup
    reason: str
    trials: list[Trial]
    sample_records: int

    @property
    def chosen(self) -> Trial:
        return next(t for t in self.trials if t.setting == (self.num_draft, self.tree, self.ngram))

    @property
    def speedup(self) -> float:
        """The chosen setting's tokens/s over plain decoding's, on the sample."""
        plain = self.trials[0].tokens_per_s
        return self.chosen.tokens_per_s / plain if plain > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "chosen": method_name(self.num_draft, self.tree, self.ngram), "num_draft_tokens": self.num_draft,
            "tree": self.tree, "drafter": "ngram" if self.ngram else "model" if self.num_draft else None,
            "speedup": self.speedup, "reason": self.reason, "sample_records": self.sample_records,
            "candidates": [t.as_dict() for t in self.trials],
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
        f"{best.method} {best.tokens_per_s:.1f} tokens/s (acceptance {best.acceptance_rate:.2f}) vs plain "
        f"{plain.tokens_per_s:.1f} tokens/s = {speedup:.2f}x"
    )
    if speedup >= min_speedup:
        return best, f"{best.method}: {numbers}"
    return plain, f"plain decoding: speculation does not pay, best was {numbers} (needs {min_speedup:.2f}x)"


def run_canary(
    target: Model, draft: Model | None, chunks: list[list[Request]], batch_size: int, *,
    ks=(2, 3, 4), trees=(), ngram_ks=(), ngram: Ngram = Ngram(), repeats: int = 2, min_speedup: float = 1.05,
    keep_within: float = 0.9, on_pass=None,
) -> Decision:
    """Times plain decoding, speculative decoding with the draft model at each K in `ks` and
    with each named tree in `trees` (none without a draft model), and n-gram lookup (`ngram`'s
    settings) at each K in `ngram_ks`, on the sample `chunks`
    (lists of requests, each run as one call of at most batch_size rows).

    Candidates take turns chunk by chunk and each chunk keeps its least time over `repeats`
    passes, so a burst of load on a shared machine costs one chunk's sample, not a candidate's
    whole pass. After the first pass, candidates slower than `keep_within` x the fastest (or not
    lossless) are dropped, and the canary stops once only plain decoding is left: a useless
    draft, or a batch size where speculation clearly loses, costs one pass, not all of them.
    on_pass(trial, pass_number, new_tokens, decode_s, compile_s): called after each candidate's pass.
    Returns the Decision; `decision.chosen.outputs` are the sample's completions, per chunk.
    """
    chunks = [c for c in chunks if c]
    if not chunks:
        raise InputError("the canary needs at least one request")
    if repeats < 1:
        raise InputError(f"auto_repeats must be >= 1; got {repeats!r}")
    if draft is None and (ks or trees):
        raise InputError("the canary's draft-model candidates (ks, trees) need a draft model")
    trials = [Trial(0)] + [Trial(k) for k in dict.fromkeys(ks)]
    trials += [Trial(TreePlan.of(resolve_tree(name)).max_depth, name) for name in dict.fromkeys(trees)]
    trials += [Trial(k, ngram=ngram) for k in dict.fromkeys(ngram_ks)]
    active = list(trials)
    for p in range(repeats):
        spent = {id(t): [0, 0.0, 0.0] for t in active}
        for ci, chunk in enumerate(chunks):
            for t in active:
                outs = t.run(target, draft, chunk, batch_size)
                t.record(ci, outs)
                if p == 0 and t.num_draft:
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
        active = [t for t in active if not t.num_draft or (not t.mismatched and t.tokens_per_s >= keep_within * fastest)]
        if len(active) == 1:  # only plain decoding is left: nothing to compare any more
            break
    best, reason = _decide(trials, min_speedup)
    n = sum(len(c) for c in chunks)
    for t in trials:
        if t.mismatched:
            log.warning("canary: %s differs from plain greedy output on %d of %d sample records; not used",
                        t.method, t.mismatched, n)
    return Decision(best.num_draft, best.tree, best.ngram, reason, trials, n)
