"""Offline batch jobs: `run_job(IN.jsonl, OUT.jsonl, target, draft, JobSettings(...))`, behind `jaxspec batch`.

Input: one JSON object per line: "id" (a non-empty string or an integer), "prompt" (text, or a
list of token ids) or "messages" (a chat rendered with the tokenizer's chat template), and
optionally any jaxspec.SamplingParams field ("max_tokens" or "max_new_tokens", "temperature", ...: overriding the job's
defaults) and "prompt_version" (a string, reported separately in the summary). Other fields are
ignored. Blank lines are skipped. A line in the OpenAI batch format ("custom_id", "method", "url",
"body") is a request to /v1/chat/completions or /v1/completions, keyed by its custom_id and
answered in the OpenAI batch output format (jaxspec/jobs/openai_batch.py); a file may mix both.

Output: one JSON line per input record, in completion order (records are grouped by shape for
throughput; each line names its "id" and input "line"): "text", "token_ids", "finish_reason",
"method" and "stats" (the record's acceptance statistics); with n > 1 samples, "outputs" (one
such object per sample) and "stats" summed; or "error" for a record that could not be served. A line that is not a readable record with an id gets the id "line:N" (N = its
1-based line number in the input).

Crash safety: the records that finished at each return to the host (a static device batch, or
the rows freed in the continuous scheduler's slots) are appended in one write, flushed and
fsynced. Rerunning the same command after a crash (even kill -9) truncates a torn final line,
skips ids already in the output and serves the rest, so every input id ends up in the output
exactly once; complete lines already written are never changed.
"""


from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import jax

from jaxspec.decoding.method import DecodeMethod
from jaxspec.errors import InputError
from jaxspec.jobs import report
from jaxspec.jobs.canary import (
    candidates, drafts_by_kind, drafts_name, method_fields, pick_sample, run_canary, sample_size,
)
from jaxspec.jobs.durable import WriteError, repair_tail
from jaxspec.jobs.local import run_local
from jaxspec.jobs.metrics_log import AcceptanceWatch, MetricsLog
from jaxspec.jobs.output import (
    ChunkWriter,
    as_result,
    check_output_unique,
    error_line,
    ok_line,
    output_key,
    read_output,
)
from jaxspec.jobs.ray_workers import check_ray, run_on_ray
from jaxspec.jobs.records import BatchError, Record, check_unique, prepare, read_input
from jaxspec.jobs.settings import JobSettings
from jaxspec.model.loading import Model, check_target
from jaxspec.serving.generate import check_pair
from jaxspec.serving.warnings import low_acceptance_message

log = logging.getLogger("jaxspec")


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


