#!/usr/bin/env python3
"""Reuse across a job's records, measured as a user runs `jaxspec batch`: each setting a fresh
process, timed whole (imports, loading, compiling from a warm compilation cache, decoding), the
settings alternating, median of --repeats. Prints each run and a table; everything printed is
measured in this run on this machine.

    python scripts/bench_job_reuse.py --job fewshot    # shared prefixes on and off, plain decoding
    python scripts/bench_job_reuse.py --job neardup    # suffix drafting against in-row n-gram lookup
    python scripts/bench_job_reuse.py --job unrelated  # the same, on records with nothing in common
    python scripts/bench_job_reuse.py --job lognormal  # adaptive K against plain and a fixed K = 3

fewshot: one preamble of about 900 tokens before each of 48 distinct questions
(jaxspec.bench.workloads.write_fewshot_jsonl), batch 16, 24 new tokens each.
neardup: the first 64 HumanEval stubs, each twice, renamed (write_near_duplicate_jsonl), in a
fixed random order; unrelated: the first 128 HumanEval stubs as they are; both at batch 16, 64 new
tokens each, K = 3, greedy, the embedded target.
lognormal: the 128 first HumanEval stubs with lognormal budgets (median 200, at most 1024;
write_humaneval_jsonl), batch 16, continuous, greedy: plain decoding, the embedded draft model at
K = 3, and --adaptive-k (K from 0, 1, 3; its timed rounds are part of its run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# job -> (the flags every run of it takes, {setting: its own flags}); the first setting is the baseline.
JOBS = {
    "fewshot": (["--no-draft", "--batch-size", "16", "--max-new-tokens", "24"],
                {"shared prefixes": [], "--no-prefix-cache": ["--no-prefix-cache"]}),
    "neardup": (["--batch-size", "16", "--max-new-tokens", "64"],
                {"ngram": ["--draft", "ngram"], "suffix": ["--draft", "suffix"]}),
}
JOBS["unrelated"] = JOBS["neardup"]
JOBS["lognormal"] = (["--batch-size", "16"], {"plain": ["--no-draft"], "K=3": [], "adaptive K": ["--adaptive-k"]})


def write_job(job: str, path: Path) -> None:
    from jaxspec.bench import workloads

    if job == "fewshot":
        from transformers import AutoTokenizer

        from jaxspec.defaults import CHECKPOINTS

        workloads.write_fewshot_jsonl(path, AutoTokenizer.from_pretrained(CHECKPOINTS / "hf" / "code-target-16m"))
    elif job == "neardup":
        workloads.write_near_duplicate_jsonl(path)
    elif job == "lognormal":
        workloads.write_humaneval_jsonl(path, limit=128, lognormal=True)
    else:
        workloads.write_humaneval_jsonl(path, limit=128)


def run_job(src: Path, out: Path, flags: list[str], cache: Path, env: dict) -> dict:
    for stale in out.parent.glob(f"{out.stem}.*"):
        stale.unlink()
    cmd = [sys.executable, "-m", "jaxspec.cli", "batch", str(src), str(out), "--no-progress", "--no-plot",
           "--compile-cache", str(cache), *flags]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    process_s = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    summary = json.loads(out.with_suffix(".summary.json").read_text())
    t, run = summary["totals"], summary["this_run"]
    tokens = {r["id"]: r["token_ids"] for r in map(json.loads, out.read_text().splitlines())}
    return {"process_s": process_s, "compile_s": run["compile_s"], "decode_s": run["decode_s"],
            "prompt_tokens": t["prompt_tokens"], "prefill_tokens": t["prefill_tokens"],
            "cached_tokens": t["cached_tokens"], "tokens_per_step": t["tokens_per_step"], "tokens": tokens}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--job", choices=sorted(JOBS), default="fewshot")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", help="keep the jobs here (default: a temporary folder)")
    args = p.parse_args()
    work = Path(args.out or tempfile.mkdtemp(prefix="reuse-"))
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    src = work / f"{args.job}.jsonl"
    if not src.exists():
        write_job(args.job, src)
    common, settings = JOBS[args.job]
    runs: dict[str, list[dict]] = {name: [] for name in settings}
    for attempt in range(args.repeats + 1):  # the first pass fills each setting's compilation cache
        for i, (name, flags) in enumerate(settings.items()):
            got = run_job(src, work / f"{args.job}{i}.jsonl", [*common, *flags], work / f"xla{i}", env)
            print(json.dumps({"setting": name, "pass": attempt, **{k: v for k, v in got.items() if k != "tokens"}}),
                  flush=True)
            if attempt:
                runs[name].append(got)
    first = next(iter(runs.values()))[0]["tokens"]
    same = all(r["tokens"] == first for rs in runs.values() for r in rs)
    base = statistics.median(r["process_s"] for r in runs[next(iter(runs))])
    print(f"\n{args.job}: {len(first)} records, jaxspec batch {' '.join(common)}; median of {args.repeats} whole "
          f"processes (warm compilation cache), alternating; outputs identical: {same}")
    print("| setting | process s | compile s | decode s | tokens / target step | prefill tokens | reused tokens | time |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in ("process_s", "compile_s", "decode_s")}
        print(f"| {name} | {med['process_s']:.1f} | {med['compile_s']:.1f} | {med['decode_s']:.1f} | "
              f"{rs[0]['tokens_per_step']:.2f} | {rs[0]['prefill_tokens']} of {rs[0]['prompt_tokens']} | "
              f"{rs[0]['cached_tokens']} | {med['process_s'] / base:.2f}x |")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
