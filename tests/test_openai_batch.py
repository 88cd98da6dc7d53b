"""OpenAI batch files (`vllm run-batch` input) through `jaxspec batch`: answers in the OpenAI batch
output format, equal to generate's; error lines for bad requests; resume keyed by custom_id."""

import json
import shutil

import pytest
from tiny_models import save_tiny

import jaxspec
from jaxspec import cli
from jaxspec.batch import read_output
from jaxspec.defaults import CHECKPOINTS
from jaxspec.jobs.metrics_log import read_log
from jaxspec.sampling_params import SamplingParams

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
MAX_NEW = 8
TEMPLATE = ("{% for m in messages %}# {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}# assistant:\n{% endif %}")
MESSAGES = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "write is_even"}]
PROMPT = "def add(a, b):"
SAMPLED = dict(temperature=0.8, top_p=0.9, top_k=50, seed=3)


def request(cid, url, body):
    return {"custom_id": cid, "method": "POST", "url": url, "body": {"model": "ignored", **body}}


LINES = [
    request("chat-1", "/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 6}),
    request("cmpl-1", "/v1/completions", {"prompt": [PROMPT], **SAMPLED, "stop": None, "n": 1, "logprobs": None,
                                          "presence_penalty": 0, "frequency_penalty": 0.0}),
    '{"custom_id": "broken", "method": "POST", ',
    request("stop-1", "/v1/completions", {"prompt": PROMPT, "stop": ["\n", "e"], "logprobs": 2}),
    request("lp-chat", "/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 2}),
    request("lp-bad", "/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 2}),
    request("emb-1", "/v1/embeddings", {"input": "x"}),
    {"method": "POST", "url": "/v1/completions", "body": {"prompt": PROMPT}},
    request("hot-1", "/v1/completions", {"prompt": PROMPT, "temperature": -1}),
    request("lb-1", "/v1/chat/completions", {"messages": MESSAGES, "logit_bias": {"5": 8, "7": -100}}),
    request("lb-bad", "/v1/chat/completions", {"messages": MESSAGES, "logit_bias": {"x": 1}}),
    {"id": "own-1", "prompt": PROMPT},  # jaxspec's own record format, in the same file
    request("n-1", "/v1/chat/completions", {"messages": MESSAGES, "n": 2, **SAMPLED}),
    {"id": "own-n", "prompt": PROMPT, "n": 3, **SAMPLED},
]
SERVED = {"chat-1", "cmpl-1", "own-1", "stop-1", "lp-chat", "n-1", "own-n", "lb-1"}
# custom_id (or the id of a line without one) -> (error code, a phrase of its message)
ERRORS = {
    "line:3": ("invalid_json_line", "line 3 is not valid JSON"),
    "lp-bad": ("invalid_request", "body.top_logprobs needs body.logprobs: true"),
    "emb-1": ("invalid_url", "url must be /v1/chat/completions or /v1/completions"),
    "line:8": ("missing_custom_id", "custom_id is missing"),
    "hot-1": ("invalid_request", "body.temperature must be a finite number >= 0"),
    "lb-bad": ("invalid_request", "body.logit_bias key must be an integer >= 0 (a token id); got 'x'"),
}


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A tiny random llama with the embedded tokenizer, given a chat template."""
    path = save_tiny(tmp_path_factory.mktemp("models") / "tiny-chat", "llama", {
        "vocab_size": 8192, "eos_token_id": 0, "pad_token_id": 0, "bos_token_id": 0})
    src = CHECKPOINTS / "hf" / "code-target-16m"
    shutil.copy(src / "tokenizer.json", path / "tokenizer.json")
    config = json.loads((src / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return path


@pytest.fixture(scope="module")
def job(tmp_path_factory, chat_model):
    tmp = tmp_path_factory.mktemp("openai")
    src, out = tmp / "in.jsonl", tmp / "out.jsonl"
    src.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in LINES))
    argv = ["batch", str(src), str(out), "--target", str(chat_model), "--no-draft", "--max-new-tokens", str(MAX_NEW),
            "--batch-size", "4", "--no-plot", "--no-progress"]
    assert cli.main(argv) == 0
    return argv, out


def keyed(out) -> dict:
    got = {}
    for x in read_output(out):
        k = x["custom_id"] if "custom_id" in x and x["custom_id"] is not None else x["id"]
        assert k not in got, f"{k} answered twice"
        got[k] = x
    return got


def test_each_request_answered_once_as_generate_would(job, chat_model):
    got = keyed(job[1])
    assert set(got) == {*SERVED, *ERRORS}
    target = jaxspec.load(chat_model, dtype="float32")
    tok = target.tokenizer
    chat_ids = tok.encode(tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True),
                          add_special_tokens=False)
    greedy = [SamplingParams(temperature=0.0, max_tokens=n, seed=0) for n in (6, MAX_NEW)]
    ref_chat, ref_own = jaxspec.generate([chat_ids, tok.encode(PROMPT)], target, sampling=greedy)
    ref_cmpl = jaxspec.generate([PROMPT], target, max_new_tokens=MAX_NEW, **SAMPLED)[0]

    chat, cmpl = got["chat-1"], got["cmpl-1"]
    for line, ref, prompt_len in ((chat, ref_chat, len(chat_ids)), (cmpl, ref_cmpl, len(tok.encode(PROMPT)))):
        assert line["id"].startswith("batch_req_") and line["error"] is None
        r = line["response"]
        assert r["status_code"] == 200 and r["request_id"]
        body = r["body"]
        assert body["model"] == target.name and isinstance(body["created"], int)
        assert body["jaxspec"]["token_ids"] == ref.token_ids
        assert body["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": len(ref.token_ids),
                                 "total_tokens": prompt_len + len(ref.token_ids),
                                 "prompt_tokens_details": {"cached_tokens": 0}}  # short prompts: none shared
        choice = body["choices"][0]
        assert choice["logprobs"] is None and choice["finish_reason"] == {"eos": "stop"}.get(ref.finish_reason,
                                                                                            ref.finish_reason)
    assert chat["response"]["body"]["object"] == "chat.completion"
    assert chat["response"]["body"]["choices"][0]["message"] == {"role": "assistant", "content": ref_chat.text}
    assert len(ref_chat.token_ids) <= 6  # max_completion_tokens, not the job's 8
    assert cmpl["response"]["body"]["object"] == "text_completion"
    assert cmpl["response"]["body"]["choices"][0]["text"] == ref_cmpl.text
    assert ref_cmpl.token_ids != ref_own.token_ids  # the body's sampling settings were used
    # jaxspec's own record format in the same file, answered in its own format
    assert got["own-1"]["token_ids"] == ref_own.token_ids and "custom_id" not in got["own-1"]


def test_stop_strings_and_logprobs_in_openai_layout(job, chat_model):
    got = keyed(job[1])
    target = jaxspec.load(chat_model, dtype="float32")
    tok = target.tokenizer
    ref = jaxspec.generate([PROMPT], target, max_new_tokens=MAX_NEW, stop=[["\n", "e"]], logprobs=2)[0]
    choice = got["stop-1"]["response"]["body"]["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (ref.text, ref.finish_reason,
                                                                                 ref.stop_reason)
    lp = choice["logprobs"]
    assert lp["tokens"] == [tok.decode([t]) for t in ref.token_ids]
    # float32 in other batch shapes than generate's: equal to 1e-4
    assert lp["token_logprobs"] == pytest.approx([e[t] for t, e in zip(ref.token_ids, ref.logprobs)], abs=1e-4)
    assert [len(x) for x in lp["top_logprobs"]] == [2] * len(ref.token_ids)
    chat_ids = tok.encode(tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True),
                          add_special_tokens=False)
    ref = jaxspec.generate([chat_ids], target, max_new_tokens=MAX_NEW, logprobs=2)[0]
    content = got["lp-chat"]["response"]["body"]["choices"][0]["logprobs"]["content"]
    assert [c["logprob"] for c in content] == pytest.approx([e[t] for t, e in zip(ref.token_ids, ref.logprobs)],
                                                             abs=1e-4)
    for c, e in zip(content, ref.logprobs):
        top = sorted(e.items(), key=lambda x: -x[1])[:2]
        assert [x["token"] for x in c["top_logprobs"]] == [tok.decode([a]) for a, _ in top]
        assert [x["logprob"] for x in c["top_logprobs"]] == pytest.approx([v for _, v in top], abs=1e-4)
        assert bytes(c["bytes"]).decode() == c["token"]


def test_n_samples_and_logit_bias_equal_generates(job, chat_model):
    got = keyed(job[1])
    target = jaxspec.load(chat_model, dtype="float32")
    tok = target.tokenizer
    chat_ids = tok.encode(tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True),
                          add_special_tokens=False)
    ref_chat = jaxspec.generate([chat_ids], target, max_new_tokens=MAX_NEW, n=2, **SAMPLED)
    ref_own = jaxspec.generate([PROMPT], target, max_new_tokens=MAX_NEW, n=3, **SAMPLED)
    body = got["n-1"]["response"]["body"]
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert [c["token_ids"] for c in body["choices"]] == [r.token_ids for r in ref_chat]
    assert [c["message"]["content"] for c in body["choices"]] == [r.text for r in ref_chat]
    assert body["usage"]["completion_tokens"] == sum(len(r.token_ids) for r in ref_chat)
    assert body["usage"]["prompt_tokens"] == len(chat_ids)  # the prompt once, as OpenAI counts it
    ref_bias = jaxspec.generate([chat_ids], target, max_new_tokens=MAX_NEW, logit_bias={5: 8, 7: -100})[0]
    biased = got["lb-1"]["response"]["body"]["jaxspec"]["token_ids"]
    assert biased == ref_bias.token_ids and 7 not in biased
    own = got["own-n"]
    assert [o["index"] for o in own["outputs"]] == [0, 1, 2] and "token_ids" not in own
    assert [o["token_ids"] for o in own["outputs"]] == [r.token_ids for r in ref_own]
    assert len({tuple(r.token_ids) for r in ref_own}) == 3  # distinct seeded samples
    assert own["stats"]["new_tokens"] == sum(len(r.token_ids) for r in ref_own)


def test_bad_requests_get_error_lines(job):
    got = keyed(job[1])
    for k, (code, phrase) in ERRORS.items():
        line = got[k]
        assert line["response"] is None and line["error"]["code"] == code, line
        assert phrase in line["error"]["message"], line
        assert line["custom_id"] == (None if k.startswith("line:") else k)


def test_summary_and_metrics_log_count_the_requests(job):
    out = job[1]
    summary = json.loads(out.with_suffix(".summary.json").read_text())
    t = summary["totals"]
    assert (t["records"], t["ok"], t["failed"]) == (len(LINES), len(SERVED), len(ERRORS)) and summary["missing"] == 0
    got = keyed(out)
    usage = sum(got[k]["response"]["body"]["usage"]["completion_tokens"]
                for k in ("chat-1", "cmpl-1", "stop-1", "lp-chat", "n-1", "lb-1"))
    own = len(got["own-1"]["token_ids"]) + sum(len(o["token_ids"]) for o in got["own-n"]["outputs"])
    assert t["new_tokens"] == usage + own and sum(t["finish_reasons"].values()) == len(SERVED) + 1 + 2  # a sample each
    batches = [e for e in read_log(out.with_suffix(".metrics.jsonl")) if e["event"] == "batch"]
    assert sum(e["records"] for e in batches) == len(SERVED)


def test_rerun_answers_nothing_twice(job):
    argv, out = job
    before = out.read_bytes()
    assert cli.main(argv) == 0  # finished: nothing to do
    assert out.read_bytes() == before
    # Killed mid-write: the last answer torn in half, the chat answer not written yet.
    lines = before.splitlines(keepends=True)
    chat = next(i for i, x in enumerate(lines) if b'"chat-1"' in x)
    kept = b"".join(x for i, x in enumerate(lines) if i != chat)
    out.write_bytes(kept + lines[chat][: len(lines[chat]) // 2])
    assert cli.main(argv) == 0
    assert out.read_bytes().startswith(kept)
    got = keyed(out)
    assert set(got) == {*SERVED, *ERRORS}
    old = json.loads(lines[chat])["response"]["body"]
    assert got["chat-1"]["response"]["body"]["choices"] == old["choices"]
    summary = json.loads(out.with_suffix(".summary.json").read_text())
    assert summary["this_run"]["records"] == 1 and summary["skipped_existing"] == len(LINES) - 1
