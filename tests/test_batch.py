"""Batch jobs: right output lines and errors, resume after a crash (a real SIGKILL), no id twice."""

import copy
import dataclasses
import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import jaxspec
from jaxspec import cli
from jaxspec.bench.humaneval import load_prompts
from jaxspec.defaults import CHECKPOINTS, REPO_ROOT
from jaxspec.errors import InputError
from jaxspec.batch import BatchError, JobSettings, read_output, run_job
from jaxspec.jobs.local import plan_chunks
from jaxspec.jobs.durable import repair_tail
from jaxspec.jobs.output import ChunkWriter
from jaxspec.jobs.records import Record, build_request, parse_line
from jaxspec.jobs.metrics_log import read_log

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
TARGET = CHECKPOINTS / "hf" / "code-target-16m"
MAX_NEW = 8


@pytest.fixture(scope="module")
def target():
    return jaxspec.load(TARGET, dtype="float32")


@pytest.fixture(scope="module")
def prompts():
    # Short code prompts (the first 80 characters of HumanEval stubs): two length buckets.
    return [p[:80] for p in load_prompts(limit=30)]


def write_lines(path: Path, lines) -> Path:
    with open(path, "wb") as f:
        for line in lines:
            f.write(line if isinstance(line, bytes) else (json.dumps(line) if isinstance(line, dict) else line).encode())
            f.write(b"\n")
    return path


def by_id(path: Path) -> dict:
    records = read_output(path)
    ids = [str(r["id"]) for r in records]
    assert len(ids) == len(set(ids)), "an id was written twice"
    return {str(r["id"]): r for r in records}


# The bad records of the mixed job: (input line, expected id, a phrase its error must contain).
BAD = [
    ('{"id": "broken", "prompt": ', "line:{n}", "not valid JSON"),
    ("[1, 2, 3]", "line:{n}", "not an object"),
    (b'{"id": "latin1", "prompt": "caf\xe9"}', "line:{n}", "not valid UTF-8"),
    ({"prompt": "def f(x):"}, "line:{n}", "id is missing"),
    ({"id": [1], "prompt": "def f(x):"}, "line:{n}", "id must be a non-empty string or an integer"),
    ({"id": "no-prompt"}, "no-prompt", "prompt is missing"),
    ({"id": "empty", "prompt": ""}, "empty", "prompt is empty"),
    ({"id": "too-long", "prompt": "x " * 3000}, "too-long", "longer than the model's context of 2048"),
    ({"id": "budget", "prompt": "def f(x):", "max_new_tokens": 2045}, "budget", "exceeds the model's context"),
    ({"id": "top-p", "prompt": "def f(x):", "top_p": 1.5}, "top-p", "top_p must be in (0, 1]"),
    ({"id": "temp", "prompt": "def f(x):", "temperature": -1}, "temp", "temperature must be a finite number >= 0"),
    ({"id": "max-new", "prompt": "def f(x):", "max_new_tokens": 0}, "max-new", "max_new_tokens must be an integer >= 1"),
    ({"id": "seed", "prompt": "def f(x):", "seed": -3}, "seed", "seed must be an integer in [0, 2**32)"),
    ({"id": "vocab", "prompt": [5, 99999]}, "vocab", "outside the vocabulary [0, 8192)"),
    ({"id": "chat", "messages": [{"role": "user", "content": "hi"}]}, "chat", "has none; give a \"prompt\""),
    ({"id": "both", "prompt": "a", "messages": []}, "both", 'either "prompt" or "messages"'),
    ({"id": "version", "prompt": "a", "prompt_version": 3}, "version", "prompt_version must be a string"),
]


def good_id(i: int) -> str:
    return "1234" if i == 3 else f"ok-{i}"


@pytest.fixture(scope="module")
def mixed_job(tmp_path_factory, target, prompts):
    """30 good records (three with their own settings, two prompt versions), 17 bad ones and a
    blank line, run plainly in batches of 4."""
    tmp = tmp_path_factory.mktemp("mixed")
    good = [{"id": f"ok-{i}", "prompt": p, "prompt_version": "v1" if i % 3 else "v2"} for i, p in enumerate(prompts)]
    good[1]["max_new_tokens"] = 3
    good[2].update(temperature=0.9, top_k=40, top_p=0.95, seed=7)
    good[3]["id"] = 1234  # integer ids are allowed
    lines, bad, bad_left = [], {}, iter(BAD)

    def add_bad(entry):
        lines.append(entry[0])
        bad[entry[1].format(n=len(lines))] = entry[2]

    for i, g in enumerate(good):
        lines.append(g)
        if i == 4:
            lines.append("")  # a blank line is skipped, not a record
        if i % 2 and (entry := next(bad_left, None)):
            add_bad(entry)
    for entry in bad_left:
        add_bad(entry)
    src = write_lines(tmp / "in.jsonl", lines)
    out = tmp / "out.jsonl"
    summary = run_job(src, out, target, settings=JobSettings(max_new_tokens=MAX_NEW, batch_size=4, progress=False))
    return src, out, summary, bad, lines


