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

from jaxspec.batch import read_output, run_job, write_humaneval_jsonl

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
REPO = Path(__file__).resolve().parents[1]


def test_two_workers_give_what_one_gives(tmp_path, real_pair):
    target = real_pair[0]
    src = write_humaneval_jsonl(tmp_path / "in.jsonl", limit=20, lognormal=dict(median=16, cap=40))
    with open(src, "a") as f:
        f.write('{"id": "bad", "prompt": "x", "top_p": 2}\n')
    one = run_job(src, tmp_path / "one.jsonl", target, max_new_tokens=8, batch_size=4, plot_path=None, progress=False)
    two = run_job(src, tmp_path / "two.jsonl", target, max_new_tokens=8, batch_size=4, workers=2, plot_path=None,
                  progress=False)
    a = {r["id"]: r for r in read_output(tmp_path / "one.jsonl")}
    b = {r["id"]: r for r in read_output(tmp_path / "two.jsonl")}
    assert sorted(a) == sorted(b) and len(b) == 21 and "top_p must be in" in b["bad"]["error"]
    assert all(a[k].get("token_ids") == b[k].get("token_ids") and a[k].get("stats") == b[k].get("stats") for k in a)
    workers = two["this_run"]["workers"]
    assert one["this_run"]["workers"] == {} and sum(w["records"] for w in workers.values()) == 20
    assert all(int(pid) != os.getpid() for pid in workers)  # served in the replicas' own processes


def _replica_pids() -> list[int]:
    out = subprocess.run(["pgrep", "-f", "ray::Replica"], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_a_worker_killed_mid_job_loses_and_repeats_nothing(tmp_path):
    records = [{"id": f"k{i}", "prompt": f"# task {i}\ndef f{i}(x):\n"} for i in range(48)]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "jaxspec.cli", "batch", str(src), str(out), "--no-draft", "--max-new-tokens", "48",
           "--batch-size", "2", "--workers", "2", "--no-progress", "--no-plot"]
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    killed = None
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None and killed is None:
            pids = _replica_pids()
            if len(pids) >= 2 and out.exists() and out.read_bytes().count(b"\n") >= 1:
                killed = pids[0]
                os.kill(killed, signal.SIGKILL)  # a replica process of this job's own Ray instance
            time.sleep(0.05)
        assert killed is not None, "the job ended before a worker could be killed"
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    ids = [r["id"] for r in read_output(out)]
    assert sorted(ids) == sorted(r["id"] for r in records)  # every id, exactly once
    assert "48 ok" in stdout
