"""OpenAI batch files (the format of the OpenAI Batch API and `vllm run-batch`) in a batch job.

An input line `{"custom_id", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions",
"body": {...}}` is a request; its answer is one line in the OpenAI batch output format, keyed by
custom_id (resume, duplicates and the summary treat custom_id as a record's id). Everything else
(crash-safe writes, resume, the canary, the metrics log) is the job's own machinery: this file only
reads such lines into Records and writes their answers.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid

from jaxspec.errors import InputError
from jaxspec.sampling_params import SamplingParams
from jaxspec.serving.requests import Request, encode_prompt, make_request, render_messages
from jaxspec.serving.stats import RequestStats
from jaxspec.structured_outputs import StructuredOutputsParams

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
URLS = (CHAT, COMPLETIONS)

# The body's settings: OpenAI body key -> the jaxspec.SamplingParams field it sets. A key the body
# omits (or sets to null) keeps the job's default (JobSettings.sampling, the batch CLI's flags), not
# OpenAI's: omitted max_tokens is the job's --max-new-tokens. Listed in the order applied, so
# max_completion_tokens wins over max_tokens, as in vLLM.
BODY_SETTINGS = {
    "max_tokens": "max_tokens",
    "max_completion_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",  # vLLM's extra body fields
    "min_p": "min_p",
    "seed": "seed",
    "n": "n",  # n choices, one sample each (their prompt prefilled once where it is long enough)
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "logit_bias": "logit_bias",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",  # vLLM's extra body field
    "prompt_logprobs": "prompt_logprobs",  # vLLM's extra body field; answered in choices[0].prompt_logprobs
    "structured_outputs": "structured_outputs",  # vLLM's extra body field: {"json": ...}, {"regex": ...}, ...
}
UNNAMED = ("invalid_json_line", "missing_custom_id", "invalid_custom_id")  # parse()'s codes of lines keyed "line:N"
FINISH_REASONS = {"eos": "stop"}  # the engine's older name; "stop" and "length" pass through


class RequestError(InputError):
    """A request line that cannot be served; `code` goes into its error object."""

    def __init__(self, message: str, code: str = "invalid_request"):
        super().__init__(message)
        self.code = code


def is_request(obj: dict) -> bool:
    """Whether an input object is an OpenAI batch request (rather than a jaxspec record)."""
    return "custom_id" in obj or ("id" not in obj and ("body" in obj or "url" in obj))


def parse(obj: dict | None, line: int, error: str | None = None) -> dict:
    """An OpenAI request line -> the fields of its Record (jaxspec.jobs.records), keyed by
    custom_id; a line without a usable custom_id (or unreadable, obj None, `error` saying why) is
    keyed "line:N", as the job's other unnamed lines."""
    unnamed = dict(line=line, key=f"line:{line}", id=f"line:{line}", data=obj)
    if obj is None:
        return dict(unnamed, error=error, error_code="invalid_json_line")
    cid = obj.get("custom_id")
    if cid is None:
        return dict(unnamed, error='custom_id is missing: each request needs a "custom_id" (a string)',
                    error_code="missing_custom_id")
    if not isinstance(cid, str) or not cid:
        return dict(unnamed, error=f"custom_id must be a non-empty string; got {cid!r}", error_code="invalid_custom_id")
    return dict(line=line, key=cid, id=cid, data=obj)


def sampling_of(body: dict, url: str, defaults: SamplingParams) -> SamplingParams:
    """The body's settings (BODY_SETTINGS) over the job's defaults; errors name the body key."""
    checks = {f.name: f.metadata["check"] for f in dataclasses.fields(SamplingParams)}
    given = {}
    for key, field in BODY_SETTINGS.items():
        if body.get(key) is not None:
            given[field] = checks[field](body[key], f"body.{key}")
    given["logprobs"] = _logprobs(body, url, checks["logprobs"])
    if body.get("response_format") is not None:
        given["structured_outputs"] = _response_format(body["response_format"])
    return dataclasses.replace(defaults, **given)


