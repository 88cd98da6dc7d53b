"""Time to result: a job compiles a handful of graphs, all up front; a second run reads them back
from the persistent compilation cache; a HF folder loads straight onto the devices."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from tiny_models import request

import jaxspec
from jaxspec import compile_cache
from jaxspec.batch import JobSettings, run_job
from jaxspec.bench.humaneval import load_prompts
from jaxspec.bench.workloads import write_humaneval_jsonl
from jaxspec.defaults import CHECKPOINTS, REPO_ROOT
from jaxspec.jobs.local import plan_chunks
from jaxspec.jobs.records import prepare, read_input
from jaxspec.serving.batching import batch_shapes, bucket, cache_capacity
from jaxspec.serving.runner import run
from jaxspec.xla_flags import with_defaults

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def test_a_job_compiles_one_loop_and_one_admit_per_prompt_bucket(tmp_path):
    """Continuous slots: begin, the loop, the gather of finished rows, and one prefill-and-insert
    per prompt bucket, whatever the budgets and however many rows free up at once."""
    target = jaxspec.load(CHECKPOINTS / "hf" / "code-target-16m", dtype="float32")
    src = write_humaneval_jsonl(tmp_path / "in.jsonl", limit=24, lognormal=dict(median=10, cap=40))
    summary = run_job(src, tmp_path / "out.jsonl", target, settings=JobSettings(
        batch_size=4, refill_at=2, plot_path=None, metrics_log=None, progress=False))
    records = [json.loads(line) for line in src.read_text().splitlines()]
    buckets = {bucket(len(target.tokenizer.encode(r["prompt"]))) for r in records}
    assert len(buckets) >= 2 and len({r["max_new_tokens"] for r in records}) > 5
    assert summary["this_run"]["graph_cache"]["misses"] == 3 + len(buckets)


def test_a_static_job_compiles_each_shape_once_and_up_front(tmp_path):
    target = jaxspec.load(CHECKPOINTS / "hf" / "code-target-16m", dtype="float32")
    src = write_humaneval_jsonl(tmp_path / "in.jsonl", limit=24, lognormal=dict(median=10, cap=40))
    summary = run_job(src, tmp_path / "out.jsonl", target, settings=JobSettings(
        batch_size=4, scheduler="static", plot_path=None, metrics_log=None, progress=False))
    records = [prepare(r, target, JobSettings().sampling) for r in read_input(src)]
    chunks = plan_chunks(records, 4)
    shapes = set(batch_shapes([[r.request for r in c] for c in chunks], slack=0))
    g = summary["this_run"]["graph_cache"]
    assert g["misses"] == len(shapes) < len(chunks) == summary["this_run"]["batches"]
    assert g["hits"] == 0  # compiled up front, each handed to its batches: no graph looked up twice


def test_precompile_runs_in_threads_and_hands_back_the_executables():
    graphs = jaxspec.GraphCache(max_graphs=3)
    f = jax.jit(lambda x, *, n: x * n, static_argnames="n")
    calls = [(f, {"n": n}, (np.ones(k, np.float32),)) for n, k in ((2, 3), (3, 3), (2, 5), (2, 3))]
    spent, exes = graphs.precompile(calls)
    assert spent > 0 and graphs.misses == 3 and exes[0] is exes[3]
    np.testing.assert_array_equal(exes[1](np.ones(3, np.float32)), 3.0)
    again, exes2 = graphs.precompile(calls[:1])
    assert again == 0.0 and exes2 == [exes[0]] and graphs.hits == 1


def _job(tmp_path, cache_dir, name):
    env = {**os.environ, compile_cache.ENV: str(cache_dir), "PYTHONPATH": str(REPO_ROOT)}
    out = tmp_path / f"{name}.jsonl"
    subprocess.run([sys.executable, "-m", "jaxspec.cli", "batch", str(tmp_path / "in.jsonl"), str(out), "--no-draft",
                    "--batch-size", "4", "--max-new-tokens", "8", "--no-progress", "--no-plot", "--no-metrics-log"],
                   check=True, env=env, capture_output=True, text=True, timeout=600)
    return json.loads(out.with_suffix(".summary.json").read_text())["this_run"]


def test_a_second_run_reads_every_graph_back_from_the_compile_cache(tmp_path):
    write_humaneval_jsonl(tmp_path / "in.jsonl", limit=6)
    cache_dir = tmp_path / "xla"
    first = _job(tmp_path, cache_dir, "first")
    assert first["graph_cache"]["misses"] >= 4 and first["graph_cache"]["disk_hits"] == 0
    assert any(p.name.endswith("-cache") for p in cache_dir.iterdir())
    second = _job(tmp_path, cache_dir, "second")
    assert second["graph_cache"]["misses"] == first["graph_cache"]["misses"]
    assert second["graph_cache"]["disk_hits"] == second["graph_cache"]["misses"]  # none compiled again
    assert (tmp_path / "second.jsonl").read_text() == (tmp_path / "first.jsonl").read_text()


def test_the_cache_folder_follows_the_flag_then_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(compile_cache.ENV, "off")
    assert compile_cache.resolve() is None and compile_cache.resolve(tmp_path) == tmp_path
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "env"))
    assert compile_cache.resolve() == tmp_path / "env"
    monkeypatch.delenv(compile_cache.ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home"))
    assert compile_cache.resolve() == tmp_path / "home" / "jaxspec" / "xla"


def test_accelerators_pad_every_batch_of_a_call_to_one_row_count_budget_and_capacity(monkeypatch):
    req = lambda n, budget: request((1,) * n, budget)  # noqa: E731
    groups = [[req(5, 10)] * 3, [req(40, 30)], [req(20, 60)] * 9]
    own = [(4, 16, 16), (1, 64, 32), (16, 32, 64)]  # the CPU: each its own
    assert batch_shapes(groups, slack=4) == [(r, p, m, cache_capacity(p, m, 4)) for r, p, m in own]
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    widest = cache_capacity(64, 64, 4)
    assert widest > cache_capacity(32, 64, 4)
    assert batch_shapes(groups, slack=4) == [(16, 16, 64, widest), (16, 64, 64, widest), (16, 32, 64, widest)]


def prompt_bucket_pair(tokenizer) -> list:
    """Four requests, two batches of two, alike in rows, budget and cache capacity (with and
    without a chain of 3's slack) and unlike in prompt bucket (16, 32)."""
    prompts = [tokenizer.encode(p)[:n] for p, n in zip(load_prompts(limit=4), (10, 12, 20, 24))]
    requests = [request(p, 40) for p in prompts]
    for slack in (0, 4):
        shapes = batch_shapes([requests[:2], requests[2:]], slack)
        assert [s[1] for s in shapes] == [16, 32] and shapes[0][2:] == shapes[1][2:]
    return requests


def test_batches_that_differ_only_in_their_prompt_bucket_share_one_loop_graph(real_pair, monkeypatch):
    """The accelerators' static path (run here on the CPU), where a call pads rows, budget and
    capacity alike: one prefill per prompt bucket and one loop, and each row's tokens are its own
    plain decoding's."""
    target, _ = real_pair
    requests = prompt_bucket_pair(target.tokenizer)
    graphs = jaxspec.GraphCache()
    with monkeypatch.context() as m:
        m.setattr(jax, "default_backend", lambda: "gpu")
        got = run(target, requests, 2, graphs=graphs, scheduler="static", groups=[[0, 1], [2, 3]])
    assert got.metrics.graphs_compiled == 3 and graphs.hits == 0
    alone = jaxspec.generate([list(r.token_ids) for r in requests], target, max_new_tokens=40, max_batch_size=1)
    assert [c.token_ids for c in got] == [c.token_ids for c in alone]


def test_importing_jaxspec_sets_the_gpu_autotune_level_unless_the_user_chose_one():
    assert with_defaults("") == "--xla_gpu_autotune_level=1"
    assert with_defaults("--xla_dump_to=/x") == "--xla_dump_to=/x --xla_gpu_autotune_level=1"
    assert with_defaults("--xla_gpu_autotune_level=4") == "--xla_gpu_autotune_level=4"
    assert "--xla_gpu_autotune_level=1" in os.environ["XLA_FLAGS"]  # and XLA on the CPU accepts it