def run_job(in_path: str | Path, out_path: str | Path, target: Model, draft=None,
            settings: JobSettings = JobSettings()) -> dict:
    """Runs (or resumes) a batch job from `in_path` into `out_path`; returns the summary dict.

    draft: speculative decoding with K = settings.num_draft_tokens when given (a draft model, an
    EAGLE-3 head, or "ngram" / jaxspec.ngram.Ngram for n-gram lookup), plain decoding when None;
    with settings.auto, a list of them (at most one of each kind) for the canary to choose among,
    beside plain decoding and n-gram lookup. settings: JobSettings (the
    records' default settings, batch size, scheduler, canary, replicas and outputs).
    Raises BatchError before any work for duplicate input ids or an output it did not write, and
    InputError for bad job settings; bad records become "error" lines instead. A file that cannot
    be written (a full disk) stops the job with a BatchError naming it and the records saved; every
    line written is whole, and the same call resumes.
    """
    start = time.perf_counter()
    in_path, out_path = Path(in_path), Path(out_path)
    if not isinstance(settings, JobSettings):
        raise InputError(f"settings must be a jaxspec.batch.JobSettings; got {settings!r}")
    check_target(target)
    if not in_path.is_file():
        raise InputError(f"input file {in_path} does not exist")
    if out_path.exists() and out_path.resolve() == in_path.resolve():
        raise InputError("the output file must not be the input file")
    drafts = drafts_by_kind(draft)
    if settings.auto and not drafts:
        raise InputError('auto needs a draft (a draft model, an EAGLE-3 head or "ngram") to compare against plain '
                         'decoding')
    if len(drafts) > 1 and not settings.auto:
        raise InputError(f"draft: {len(drafts)} drafts ({drafts_name(drafts)}) need auto=True, so the canary picks "
                         f"one; or give one")
    if settings.workers > 1:
        check_ray()
    for d in drafts.values():
        check_pair(target, d, DecodeMethod.of(d, settings.num_draft_tokens))
    method = DecodeMethod.of(next(iter(drafts.values()), None), settings.num_draft_tokens)  # auto: the canary's
    canary = candidates(draft, settings) if settings.auto else []
    if settings.gpus_per_worker is None:
        gpus = 0 if jax.default_backend() == "cpu" else target.tensor_parallel
        settings = dataclasses.replace(settings, gpus_per_worker=gpus)

    records = read_input(in_path)
    check_unique(records, in_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    writer = ChunkWriter(out_path)  # locks the output before it is inspected
    try:
        return _Job(records, in_path, out_path, writer, target, drafts, method, canary, settings, start).run()
    finally:
        writer.close()


class _Job:
    """One run of a job over the records not yet in the output."""

    def __init__(self, records, in_path, out_path, writer, target, drafts, method, canary, settings, start):
        self.records, self.in_path, self.out_path, self.writer = records, in_path, out_path, writer
        self.target, self.drafts, self.settings = target, drafts, settings
        self.method = method  # the canary may replace it
        self.canary_methods = canary
        self.defaults, self.paths = settings.sampling, settings.paths(out_path)
        self.state = _RunState(start)
        self.decision = None
        self.mlog = MetricsLog(self.paths["metrics_log"], model=target.name, draft=drafts_name(drafts),
                               job=str(out_path))
        self.watch = AcceptanceWatch(settings.options.warn_below_acceptance, drafts_name(drafts) or "", target.name)
        self.bar = None

    @property
    def draft(self):
        """What the job's method drafts with (the canary's choice among several): a draft model,
        an EAGLE-3 head, n-gram settings, or None."""
        return self.drafts.get(self.method.kind)

    def run(self) -> dict:
        torn = repair_tail(self.out_path)
        if torn:
            log.warning("%s: removed a torn final line (%d bytes) left by an interrupted run", self.out_path, torn)
        existing = read_output(self.out_path)
        check_output_unique(existing, self.out_path)
        done = {output_key(x) for x in existing}
        pending = [prepare(r, self.target, self.defaults) for r in self.records if r.key not in done]
        self.skipped = len(self.records) - len(pending)
        todo = [r for r in pending if r.error is None]
        self.bar = _Progress(len(pending), self.settings.progress)
        try:
            try:
                failed = [error_line(r) for r in pending if r.error is not None]
                self.writer.write(failed)
                self.state.records += len(failed)
                self.bar.update(len(failed), 0.0, None)
                if self.canary_methods and any(r.request.sampling.n == 1 for r in todo):
                    todo = self.canary(todo)
                if todo:
                    self.serve(todo)
            finally:
                self.bar.close()
            return self.finish()
        except WriteError as e:  # a full disk: every line written is whole (durable.py); say what is kept
            raise BatchError(self.stopped(e)) from e

    def stopped(self, e: WriteError) -> str:
        saved, total = self.skipped + self.state.records, len(self.records)
        kept = (f"all {total} records are saved in {self.out_path}, but not the job's summary" if saved == total else
                f"the job stopped with {saved} of {total} records saved whole in {self.out_path}")
        return f"cannot write {e.path} ({e.strerror}): {kept}; free some space and run the same command again to resume"

    def serve(self, todo: list[Record]) -> None:
        """Decodes `todo` with the job's setting on this process's devices or over Ray replicas,
        committing records as they come back."""
        execute = run_on_ray if self.settings.workers > 1 else run_local

        def emit(records, completions, decode_s, compile_s, worker):
            self.commit(records, completions, decode_s, compile_s, "job", worker=worker)

        execute(self.target, self.draft, todo, self.settings, self.method, emit)

    def commit(self, chunk: list[Record], outs, decode_s: float, compile_s: float, phase: str, worker=None) -> None:
        """Writes a finished chunk durably (outs[i]: chunk[i]'s n completions), then logs and shows it."""
        state, method = self.state, method_fields(self.method)
        written = [ok_line(r, c, method["method"], self.target) for r, c in zip(chunk, outs)]
        self.writer.write(written)
        lines = [as_result(x) for x in written]
        t = report.totals(lines)
        low = self.watch.update(t["accepted"], t["drafted"]) if self.method.watches_acceptance else False
        state.records += len(lines)
        state.new_tokens += t["new_tokens"]
        state.decode_s += decode_s
        state.compile_s += compile_s
        entry = self.mlog.write(
            "batch", phase=phase, **method, prompt_version=_versions(lines), records=len(lines), batch_size=self.settings.batch_size,
            scheduler=self.settings.scheduler, worker=worker,
            prompt_tokens=t["prompt_tokens"], cached_tokens=t["cached_tokens"], new_tokens=t["new_tokens"], decode_s=decode_s,
            compile_s=compile_s, tokens_per_s=t["new_tokens"] / decode_s if decode_s > 0 else 0.0,
            acceptance_rate=t["acceptance_rate"], tokens_per_step=t["tokens_per_step"],
            per_position_acceptance=t["per_position_acceptance"], rounds_per_k=t["rounds_per_k"],
            running_acceptance=self.watch.rate,
            low_acceptance=low, elapsed_s=state.elapsed(), running_tokens_per_s=state.tokens_per_s(),
        )
        state.batches.append(entry)
        self.bar.update(len(lines), state.tokens_per_s(), self.watch.rate)

    def canary(self, todo: list[Record]) -> list[Record]:
        """Runs the canary on a sample of `todo`, keeps the chosen setting's outputs for the
        sample, and returns the records still to do."""
        t0 = time.perf_counter()
        s = self.settings
        single = [r for r in todo if r.request.sampling.n == 1]  # the canary times one row per record
        n = sample_size(len(single), s.auto_sample, s.batch_size)
        sample = [single[i] for i in pick_sample([len(r.request.token_ids) for r in single], n)]

        def on_pass(trial, number, new_tokens, decode_s, compile_s):
            self.mlog.write(
                "canary", **method_fields(trial.method), **{"pass": number}, records=len(sample), batch_size=s.batch_size, new_tokens=new_tokens,
                decode_s=decode_s, compile_s=compile_s, tokens_per_s=new_tokens / decode_s if decode_s > 0 else 0.0,
            )

        # Full batches, sorted by length: the batch size decides whether speculation pays, so the
        # sample runs at the job's batch size even where it spans two buckets.
        by_length = sorted(sample, key=lambda r: len(r.request.token_ids))
        chunks = [by_length[i : i + s.batch_size] for i in range(0, len(by_length), s.batch_size)]
        self.decision = run_canary(
            self.target, list(self.drafts.values()), [[r.request for r in c] for c in chunks], s.batch_size,
            self.canary_methods,
            repeats=s.auto_repeats, min_speedup=s.auto_min_speedup, on_pass=on_pass, deterministic=s.options.deterministic,
        )
        self.method = self.decision.method
        if self.method.speculative:
            self.watch.draft_name = getattr(self.draft, "name", self.watch.draft_name)
            self.watch.note = (
                f"; the canary measured {self.decision.speedup:.2f}x the speed of plain decoding for "
                f"{self.method.name} on {len(sample)} sample records"
            )
        self.mlog.write("decision", **self.decision.as_dict())
        log.info("canary on %d records: %s", len(sample), self.decision.reason)
        self.state.canary_s = time.perf_counter() - t0
        chosen = self.decision.chosen
        for chunk, outs, best_s in zip(chunks, chosen.outputs, chosen.best_s):
            self.commit(chunk, [[c] for c in outs], best_s, 0.0, "canary")
        sampled = {id(r) for r in sample}
        return [r for r in todo if id(r) not in sampled]

    def finish(self) -> dict:
        summary = self.summary()
        if self.paths["plot"] is not None:
            report.plot(summary, self.state.batches, self.paths["plot"])
        report.write_json(self.paths["summary"], summary)
        self.mlog.write("summary", **{k: summary[k] for k in ("totals", "this_run", "settings")})
        rate = summary["totals"]["acceptance_rate"]
        if self.method.watches_acceptance and rate is not None and rate < self.settings.options.warn_below_acceptance and not self.watch.warnings:
            # This run's batches stayed above the threshold but the whole job (resumed) did not.
            log.warning(low_acceptance_message(rate, self.settings.options.warn_below_acceptance, self.watch.draft_name,
                                               self.target.name))
        return summary

    def summary(self) -> dict:
        """Totals over every input record now in the output (earlier runs included), and this
        run's throughput: wall time from the start to the last write, canary and compiles included."""
        keys = {r.key for r in self.records}
        written = read_output(self.out_path)
        mine = [as_result(x) for x in written if output_key(x) in keys]
        missing = len(keys) - len({str(x["id"]) for x in mine})
        if missing:
            log.warning("%s: %d input record(s) are missing from the output", self.out_path, missing)
        if len(mine) < len(written):
            log.warning("%s: %d line(s) have ids that are not in %s", self.out_path, len(written) - len(mine),
                        self.in_path)
        state, s, d, wall = self.state, self.settings, self.defaults, self.state.elapsed()
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
                "graph_cache": self.target.graphs.counts(),  # the target's compiled graphs since it was loaded
                "workers": _per_worker(state.batches),
            },
            "by_prompt_version": report.by_prompt_version(mine),
            "settings": {
                "target": self.target.name, "draft": drafts_name(self.drafts),
                **method_fields(self.method), "batch_size": s.batch_size, "scheduler": s.scheduler, **dataclasses.asdict(d), "auto": s.auto,
                "auto_sample": s.auto_sample if s.auto else None,
                "auto_ks": list(s.auto_ks) if s.auto else None,
                "auto_trees": list(s.auto_trees) if s.auto else None,
                "auto_ngram_ks": list(s.auto_ngram_ks) if s.auto else None,
                "warn_below_acceptance": s.options.warn_below_acceptance, "deterministic": s.options.deterministic, "dtype": str(self.target.dtype),
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