def test_job_writes_every_record_once_with_the_right_errors(mixed_job, target, prompts):
    src, out, summary, bad, lines = mixed_job
    assert len(bad) == len(BAD)
    got = by_id(out)
    assert set(got) == {good_id(i) for i in range(len(prompts))} | set(bad)
    for rid, phrase in bad.items():
        assert "error" in got[rid] and phrase in got[rid]["error"], (rid, got[rid])
        assert "text" not in got[rid] and "token_ids" not in got[rid]
    # Every good record with the job's settings equals generate() on the same prompt.
    ref = jaxspec.generate(prompts, target, max_new_tokens=MAX_NEW)
    for i in set(range(len(prompts))) - {1, 2}:
        rec = got[good_id(i)]
        assert rec["token_ids"] == ref[i].token_ids, i
        assert rec["text"] == ref[i].text and rec["finish_reason"] == ref[i].finish_reason
        assert rec["method"] == "plain" and rec["stats"]["new_tokens"] == len(rec["token_ids"])
        assert rec["prompt_version"] == ("v1" if i % 3 else "v2")
        assert lines[rec["line"] - 1]["prompt"] == prompts[i]


def test_per_record_settings_override_the_job_defaults(mixed_job, target, prompts):
    got = by_id(mixed_job[1])
    short = jaxspec.generate([prompts[1]], target, max_new_tokens=3)[0]
    assert got["ok-1"]["token_ids"] == short.token_ids and len(short.token_ids) <= 3
    sampled = jaxspec.generate([prompts[2]], target, max_new_tokens=MAX_NEW, temperature=0.9, top_k=40,
                               top_p=0.95, seed=7)[0]
    greedy = jaxspec.generate([prompts[2]], target, max_new_tokens=MAX_NEW)[0]
    assert got["ok-2"]["token_ids"] == sampled.token_ids != greedy.token_ids
    assert got["1234"]["id"] == 1234


def test_summary_plot_and_metrics_log(mixed_job):
    src, out, summary, bad, _ = mixed_job
    paths = JobSettings().paths(out)
    on_disk = json.loads(paths["summary"].read_text())
    assert on_disk == json.loads(json.dumps(summary))
    t = summary["totals"]
    assert (t["records"], t["ok"], t["failed"]) == (30 + len(BAD), 30, len(BAD))
    assert summary["missing"] == 0 and summary["skipped_existing"] == 0
    g = summary["this_run"]["graph_cache"]  # the target's compiled graphs: some compiled, then reused
    assert g["misses"] >= 1 and g["hits"] >= 1 and g["graphs"] <= g["max_graphs"]
    assert t["new_tokens"] == sum(r["stats"]["new_tokens"] for r in read_output(out) if "stats" in r)
    assert t["acceptance_rate"] is None and t["tokens_per_step"] == 1.0  # plain decoding
    assert summary["by_prompt_version"]["v2"]["ok"] == 10 and summary["by_prompt_version"]["v1"]["ok"] == 20
    assert summary["settings"]["method"] == "plain" and summary["settings"]["batch_size"] == 4
    run = summary["this_run"]
    assert run["records"] == t["records"] and run["tokens_per_s"] > 0 and run["records_per_s"] > 0
    png = paths["plot"].read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    events = read_log(paths["metrics_log"])
    batches = [e for e in events if e["event"] == "batch"]
    assert sum(e["records"] for e in batches) == 30 and events[-1]["event"] == "summary"
    for e in batches:
        assert e["model"] == "code-target-16m" and e["draft"] is None and e["method"] == "plain"
        assert e["num_draft_tokens"] == 0 and e["tokens_per_s"] > 0 and "prompt_version" in e


