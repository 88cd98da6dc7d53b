"""Batch-job input: reading each line into a Record, refusing duplicate ids, and building each
record's Request (its own settings over the job's defaults; errors name the field). OpenAI batch
request lines (custom_id, url, body) are read by jaxspec/jobs/openai_batch.py into the same Records."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from jaxspec.errors import InputError, JaxspecError
from jaxspec.jobs import openai_batch  # OpenAI batch request lines
from jaxspec.model.loading import Model
from jaxspec.sampling_params import ALIASES, SamplingParams
from jaxspec.serving.requests import Request, encode_prompt, make_request, render_messages

# A record's own sampling settings: SamplingParams' fields (and their aliases), over the job's.
SETTING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams)) + tuple(ALIASES)
MAX_LISTED_DUPLICATES = 20


class BatchError(JaxspecError):
    """The job cannot start (duplicate input ids, an output file it did not write) or go on (its
    output disk is full: what was written is whole, and the same command resumes)."""


@dataclasses.dataclass
class Record:
    line: int  # 1-based line number in the input
    key: str  # the id as compared for duplicates and resume (1 and "1" are the same id)
    id: object  # the id as written back
    data: dict | None  # the parsed object; None when the line could not be read
    error: str | None = None
    request: Request | None = None
    openai: bool = False  # an OpenAI batch request line (key = its custom_id), answered in that format
    error_code: str | None = None  # the OpenAI error object's code

    @property
    def prompt_version(self):
        v = self.data.get("prompt_version") if self.data else None
        return v if isinstance(v, str) else None


def parse_line(raw: bytes, line: int) -> Record:
    """One input line -> Record; a line that is not an object with a valid id gets id "line:N"."""
    unnamed = f"line:{line}"

    def bad(message: str) -> Record:
        return Record(line, unnamed, unnamed, None, message)

    try:
        obj = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        return bad(f"line {line} is not valid UTF-8 ({e.reason} at byte {e.start})")
    except json.JSONDecodeError as e:
        return bad(f"line {line} is not valid JSON: {e.msg} at column {e.colno}")
    if not isinstance(obj, dict):
        return bad(f"line {line} is a JSON {type(obj).__name__}, not an object")
    if openai_batch.is_request(obj):
        return Record(**openai_batch.parse(obj, line), openai=True)
    rid = obj.get("id")
    if rid is None:
        return Record(line, unnamed, unnamed, obj, 'id is missing: each record needs an "id" (a string or an integer)')
    if isinstance(rid, bool) or not isinstance(rid, (str, int)) or rid == "":
        return Record(line, unnamed, unnamed, obj, f"id must be a non-empty string or an integer; got {rid!r}")
    return Record(line, str(rid), rid, obj)


def read_input(path: Path) -> list[Record]:
    with open(path, "rb") as f:
        records = [parse_line(raw, n) for n, raw in enumerate(f, 1) if raw.strip()]
    if any(r.openai for r in records):  # an OpenAI batch file: its unnamed lines are answered in its format
        records = [Record(**openai_batch.parse(r.data, r.line, r.error), openai=True) if r.key == f"line:{r.line}" and not r.openai
                   and (r.data is None or "id" not in r.data) else r for r in records]
    return records


def check_unique(records: list[Record], path: Path) -> None:
    """Duplicate ids make "each id exactly once" impossible: refuse before doing any work."""
    lines: dict[str, list[int]] = {}
    for r in records:
        lines.setdefault(r.key, []).append(r.line)
    dups = [(k, v) for k, v in lines.items() if len(v) > 1]
    if dups:
        listed = "; ".join(f"{k!r} on lines {', '.join(map(str, v))}" for k, v in dups[:MAX_LISTED_DUPLICATES])
        more = f"; and {len(dups) - MAX_LISTED_DUPLICATES} more" if len(dups) > MAX_LISTED_DUPLICATES else ""
        raise BatchError(f"{path}: {len(dups)} duplicate id(s), each id must appear once: {listed}{more}")


def build_request(data: dict, target: Model, defaults: SamplingParams) -> Request:
    """A record's Request, its own settings overriding the job's; InputError names the field."""
    if "prompt" in data and "messages" in data:
        raise InputError('give either "prompt" or "messages", not both')
    if "messages" in data:
        prompt = render_messages(data["messages"], target.tokenizer, target.name)
    elif "prompt" in data:
        prompt = data["prompt"]
    else:
        raise InputError('prompt is missing: each record needs a "prompt" (text) or "messages" (a chat)')
    if "prompt_version" in data and not isinstance(data["prompt_version"], str):
        raise InputError(f"prompt_version must be a string; got {data['prompt_version']!r}")
    sampling = defaults.updated({f: data[f] for f in SETTING_FIELDS if f in data})
    c = target.config
    return make_request(encode_prompt(prompt, target.tokenizer, "prompt"), sampling, c.vocab_size,
                        c.max_position_embeddings, "prompt", target.tokenizer, c.eos_token_ids)


def prepare(record: Record, target: Model, defaults: SamplingParams) -> Record:
    if record.error is None:
        try:
            build = openai_batch.build_request if record.openai else build_request
            record.request = build(record.data, target, defaults)
        except InputError as e:
            record.error, record.error_code = str(e), getattr(e, "code", None)
    return record
