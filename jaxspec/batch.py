"""Offline batch jobs: `run_job(IN.jsonl, OUT.jsonl, target, draft)`, behind `jaxspec batch`.

Input: one JSON object per line: "id" (a non-empty string or an integer), "prompt" (text, or a
list of token ids) or "messages" (a chat rendered with the tokenizer's chat template), and
optionally "max_new_tokens", "temperature", "top_k", "top_p", "seed" (overriding the job's
defaults) and "prompt_version" (a string, reported separately in the summary). Other fields are
ignored. Blank lines are skipped.

Output: one JSON line per input record, in completion order (records are grouped by shape for
throughput; each line names its "id" and input "line"): "text", "token_ids", "finish_reason",
"method" and "stats" (the record's acceptance statistics), or "error" for a record that could
not be served. A line that is not a readable record with an id gets the id "line:N" (N = its
1-based line number in the input).

Crash safety: the records that finished at each return to the host (a static device batch, or
the rows freed in the continuous scheduler's slots) are appended in one write, flushed and
fsynced. Rerunning the same command after a crash (even kill -9) truncates a torn final line,
skips ids already in the output and serves the rest, so every input id ends up in the output
exactly once; complete lines already written are never changed.
"""


from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path

from jaxspec import report
from jaxspec.batch_output import (  # noqa: F401  (the job's parts, importable from here too)
    ChunkWriter, check_output_unique, error_line, ok_line, read_output, repair_tail,
)
from jaxspec.batch_local import plan_chunks, run_local  # noqa: F401
from jaxspec.batch_records import (  # noqa: F401
    BatchError, JobDefaults, Record, build_request, check_unique, parse_line, prepare, read_input, render_messages,
)
from jaxspec.canary import method_name, pick_sample, run_canary, sample_size
from jaxspec.errors import InputError
from jaxspec.generate import check_draft
from jaxspec.loading import Model, replicated_on
from jaxspec.metrics_log import AcceptanceWatch, MetricsLog, low_acceptance_message
from jaxspec.ngram import Ngram
from jaxspec.runner import SCHEDULERS
from jaxspec.trees import resolve_tree

log = logging.getLogger("jaxspec")
AUTO_NGRAM_KS = (4, 8)  # n-gram lookup lengths the canary tries by default


# ---------------------------------------------------------------- scheduling


def default_paths(out_path: Path) -> dict[str, Path]:
    """OUT.jsonl -> OUT.summary.json, OUT.png, OUT.metrics.jsonl beside it."""
    stem = out_path.with_suffix("") if out_path.suffix else out_path
    return {
        "summary": Path(f"{stem}.summary.json"), "plot": Path(f"{stem}.png"),
        "metrics_log": Path(f"{stem}.metrics.jsonl"),
    }


def _versions(lines: list[dict]):
    vs = sorted({x.get("prompt_version", report.UNVERSIONED) for x in lines})
    return vs[0] if len(vs) == 1 else vs


class _Progress:
    """tqdm bar over records with tokens/s and running acceptance; a no-op when disabled."""

    def __init__(self, total: int, enabled: bool):
        self.bar = None
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, unit="rec", desc="batch", dynamic_ncols=True)

    def update(self, n: int, tokens_per_s: float, acceptance: float | None) -> None:
        if self.bar is not None:
            acc = "-" if acceptance is None else f"{acceptance:.2f}"
            self.bar.set_postfix_str(f"{tokens_per_s:.0f} tok/s, acceptance {acc}", refresh=False)
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@dataclasses.dataclass
class _RunState:
    """What this run did, for the metrics log, the progress bar and the summary."""

    start: float
    records: int = 0
    new_tokens: int = 0
    decode_s: float = 0.0
    compile_s: float = 0.0
    canary_s: float = 0.0
    batches: list = dataclasses.field(default_factory=list)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def tokens_per_s(self) -> float:
        e = self.elapsed()
        return self.new_tokens / e if e > 0 else 0.0