def test_chunks_never_span_shape_buckets(target, prompts):
    recs = [Record(i, str(i), i, {"prompt": p * (1 + i % 4)}) for i, p in enumerate(prompts)]
    for r in recs:
        r.request = build_request(r.data, target, JobSettings(max_new_tokens=MAX_NEW).sampling)
    chunks = plan_chunks(recs, 4)
    assert sorted(r.line for c in chunks for r in c) == list(range(len(prompts)))
    for c in chunks:
        assert 1 <= len(c) <= 4
        assert len({max(16, 1 << (len(r.request.token_ids) - 1).bit_length()) for r in c}) == 1
    for r in recs[:10]:  # records of n samples take n rows
        r.request = build_request({**r.data, "n": 3}, target, JobSettings(max_new_tokens=MAX_NEW).sampling)
    chunks = plan_chunks(recs, 4)
    assert sorted(r.line for c in chunks for r in c) == list(range(len(prompts)))
    assert all(sum(r.request.sampling.n for r in c) <= 4 for c in chunks)


def test_n_samples_in_a_static_job_equal_generates(tmp_path, target, prompts):
    src = write_lines(tmp_path / "in.jsonl", [{"id": i, "prompt": p, "n": 2 + i % 2, "temperature": 0.8, "seed": i}
                                              for i, p in enumerate(prompts[:3])])
    out = tmp_path / "out.jsonl"
    run_job(src, out, target, settings=JobSettings(max_new_tokens=MAX_NEW, batch_size=4, scheduler="static",
                                                   progress=False, plot_path=None, metrics_log=None))
    got = by_id(out)
    for i, p in enumerate(prompts[:3]):
        ref = jaxspec.generate([p], target, max_new_tokens=MAX_NEW, n=2 + i % 2, temperature=0.8, seed=i)
        assert [(o["index"], o["token_ids"], o["text"]) for o in got[str(i)]["outputs"]] == [
            (r.index, r.token_ids, r.text) for r in ref]


def test_chat_messages_are_rendered_with_the_template(tmp_path, target):
    tok = copy.deepcopy(target.tokenizer)
    tok.chat_template = (
        "{% for m in messages %}# {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}# assistant:\n{% endif %}"
    )
    chat = dataclasses.replace(target, tokenizer=tok)
    messages = [{"role": "user", "content": "write is_even"}]
    src = write_lines(tmp_path / "in.jsonl", [
        {"id": "c", "messages": messages}, {"id": "bad", "messages": [{"role": "user"}]},
    ])
    run_job(src, tmp_path / "out.jsonl", chat, settings=JobSettings(
        max_new_tokens=4, batch_size=2, progress=False, plot_path=None, metrics_log=None))
    got = by_id(tmp_path / "out.jsonl")
    ids = tok.encode("# user: write is_even\n# assistant:\n", add_special_tokens=False)
    assert got["c"]["token_ids"] == jaxspec.generate([ids], chat, max_new_tokens=4)[0].token_ids
    assert 'messages[0] must be an object with string "role" and "content"' in got["bad"]["error"]


def test_duplicate_ids_are_refused_before_any_work(tmp_path, target, capsys):
    src = write_lines(tmp_path / "in.jsonl", [
        {"id": "a", "prompt": "x"}, {"id": "b", "prompt": "x"}, {"id": "a", "prompt": "y"},
        {"id": 7, "prompt": "x"}, {"id": "7", "prompt": "x"}, "{not json",
    ])
    out = tmp_path / "out.jsonl"
    with pytest.raises(BatchError) as e:
        run_job(src, out, target, settings=JobSettings(progress=False))
    assert "2 duplicate id(s)" in str(e.value)
    assert "'a' on lines 1, 3" in str(e.value) and "'7' on lines 4, 5" in str(e.value)
    assert not out.exists()
    # The CLI says the same and exits non-zero, before loading any model.
    assert cli.main(["batch", str(src), str(out), "--target", str(tmp_path / "nonexistent")]) == 2
    assert "'a' on lines 1, 3" in capsys.readouterr().err
    assert not out.exists()