def _response_format(value) -> StructuredOutputsParams | None:
    """OpenAI's response_format: {"type": "text"} (none), {"type": "json_object"} (any JSON object,
    nested at most StructuredOutputsParams.json_object_depth deep) or {"type": "json_schema",
    "json_schema": {"name": ..., "schema": {...}}}."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise RequestError('body.response_format.json_schema must be an object with a "schema" object')
        return StructuredOutputsParams(json=spec["schema"])
    raise RequestError('body.response_format must be {"type": "text"}, {"type": "json_object"} or '
                       f'{{"type": "json_schema", "json_schema": {{"schema": ...}}}}; got {json.dumps(value)}')


def _logprobs(body: dict, url: str, check):
    """SamplingParams.logprobs from the body: chat's `logprobs` (a bool) with `top_logprobs`
    alternatives, or completions' `logprobs` (the count of alternatives); None: not asked for."""
    if url == CHAT:
        asked = body.get("logprobs")
        if asked not in (None, True, False):
            raise RequestError(f"body.logprobs must be true or false for {CHAT}; got {json.dumps(asked)}")
        top = body.get("top_logprobs")
        if top is not None and not asked:
            raise RequestError("body.top_logprobs needs body.logprobs: true")
        return check(top or 0, "body.top_logprobs") if asked else None
    count = body.get("logprobs")
    return None if count is None else check(count, "body.logprobs")


def _text(content, where: str):
    """A message's content: a string, or OpenAI's list of text parts (joined with newlines, as vLLM does)."""
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise RequestError(f'{where} must be a string or a list of {{"type": "text", "text": ...}} parts')
        return "\n".join(p["text"] for p in content)
    return content


def _prompt(body: dict, url: str, target):
    """The prompt to encode: the chat rendered with the tokenizer's template, or the completion's prompt."""
    if url == CHAT:
        messages = body.get("messages")
        if messages is None:
            raise RequestError(f"body.messages is missing: {CHAT} needs a chat")
        if isinstance(messages, list):
            messages = [{**m, "content": _text(m.get("content"), f"body.messages[{i}].content")}
                        if isinstance(m, dict) else m for i, m in enumerate(messages)]
        try:
            return render_messages(messages, target.tokenizer, target.name), "body.messages"
        except InputError as e:
            raise RequestError(f"body.{e}") from None
    prompt = body.get("prompt")
    if prompt is None:
        raise RequestError(f"body.prompt is missing: {COMPLETIONS} needs a prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise RequestError(f"body.prompt holds {len(prompt)} prompts; give one prompt per request line")
        prompt = prompt[0]
    return prompt, "body.prompt"


def build_request(data: dict, target, defaults: SamplingParams) -> Request:
    """A request line's Request; RequestError names the field (body.temperature, url, ...)."""
    if data.get("method", "POST") != "POST":
        raise RequestError(f"method must be POST; got {data['method']!r}", "invalid_method")
    url = data.get("url")
    if url not in URLS:
        raise RequestError(f"url must be {CHAT} or {COMPLETIONS}; got {url!r}", "invalid_url")
    body = data.get("body")
    if not isinstance(body, dict):
        raise RequestError(f"body must be an object; got {body!r}")
    sampling = sampling_of(body, url, defaults)
    prompt, field = _prompt(body, url, target)
    c = target.config
    try:
        return make_request(encode_prompt(prompt, target.tokenizer, field), sampling, c.vocab_size,
                            c.max_position_embeddings, field, target.tokenizer, c.eos_token_ids)
    except InputError as e:
        raise RequestError(str(e)) from None


def _id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


def error_line(record) -> dict:
    """A request that could not be served; a line without a usable custom_id keeps the id "line:N"."""
    named = record.error_code not in UNNAMED
    return {"id": _id("batch_req_") if named else record.id, "custom_id": record.id if named else None,
            "response": None, "error": {"code": record.error_code or "invalid_request", "message": record.error}}


def ok_line(record, completions: list, method: str, model) -> dict:
    """The answer in the OpenAI batch output format, a choice per completion (the body's n);
    jaxspec's own fields under body["jaxspec"]. model: the target (its name, and its tokenizer for
    the logprobs' token strings)."""
    chat = record.data["url"] == CHAT
    head = {"id": _id("chatcmpl-"), "object": "chat.completion"} if chat else {"id": _id("cmpl-"), "object": "text_completion"}
    stats = RequestStats.combined([c.stats for c in completions]).as_dict()
    prompt_tokens, new = completions[0].stats.prompt_tokens, sum(len(c.token_ids) for c in completions)
    ours = {"line": record.line, "method": method, "stats": stats}
    if len(completions) == 1:  # n > 1: each choice has its own "token_ids" (vLLM's return_token_ids)
        ours["token_ids"] = completions[0].token_ids
    if record.prompt_version is not None:
        ours["prompt_version"] = record.prompt_version
    body = {
        **head, "created": int(time.time()), "model": model.name,
        "choices": [_choice(record, c, chat, model.tokenizer) | ({"token_ids": c.token_ids} if len(completions) > 1 else {})
                    for c in completions],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": new, "total_tokens": prompt_tokens + new,
                  "prompt_tokens_details": {"cached_tokens": stats["cached_tokens"]}},
        "jaxspec": ours,
    }
    return {"id": _id("batch_req_"), "custom_id": record.id,
            "response": {"status_code": 200, "request_id": _id("req_"), "body": body}, "error": None}


