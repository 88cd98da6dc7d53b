"""Batch jobs over Ray replicas (a local instance, two CPU workers): the same output as one
worker, and a worker killed with SIGKILL mid-job loses and repeats nothing."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxspec.batch import JobSettings, read_output, run_job
from jaxspec.bench.workloads import write_humaneval_jsonl

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict:
    """The jobs' environment: this repository importable, and one compile cache for the module's
    jobs (each Ray replica is a fresh process: a replacement or a rerun reads its graphs back
    instead of compiling them again on this 2-core machine)."""
    cache = tmp_path_factory.mktemp("xla-cache")
    return {**os.environ, "PYTHONPATH": str(REPO), "JAXSPEC_COMPILE_CACHE": str(cache)}


def test_two_workers_give_what_one_gives(tmp_path, real_pair, env):
    """The Ray job runs in its own process (the CLI), so no Ray instance lives in the test worker."""
    target = real_pair[0]
    src = write_humaneval_jsonl(tmp_path / "in.jsonl", limit=20, lognormal=dict(median=16, cap=40))
    with open(src, "a") as f:
        f.write('{"id": "bad", "prompt": "x", "top_p": 2}\n')
    one = run_job(src, tmp_path / "one.jsonl", target, settings=JobSettings(
        max_new_tokens=8, batch_size=4, plot_path=None, progress=False))
    done = subprocess.run(_cmd(src, tmp_path / "two.jsonl", "8", "4"), env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    a = {r["id"]: r for r in read_output(tmp_path / "one.jsonl")}
    b = {r["id"]: r for r in read_output(tmp_path / "two.jsonl")}
    assert sorted(a) == sorted(b) and len(b) == 21 and "top_p must be in" in b["bad"]["error"]
    assert all(a[k].get("token_ids") == b[k].get("token_ids") and a[k].get("stats") == b[k].get("stats") for k in a)
    workers = json.loads((tmp_path / "two.summary.json").read_text())["this_run"]["workers"]
    assert one["this_run"]["workers"] == {} and sum(w["records"] for w in workers.values()) == 20
    assert all(w["decode_tokens_per_s"] > 0 for w in workers.values())


def _cmd(src, out, max_new: str, batch: str) -> list[str]:
    return [sys.executable, "-m", "jaxspec.cli", "batch", str(src), str(out), "--no-draft", "--max-new-tokens", max_new,
            "--batch-size", batch, "--workers", "2", "--no-progress", "--no-plot"]


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def _replica_pids(driver: int) -> list[int]:
    """The replica processes of the Ray instance that `driver` started (its raylet's children):
    never another job's."""
    out = subprocess.run(["pgrep", "-f", "ray::Replica"], capture_output=True, text=True).stdout
    mine = []
    for pid in map(int, out.split()):
        up = pid
        for _ in range(4):
            up = _parent(up)
            if up == driver:
                mine.append(pid)
                break
    return mine


def _job(tmp_path, n: int) -> tuple[list[dict], Path, Path]:
    """(records, input, output) of an n-record job of short code prompts."""
    records = [{"id": f"k{i}", "prompt": f"# task {i}\ndef f{i}(x):\n"} for i in range(n)]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    return records, src, tmp_path / "out.jsonl"


def test_a_worker_killed_mid_job_loses_and_repeats_nothing(tmp_path, env):
    records, src, out = _job(tmp_path, 48)
    proc = subprocess.Popen(_cmd(src, out, "48", "2"), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    killed = None
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None and killed is None:
            pids = _replica_pids(proc.pid)
            if len(pids) >= 2 and out.exists() and out.read_bytes().count(b"\n") >= 1:
                killed = pids[0]
                os.kill(killed, signal.SIGKILL)  # a replica of this job's own Ray instance
            time.sleep(0.05)
        assert killed is not None, "the job ended before a worker could be killed"
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    ids = [r["id"] for r in read_output(out)]
    assert sorted(ids) == sorted(r["id"] for r in records)  # every id, exactly once
    assert "48 ok" in stdout


def _descendants(pid: int) -> list[int]:
    """Every live process below `pid` (the Ray instance its job started), from /proc."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            parents[int(entry.name)] = _parent(int(entry.name))
    found, frontier = [], [pid]
    while frontier:
        kids = [p for p, up in parents.items() if up in frontier]
        found += kids
        frontier = kids
    return found


def test_a_killed_driver_is_resumed_by_rerunning(tmp_path, env):
    records, src, out = _job(tmp_path, 32)
    proc = subprocess.Popen(_cmd(src, out, "48", "2"), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    left: list[int] = []
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            if out.exists() and out.read_bytes().count(b"\n") >= 1:
                left = _descendants(proc.pid)  # its Ray instance: ended below, as the driver's death leaves it
                proc.kill()
                break
            time.sleep(0.05)
        assert left, "the job ended before its driver could be killed"
        proc.wait(timeout=30)
    finally:
        proc.kill()
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    before = out.read_text()
    done = subprocess.run(_cmd(src, out, "48", "2"), env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    after = out.read_text()
    kept = before[: before.rfind("\n") + 1]  # complete lines written before the kill stay as they were
    assert after.startswith(kept) and 1 <= kept.count("\n") < len(records)
    ids = [r["id"] for r in read_output(out)]
    assert sorted(ids) == sorted(r["id"] for r in records)  # every id, exactly once