def test_bad_job_settings_raise_input_errors(tmp_path, target):
    src = write_lines(tmp_path / "in.jsonl", [{"id": "a", "prompt": "x"}])
    out = tmp_path / "out.jsonl"
    with pytest.raises(InputError, match="top_p must be in"):
        run_job(src, out, target, settings=JobSettings(top_p=0, progress=False))
    with pytest.raises(InputError, match="batch_size must be an integer >= 1"):
        run_job(src, out, target, settings=JobSettings(batch_size=0, progress=False))
    with pytest.raises(InputError, match="auto needs a draft"):
        run_job(src, out, target, settings=JobSettings(auto=True, progress=False))
    with pytest.raises(InputError, match="does not exist"):
        run_job(tmp_path / "missing.jsonl", out, target, settings=JobSettings(progress=False))
    assert not out.exists()


def test_parse_line_ids():
    assert parse_line(b'{"id": 3, "prompt": "x"}', 9).key == "3"
    assert parse_line(b'{"id": "", "prompt": "x"}', 9).key == "line:9"
    assert parse_line(b'{"id": true, "prompt": "x"}', 2).error.startswith("id must be")
    assert parse_line(b"nope", 4).id == "line:4"


def test_repair_tail(tmp_path):
    p = tmp_path / "o.jsonl"
    p.write_bytes(b'{"id": 1}\n{"id": 2}\n{"id": 3, "te')
    assert repair_tail(p) == len(b'{"id": 3, "te') and p.read_bytes() == b'{"id": 1}\n{"id": 2}\n'
    assert repair_tail(p) == 0 and p.read_bytes() == b'{"id": 1}\n{"id": 2}\n'
    p.write_bytes(b'{"id": 1, "text": "' + b"x" * 200_000)  # a torn first line longer than a block
    assert repair_tail(p) == 200_000 + 19 and p.read_bytes() == b""