# ---------------------------------------------------------------- the job


@dataclasses.dataclass(frozen=True)
class JobSettings:
    """How the job runs (besides per-record settings); see run_job."""

    num_draft_tokens: int
    batch_size: int
    auto: bool
    auto_sample: float | int
    auto_ks: tuple[int, ...]
    auto_trees: tuple[str, ...]
    auto_ngram_ks: tuple[int, ...]
    auto_repeats: int
    auto_min_speedup: float
    warn_below_acceptance: float
    progress: bool
    scheduler: str
    refill_at: int | None
    workers: int
    gpus_per_worker: float
    ray_address: str | None


def run_job(
    in_path: str | Path,
    out_path: str | Path,
    target: Model,
    draft: Model | Ngram | None = None,
    *,
    num_draft_tokens: int = 3,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    batch_size: int = 8,
    auto: bool = False,
    auto_sample: float | int = 0.05,
    auto_ks=(2, 3, 4),
    auto_trees=(),
    auto_ngram_ks=AUTO_NGRAM_KS,
    auto_repeats: int = 2,
    auto_min_speedup: float = 1.05,
    metrics_log: str | Path | None | bool = True,
    summary_path: str | Path | None = None,
    plot_path: str | Path | None | bool = True,
    warn_below_acceptance: float = 0.6,
    progress: bool = True,
    scheduler: str = "continuous",
    refill_at: int | None = None,
    workers: int = 1,
    gpus_per_worker: float | None = None,
    ray_address: str | None = None,
) -> dict:
    """Runs (or resumes) a batch job from `in_path` into `out_path`; returns the summary dict.

    draft: speculative decoding with K = num_draft_tokens when given (a draft model, or
    jaxspec.ngram.Ngram for n-gram lookup), plain decoding when None.
    max_new_tokens, temperature, top_k, top_p, seed: defaults for records without their own.
    batch_size: records decoded at once: slots of the continuous scheduler, rows of a static batch.
    scheduler: "continuous" (default) refills a slot as soon as its record finishes, writing the
    records that finished at each return to the host in one durable write; "static" runs padded
    batches of similar records until each batch's longest ends (one durable write per batch).
    refill_at: continuous slots freed before new records are let in (default: jaxspec.continuous.default_refill_at).
    workers: model replicas; more than 1 runs them as Ray actors (jaxspec.batch_ray; the
    `distributed` extra), each with gpus_per_worker GPUs (default: the target's tensor_parallel
    on GPUs, none on the CPU), on a local Ray instance or the cluster at ray_address ("auto",
    "HOST:PORT"). The driver stays the one writer; the canary runs in the driver.
    auto: first time plain decoding, speculative decoding with each K in auto_ks and with each
    named draft tree in auto_trees (jaxspec.trees.NAMED_TREES) when the draft is a model, and
    n-gram lookup with each K in auto_ngram_ks (the draft's settings when it is an Ngram) on a sample
    of the job (auto_sample: a fraction in (0, 1], at least 8 records and two batches, or a
    count; rounded up to whole batches, taken from the commonest prompt-length buckets; best of
    auto_repeats passes), check greedy outputs agree, and run the rest with the fastest
    (speculation only when it beats plain by auto_min_speedup); the sample's outputs are kept.
    metrics_log / plot_path: True for OUT.metrics.jsonl / OUT.png, a path, or None to skip.
    summary_path: default OUT.summary.json. warn_below_acceptance: warn (logger "jaxspec") when
    the running acceptance rate falls below it. progress: a tqdm bar on stderr.
    Raises BatchError before any work for duplicate input ids or an output it did not write, and
    InputError for bad job settings; bad records become "error" lines instead.
    """
    start = time.perf_counter()
    in_path, out_path = Path(in_path), Path(out_path)
    if not in_path.is_file():
        raise InputError(f"input file {in_path} does not exist")
    if out_path.exists() and out_path.resolve() == in_path.resolve():
        raise InputError("the output file must not be the input file")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InputError(f"batch_size must be an integer >= 1; got {batch_size!r}")
    if refill_at is not None and (isinstance(refill_at, bool) or not isinstance(refill_at, int) or refill_at < 1):
        raise InputError(f"refill_at must be an integer >= 1; got {refill_at!r}")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise InputError(f"workers must be an integer >= 1; got {workers!r}")
    if workers > 1:
        try:
            import ray  # noqa: F401
        except ImportError:
            raise InputError("workers > 1 runs replicas on Ray: pip install 'jaxspec[distributed]'") from None
    if gpus_per_worker is None:
        import jax

        gpus_per_worker = 0 if jax.default_backend() == "cpu" else target.tensor_parallel
    if scheduler not in SCHEDULERS:
        raise InputError(f"scheduler must be one of {', '.join(SCHEDULERS)}; got {scheduler!r}")
    if not isinstance(warn_below_acceptance, (int, float)) or not 0 <= warn_below_acceptance <= 1:
        raise InputError(f"warn_below_acceptance must be in [0, 1]; got {warn_below_acceptance!r}")
    if auto and draft is None:
        raise InputError('auto needs a draft (a draft model or "ngram") to compare against plain decoding')
    ngram = draft if isinstance(draft, Ngram) else Ngram()
    if auto and isinstance(draft, Ngram):
        auto_ks, auto_trees = (), ()  # no draft model to try
    if draft is not None:
        for k in (num_draft_tokens, *(auto_ks if auto else ())):
            check_draft(target, draft, k)
        for k in auto_ngram_ks if auto else ():
            check_draft(target, ngram, k)
        if isinstance(draft, Model):
            replicated_on(draft, target.mesh)  # refuses a draft split other than its target, before any work
        for name in auto_trees if auto else ():
            resolve_tree(name)
    if auto:
        sample_size(1, auto_sample, 1)  # validates auto_sample up front
        if isinstance(auto_min_speedup, bool) or not isinstance(auto_min_speedup, (int, float)) or auto_min_speedup <= 0:
            raise InputError(f"auto_min_speedup must be a number > 0; got {auto_min_speedup!r}")
        if isinstance(auto_repeats, bool) or not isinstance(auto_repeats, int) or auto_repeats < 1:
            raise InputError(f"auto_repeats must be an integer >= 1; got {auto_repeats!r}")
    defaults = JobDefaults(max_new_tokens, temperature, top_k, top_p, seed)
    settings = JobSettings(num_draft_tokens, batch_size, auto, auto_sample, tuple(auto_ks), tuple(auto_trees),
                           tuple(auto_ngram_ks), auto_repeats, auto_min_speedup, warn_below_acceptance, progress,
                           scheduler, refill_at, workers, gpus_per_worker, ray_address)
    paths = default_paths(out_path)
    paths["summary"] = Path(summary_path) if summary_path else paths["summary"]
    paths["plot"] = paths["plot"] if plot_path is True else (Path(plot_path) if plot_path else None)
    paths["metrics_log"] = paths["metrics_log"] if metrics_log is True else (Path(metrics_log) if metrics_log else None)

    records = read_input(in_path)
    check_unique(records, in_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    writer = ChunkWriter(out_path)  # locks the output before it is inspected
    try:
        job = _Job(records, in_path, out_path, writer, target, draft, defaults, settings, paths, start)
        return job.run()
    finally:
        writer.close()


class _Job:
    """One run of a job over the records not yet in the output."""

    def __init__(self, records, in_path, out_path, writer, target, draft, defaults, settings, paths, start):
        self.records, self.in_path, self.out_path, self.writer = records, in_path, out_path, writer
        self.target, self.draft, self.defaults, self.settings, self.paths = target, draft, defaults, settings, paths
        self.state = _RunState(start)
        self.num_draft = settings.num_draft_tokens if draft is not None else 0
        self.tree = None  # a named draft tree the canary chose, else a chain of num_draft
        self.ngram = draft if isinstance(draft, Ngram) else None  # n-gram lookup instead of the draft model
        self.decision = None
        self.mlog = MetricsLog(paths["metrics_log"], model=target.name,
                               draft=draft.name if draft is not None else None, job=str(out_path))
        self.watch = AcceptanceWatch(settings.warn_below_acceptance, draft.name if draft else "", target.name)
        self.bar = None

    def run(self) -> dict:
        torn = repair_tail(self.out_path)
        if torn:
            log.warning("%s: removed a torn final line (%d bytes) left by an interrupted run", self.out_path, torn)
        existing = read_output(self.out_path)
        check_output_unique(existing, self.out_path)
        done = {str(x["id"]) for x in existing}
        pending = [prepare(r, self.target, self.defaults) for r in self.records if r.key not in done]
        self.skipped = len(self.records) - len(pending)
        todo = [r for r in pending if r.error is None]
        self.bar = _Progress(len(pending), self.settings.progress)
        try:
            failed = [error_line(r) for r in pending if r.error is not None]
            self.writer.write(failed)
            self.state.records += len(failed)
            self.bar.update(len(failed), 0.0, None)
            if self.settings.auto and todo:
                todo = self.canary(todo)
            if todo:
                self.serve(todo)
        finally:
            self.bar.close()
        return self.finish()

    def serve(self, todo: list[Record]) -> None:
        """Decodes `todo` with the job's setting on this process's devices or over Ray replicas,
        committing records as they come back."""
        s = self.settings
        if s.workers > 1:
            from jaxspec.batch_ray import run_on_ray as execute
        else:
            execute = run_local

        def emit(records, completions, decode_s, compile_s, worker):
            self.commit(records, completions, decode_s, compile_s, "job", worker=worker)

        execute(self.target, self.draft, todo, s, (self.num_draft, self.tree, self.ngram), emit)

    def commit(self, chunk: list[Record], outs, decode_s: float, compile_s: float, phase: str, worker=None) -> None:
        """Writes a finished chunk durably, then logs and shows it."""
        nd, state = self.num_draft, self.state
        method = method_name(nd, self.tree, self.ngram)
        lines = [ok_line(r, c, method) for r, c in zip(chunk, outs)]
        self.writer.write(lines)
        t = report.totals(lines)
        low = self.watch.update(t["accepted"], t["drafted"]) if nd and not self.ngram else False
        state.records += len(lines)
        state.new_tokens += t["new_tokens"]
        state.decode_s += decode_s
        state.compile_s += compile_s
        entry = self.mlog.write(
            "batch", phase=phase, method=method, num_draft_tokens=nd, tree=self.tree,
            drafter="ngram" if self.ngram and nd else "model" if nd else None,
            prompt_version=_versions(lines), records=len(lines), batch_size=self.settings.batch_size,
            scheduler=self.settings.scheduler, worker=worker,
            prompt_tokens=t["prompt_tokens"], new_tokens=t["new_tokens"], decode_s=decode_s,
            compile_s=compile_s, tokens_per_s=t["new_tokens"] / decode_s if decode_s > 0 else 0.0,
            acceptance_rate=t["acceptance_rate"], tokens_per_step=t["tokens_per_step"],
            per_position_acceptance=t["per_position_acceptance"], running_acceptance=self.watch.rate,
            low_acceptance=low, elapsed_s=state.elapsed(), running_tokens_per_s=state.tokens_per_s(),
        )
        state.batches.append(entry)
        self.bar.update(len(lines), state.tokens_per_s(), self.watch.rate)

    def canary(self, todo: list[Record]) -> list[Record]:
        """Runs the canary on a sample of `todo`, keeps the chosen setting's outputs for the
        sample, and returns the records still to do."""
        t0 = time.perf_counter()
        s = self.settings
        n = sample_size(len(todo), s.auto_sample, s.batch_size)
        sample = [todo[i] for i in pick_sample([len(r.request.token_ids) for r in todo], n)]

        def on_pass(trial, number, new_tokens, decode_s, compile_s):
            self.mlog.write(
                "canary", method=trial.method, num_draft_tokens=trial.num_draft, tree=trial.tree,
                **{"pass": number}, records=len(sample), batch_size=s.batch_size, new_tokens=new_tokens,
                decode_s=decode_s, compile_s=compile_s, tokens_per_s=new_tokens / decode_s if decode_s > 0 else 0.0,
            )

        # Full batches, sorted by length: the batch size decides whether speculation pays, so the
        # sample runs at the job's batch size even where it spans two buckets.
        by_length = sorted(sample, key=lambda r: len(r.request.token_ids))
        chunks = [by_length[i : i + s.batch_size] for i in range(0, len(by_length), s.batch_size)]
        model = self.draft if isinstance(self.draft, Model) else None
        self.decision = run_canary(
            self.target, model, [[r.request for r in c] for c in chunks], s.batch_size, ks=s.auto_ks,
            trees=s.auto_trees, ngram_ks=s.auto_ngram_ks, ngram=self.ngram or Ngram(), repeats=s.auto_repeats,
            min_speedup=s.auto_min_speedup, on_pass=on_pass,
        )
        self.num_draft, self.tree, self.ngram = self.decision.num_draft, self.decision.tree, self.decision.ngram
        if self.num_draft:
            self.watch.note = (
                f"; the canary measured {self.decision.speedup:.2f}x the speed of plain decoding for "
                f"{method_name(self.num_draft, self.tree, self.ngram)} on {len(sample)} sample records"
            )
            self.watch.draft_name = "ngram" if self.ngram else self.draft.name
        self.mlog.write("decision", **self.decision.as_dict())
        log.info("canary on %d records: %s", len(sample), self.decision.reason)
        self.state.canary_s = time.perf_counter() - t0
        chosen = self.decision.chosen
        for chunk, outs, best_s in zip(chunks, chosen.outputs, chosen.best_s):
            self.commit(chunk, outs, best_s, 0.0, "canary")
        sampled = {id(r) for r in sample}
        return [r for r in todo if id(r) not in sampled]

    def finish(self) -> dict:
        summary = self.summary()
        if self.paths["plot"] is not None:
            report.plot(summary, self.state.batches, self.paths["plot"])
        report.write_json(self.paths["summary"], summary)
        self.mlog.write("summary", **{k: summary[k] for k in ("totals", "this_run", "settings")})
        rate = summary["totals"]["acceptance_rate"]
        model_drafted = summary["settings"]["drafter"] == "model"
        if model_drafted and rate is not None and rate < self.settings.warn_below_acceptance and not self.watch.warnings:
            # This run's batches stayed above the threshold but the whole job (resumed) did not.
            log.warning(low_acceptance_message(rate, self.settings.warn_below_acceptance,
                                               summary["settings"]["draft"], self.target.name))
        return summary

    def summary(self) -> dict:
        """Totals over every input record now in the output (earlier runs included), and this
        run's throughput: wall time from the start to the last write, canary and compiles included."""
        keys = {r.key for r in self.records}
        written = read_output(self.out_path)
        mine = [x for x in written if str(x["id"]) in keys]
        missing = len(keys) - len({str(x["id"]) for x in mine})
        if missing:
            log.warning("%s: %d input record(s) are missing from the output", self.out_path, missing)
        if len(mine) < len(written):
            log.warning("%s: %d line(s) have ids that are not in %s", self.out_path, len(written) - len(mine),
                        self.in_path)
        state, s, d, wall = self.state, self.settings, self.defaults, self.state.elapsed()
        import jax

        return {
            "input": str(self.in_path), "output": str(self.out_path),
            "totals": report.totals(mine), "missing": missing, "skipped_existing": self.skipped,
            "this_run": {
                "records": state.records, "new_tokens": state.new_tokens, "wall_s": wall,
                "decode_s": state.decode_s, "compile_s": state.compile_s, "canary_s": state.canary_s,
                "records_per_s": state.records / wall if wall > 0 else 0.0,
                "tokens_per_s": state.new_tokens / wall if wall > 0 else 0.0,
                "decode_tokens_per_s": state.new_tokens / state.decode_s if state.decode_s > 0 else 0.0,
                "batches": len(state.batches),
                "workers": _per_worker(state.batches),
            },
            "by_prompt_version": report.by_prompt_version(mine),
            "settings": {
                "target": self.target.name, "draft": self.draft.name if self.draft is not None else None,
                "method": method_name(self.num_draft, self.tree, self.ngram), "num_draft_tokens": self.num_draft,
                "tree": self.tree, "drafter": "ngram" if self.ngram and self.num_draft else "model" if self.num_draft else None,
                "batch_size": s.batch_size, "scheduler": s.scheduler, **dataclasses.asdict(d), "auto": s.auto,
                "auto_sample": s.auto_sample if s.auto else None,
                "auto_ks": list(s.auto_ks) if s.auto else None,
                "auto_trees": list(s.auto_trees) if s.auto else None,
                "auto_ngram_ks": list(s.auto_ngram_ks) if s.auto else None,
                "warn_below_acceptance": s.warn_below_acceptance, "dtype": str(self.target.dtype),
                "backend": jax.default_backend(), "jax": jax.__version__,
            },
            "canary": self.decision.as_dict() if self.decision is not None else None,
            "summary_path": str(self.paths["summary"]),
            "plot_path": str(self.paths["plot"]) if self.paths["plot"] is not None else None,
            "metrics_log": str(self.paths["metrics_log"]) if self.paths["metrics_log"] is not None else None,
        }


def _per_worker(batches: list[dict]) -> dict:
    """Records, tokens and decode tokens/s per Ray worker (its process id); {} for a local job."""
    out: dict = {}
    for b in batches:
        if b.get("worker") is not None:
            w = out.setdefault(str(b["worker"]), {"records": 0, "new_tokens": 0, "decode_s": 0.0})
            w["records"] += b["records"]
            w["new_tokens"] += b["new_tokens"]
            w["decode_s"] += b["decode_s"]
    for w in out.values():
        w["decode_tokens_per_s"] = w["new_tokens"] / w["decode_s"] if w["decode_s"] > 0 else 0.0
    return out


def lognormal_budgets(n: int, median: float = 200, sigma: float = 0.8, cap: int = 1024, seed: int = 0) -> list[int]:
    """Chat-like answer lengths: n draws of a fixed-seed lognormal (this median and sigma), in [1, cap]."""
    import numpy as np

    draws = np.random.default_rng(seed).lognormal(np.log(median), sigma, n)
    return [int(x) for x in np.clip(np.ceil(draws), 1, cap)]


def write_humaneval_jsonl(path: str | Path, limit: int | None = None, lognormal: dict | bool | None = None) -> Path:
    """Writes the repository's HumanEval prompts as a batch input ({"id": "HumanEval/i", "prompt"}).
    lognormal: True (or lognormal_budgets' keywords) gives each record its own "max_new_tokens",
    drawn from that fixed-seed mix: a job whose records end at very different lengths."""
    from jaxspec.humaneval import load_prompts

    path = Path(path)
    if path.exists():
        raise InputError(f"{path} already exists; not overwriting it")
    path.parent.mkdir(parents=True, exist_ok=True)
    prompts = load_prompts(limit=limit)
    records = [{"id": f"HumanEval/{i}", "prompt": p} for i, p in enumerate(prompts)]
    if lognormal:
        for r, budget in zip(records, lognormal_budgets(len(records), **(lognormal if isinstance(lognormal, dict) else {}))):
            r["max_new_tokens"] = budget
    lines = [json.dumps(r) for r in records]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path
