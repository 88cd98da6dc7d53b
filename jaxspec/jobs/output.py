"""Batch-job output: the crash-safe writer (whole chunks, fsynced, under a lock; a full disk
leaves none of a chunk: durable.py), resume (the ids already written read back) and the output lines (an OpenAI
batch request's in the OpenAI batch output format, jaxspec/jobs/openai_batch.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from jaxspec.jobs import openai_batch
from jaxspec.jobs.durable import append_whole
from jaxspec.jobs.records import MAX_LISTED_DUPLICATES, BatchError, Record
from jaxspec.serving.stats import RequestStats


def read_output(path: Path) -> list[dict]:
    """The records already in an output file; refuses a file a batch job did not write."""
    out = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                obj = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                obj = None
            if not isinstance(obj, dict) or "id" not in obj:
                raise BatchError(f"{path} line {n} is not a batch output record; refusing to append to this file")
            out.append(obj)
    return out


def output_key(line: dict) -> str:
    """The input record an output line answers: its id, or an OpenAI answer's custom_id."""
    return openai_batch.key(line) if openai_batch.is_answer(line) else str(line["id"])


def as_result(line: dict) -> dict:
    """An output line in the job's own layout ("id", "stats", "finish_reason" or "error"), for the summary."""
    return openai_batch.as_result(line) if openai_batch.is_answer(line) else line


def check_output_unique(records: list[dict], path: Path) -> None:
    seen: set[str] = set()
    dups = sorted({k for k in map(output_key, records) if k in seen or seen.add(k)})
    if dups:
        raise BatchError(f"{path} already holds id(s) more than once: {', '.join(map(repr, dups[:MAX_LISTED_DUPLICATES]))}")


class ChunkWriter:
    """Appends whole chunks of lines: one write, fsynced, so a crash loses at most the chunk in
    flight, and a full disk none of what was written (WriteError). Holds an exclusive lock so two
    jobs never append to one file."""

    def __init__(self, path: Path):
        self.path, new = path, not path.exists()
        self.f = open(path, "ab")
        try:
            import fcntl

            fcntl.flock(self.f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except ImportError:  # no fcntl (Windows): no lock
            pass
        except OSError:
            self.f.close()
            raise BatchError(f"another job is writing {path}; wait for it or use another output file") from None
        if new:  # make the new file's directory entry durable too
            fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def write(self, lines: list[dict]) -> None:
        if lines:
            data = "".join(json.dumps(x, ensure_ascii=False) + "\n" for x in lines).encode("utf-8")
            append_whole(self.f.fileno(), data, self.path)

    def close(self) -> None:
        self.f.close()


def _head(record: Record) -> dict:
    head = {"id": record.id, "line": record.line}
    if record.prompt_version is not None:
        head["prompt_version"] = record.prompt_version
    return head


def error_line(record: Record) -> dict:
    if record.openai:
        return openai_batch.error_line(record)
    return {**_head(record), "error": record.error}


def ok_line(record: Record, completions: list, method: str, model=None) -> dict:
    """A served record's line from its SamplingParams.n completions (index order); model: the
    target (an OpenAI answer names it and decodes its logprobs' tokens). One sample's fields are
    the line's own; n > 1 gives "outputs", one such object per sample with its "index", and
    "stats" summed over them. prompt_logprobs, where asked, are the line's (the prompt's)."""
    if record.openai:
        return openai_batch.ok_line(record, completions, method, model)
    first = completions[0]
    prompt = {"prompt_logprobs": _as_json(first.prompt_logprobs)} if first.prompt_logprobs is not None else {}
    if record.request.sampling.n == 1:
        return {**_head(record), **_sample(first), "method": method, **prompt}
    return {**_head(record), "outputs": [{"index": c.index, **_sample(c)} for c in completions], "method": method,
            "stats": RequestStats.combined([c.stats for c in completions]).as_dict(), **prompt}


def _sample(c) -> dict:
    return {"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
            "stats": c.stats.as_dict(), **({"logprobs": _as_json(c.logprobs)} if c.logprobs is not None else {})}


def _as_json(entries: list) -> list:
    """Logprob entries with JSON's string keys ({"id": logprob}; None stays None)."""
    return [None if e is None else {str(t): lp for t, lp in e.items()} for e in entries]