def test_resume_after_a_torn_write_loses_and_repeats_nothing(tmp_path, target, prompts):
    src = write_lines(tmp_path / "in.jsonl", [{"id": f"r{i}", "prompt": p} for i, p in enumerate(prompts[:10])])
    full = tmp_path / "full.jsonl"
    run_job(src, full, target, settings=JobSettings(
        max_new_tokens=MAX_NEW, batch_size=4, progress=False, plot_path=None))
    done = full.read_bytes().split(b"\n")[:4]
    out = tmp_path / "out.jsonl"
    kept = b"\n".join(done[:3]) + b"\n"
    out.write_bytes(kept + done[3][: len(done[3]) // 2])  # killed in the middle of a line
    summary = run_job(src, out, target, settings=JobSettings(
        max_new_tokens=MAX_NEW, batch_size=4, progress=False, plot_path=None))
    assert out.read_bytes().startswith(kept)
    got, ref = by_id(out), by_id(full)
    assert set(got) == set(ref) and summary["skipped_existing"] == 3 and summary["missing"] == 0
    assert summary["this_run"]["records"] == 7 and summary["totals"]["ok"] == 10
    assert all(got[i]["token_ids"] == ref[i]["token_ids"] for i in ref)
    # A finished job run again does nothing and changes nothing.
    before = out.read_bytes()
    again = run_job(src, out, target, settings=JobSettings(
        max_new_tokens=MAX_NEW, batch_size=4, progress=False, plot_path=None))
    assert out.read_bytes() == before and again["this_run"]["records"] == 0 and again["totals"]["ok"] == 10


class FullDisk:
    """`os` for jaxspec.jobs.durable on a disk that fills up during its `fills_at`-th write: half
    of that write lands, then every write fails with ENOSPC."""

    def __init__(self, fills_at: int):
        self.calls, self.fills_at = 0, fills_at

    def __getattr__(self, name):
        return getattr(os, name)

    def write(self, fd, data):
        self.calls += 1
        if self.calls < self.fills_at:
            return os.write(fd, data)
        if self.calls == self.fills_at:
            return os.write(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_stops_the_job_with_whole_lines_and_a_rerun_completes(tmp_path, target, prompts, monkeypatch):
    src = write_lines(tmp_path / "in.jsonl", [{"id": f"r{i}", "prompt": p} for i, p in enumerate(prompts[:10])])
    out, log = tmp_path / "out.jsonl", tmp_path / "out.metrics.jsonl"
    settings = JobSettings(max_new_tokens=MAX_NEW, batch_size=4, progress=False, plot_path=None, metrics_log=log)
    # Writes go: chunk 1's lines, its metrics line, chunk 2's lines (the disk fills in them), ...
    monkeypatch.setattr("jaxspec.jobs.durable.os", FullDisk(fills_at=3))
    with pytest.raises(BatchError) as stop:
        run_job(src, out, target, settings=settings)
    assert str(stop.value) == (f"cannot write {out} ({os.strerror(errno.ENOSPC)}): the job stopped with 4 of 10 "
                               f"records saved whole in {out}; free some space and run the same command again to resume")
    assert len(by_id(out)) == 4 and out.read_bytes().endswith(b"\n") and len(read_log(log)) == 1
    # Resumed, the disk fills in the metrics line after its first chunk: those records are kept.
    monkeypatch.setattr("jaxspec.jobs.durable.os", FullDisk(fills_at=2))
    with pytest.raises(BatchError, match=f"cannot write {log} .*8 of 10 records saved whole"):
        run_job(src, out, target, settings=settings)
    assert len(by_id(out)) == 8 and len(read_log(log)) == 1
    with open(log, "ab") as f:
        f.write(b'{"event": "batch", "reco')  # and a kill tore the log's last line
    monkeypatch.undo()
    summary = run_job(src, out, target, settings=settings)
    ref = run_job(src, tmp_path / "ref.jsonl", target, settings=JobSettings(
        max_new_tokens=MAX_NEW, batch_size=4, progress=False, plot_path=None, metrics_log=None))
    assert summary["totals"]["ok"] == 10 and summary["missing"] == 0
    assert {i: r["token_ids"] for i, r in by_id(out).items()} == {i: r["token_ids"] for i, r in by_id(tmp_path / "ref.jsonl").items()}
    assert ref["totals"]["ok"] == 10 and [e["event"] for e in read_log(log)] == ["batch", "batch", "summary"]


def test_refuses_to_append_to_a_file_it_did_not_write(tmp_path, target):
    src = write_lines(tmp_path / "in.jsonl", [{"id": "a", "prompt": "x"}])
    out = tmp_path / "out.jsonl"
    out.write_bytes(b"name,score\nalice,3\n")
    with pytest.raises(BatchError, match="line 1 is not a batch output record"):
        run_job(src, out, target, settings=JobSettings(progress=False))
    assert out.read_bytes() == b"name,score\nalice,3\n"


def test_two_jobs_never_write_one_output(tmp_path, target):
    src = write_lines(tmp_path / "in.jsonl", [{"id": "a", "prompt": "x"}])
    out = tmp_path / "out.jsonl"
    holder = ChunkWriter(out)  # another job, still running
    try:
        with pytest.raises(BatchError, match="another job is writing"):
            run_job(src, out, target, settings=JobSettings(progress=False))
    finally:
        holder.close()
    assert out.read_bytes() == b""


def test_help_explains_every_batch_option():
    parser = cli.build_parser()
    batch = next(a for a in parser._subparsers._group_actions[0].choices.items() if a[0] == "batch")[1]
    for action in batch._actions:
        assert action.help and len(action.help) > 8, action.dest


def _job_cmd(src: Path, out: Path) -> list[str]:
    return [
        sys.executable, "-m", "jaxspec.cli", "batch", str(src), str(out), "--target", str(TARGET),
        "--no-draft", "--max-new-tokens", "16", "--batch-size", "2", "--no-progress", "--no-plot",
    ]


def test_sigkill_mid_job_then_rerun_completes_with_no_duplicate(tmp_path, prompts):
    """A real kill -9 while the CLI is writing; the same command run again finishes the job."""
    records = [{"id": f"k{i}", "prompt": f"# task {i}\n" + prompts[i % len(prompts)]} for i in range(90)]
    src = write_lines(tmp_path / "in.jsonl", records)
    out = tmp_path / "out.jsonl"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen(_job_cmd(src, out), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if out.exists() and out.read_bytes().count(b"\n") >= 6:
                break
            time.sleep(0.02)
        assert proc.poll() is None, f"job ended before it could be killed: {proc.stderr.read().decode()[-2000:]}"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    partial = out.read_bytes()
    complete = partial[: partial.rfind(b"\n") + 1]
    first = [json.loads(x) for x in complete.splitlines()]
    assert 6 <= len(first) < len(records)
    assert len({r["id"] for r in first}) == len(first)

    done = subprocess.run(_job_cmd(src, out), env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    final = out.read_bytes()
    assert final.startswith(complete)  # lines written before the kill are untouched
    got = by_id(out)
    assert sorted(got) == sorted(r["id"] for r in records)
    assert all("token_ids" in r and r["finish_reason"] in ("stop", "length") for r in got.values())
    assert f"{len(first)} already in the output were skipped" in done.stdout