def _choice(record, c, chat: bool, tokenizer) -> dict:
    text = {"message": {"role": "assistant", "content": c.text}} if chat else {"text": c.text}
    return {"index": c.index, **text,
            "logprobs": _logprobs_out(record.data["url"], c, record.request.sampling.logprobs, tokenizer),
            "finish_reason": FINISH_REASONS.get(c.finish_reason, c.finish_reason), "stop_reason": c.stop_reason,
            **_prompt_logprobs(c)}


def _prompt_logprobs(completion) -> dict:
    """vLLM's choices[0].prompt_logprobs ({"id": logprob} per prompt token, None first), where asked."""
    if completion.prompt_logprobs is None:
        return {}
    return {"prompt_logprobs": [None if e is None else {str(t): lp for t, lp in e.items()}
                                for e in completion.prompt_logprobs]}


def _logprobs_out(url: str, completion, k: int | None, tokenizer) -> dict | None:
    """Completion.logprobs in OpenAI's layout: chat's `content` list of {token, logprob, bytes,
    top_logprobs}, or completions' parallel lists (tokens, token_logprobs, top_logprobs,
    text_offset); k: the alternatives asked for (an entry holds them and the chosen token)."""
    if completion.logprobs is None:
        return None
    text = lambda t: tokenizer.decode([t]) if tokenizer else str(t)  # noqa: E731
    chosen = completion.token_ids
    tops = [sorted(entry.items(), key=lambda x: -x[1])[:k] for entry in completion.logprobs]
    if url == CHAT:
        def item(t, lp):
            return {"token": text(t), "logprob": lp, "bytes": list(text(t).encode())}
        return {"content": [{**item(t, entry[t]), "top_logprobs": [item(a, lp) for a, lp in top]}
                            for t, entry, top in zip(chosen, completion.logprobs, tops)]}
    tokens = [text(t) for t in chosen]
    offsets = [sum(len(x) for x in tokens[:i]) for i in range(len(tokens))]
    return {"tokens": tokens, "token_logprobs": [entry[t] for t, entry in zip(chosen, completion.logprobs)],
            "top_logprobs": [{text(a): lp for a, lp in top} for top in tops], "text_offset": offsets}


def is_answer(line: dict) -> bool:
    return "custom_id" in line and "response" in line


def key(line: dict) -> str:
    """An output line's record key: its custom_id, or its id ("line:N") where it had none."""
    return str(line["id"] if line.get("custom_id") is None else line["custom_id"])


def as_result(line: dict) -> dict:
    """An answer line as the job's own output record, for the summary and the metrics log."""
    body = (line.get("response") or {}).get("body")
    if line.get("error") or not isinstance(body, dict):
        err = line.get("error") or {}
        return {"id": key(line), "error": err.get("message", str(err)) if isinstance(err, dict) else str(err)}
    ours, usage = body.get("jaxspec") or {}, body.get("usage") or {}
    new = usage.get("completion_tokens", 0)
    stats = ours.get("stats") or {"prompt_tokens": usage.get("prompt_tokens", 0), "new_tokens": new,
                                  "target_steps": new, "drafted": 0, "accepted": 0}
    out = {"id": key(line), "finish_reason": body["choices"][0].get("finish_reason"), "stats": stats}
    if len(body["choices"]) > 1:
        out["outputs"] = [{"finish_reason": c.get("finish_reason")} for c in body["choices"]]
    if "prompt_version" in ours:
        out["prompt_version"] = ours["prompt_version"]
    return out
