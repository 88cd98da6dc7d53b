#!/usr/bin/env python3
"""Time to result: a batch job's process wall clock split into imports, loading, compiling and
decoding, cold (an empty compilation cache) and warm (the same cache again), each a fresh
process, as a user runs `jaxspec batch`.

    python scripts/time_to_result.py --records 164 --batch-size 16 --scheduler static continuous \
        --methods plain K=3 [--dtype bfloat16] [--out runs/ttr]

The job is the repository's HumanEval prompts with lognormal budgets (jaxspec.bench.workloads)
on the embedded pair. Everything printed is measured in this run on this machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def timed_process(cmd: list[str], env: dict) -> float:
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    return time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", type=int, default=164)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--scheduler", nargs="+", default=["static", "continuous"])
    p.add_argument("--methods", nargs="+", default=["plain", "K=3"], help="plain and/or K=N (the embedded draft)")
    p.add_argument("--dtype", help="jaxspec compute dtype (default: the backend's)")
    p.add_argument("--out", help="keep the jobs' outputs and summaries here (default: a temporary folder)")
    args = p.parse_args()
    work = Path(args.out or tempfile.mkdtemp(prefix="ttr-"))
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    src = work / "in.jsonl"
    if not src.exists():
        subprocess.run([sys.executable, "-c", "import sys; from jaxspec.bench.workloads import write_humaneval_jsonl as w; "
                        f"w(sys.argv[1], limit={args.records}, lognormal=True)", str(src)], env=env, check=True)
    import_s = min(timed_process([sys.executable, "-c", "import jaxspec.cli"], env) for _ in range(2))
    print(f"imports (python -c 'import jaxspec.cli', best of 2): {import_s:.1f} s", flush=True)
    rows = []
    for scheduler in args.scheduler:
        for method in args.methods:
            cache = work / f"xla-{scheduler}-{method}"
            shutil.rmtree(cache, ignore_errors=True)
            for phase in ("cold", "warm"):
                out = work / f"{scheduler}-{method}-{phase}.jsonl"
                for stale in work.glob(f"{out.stem}.*"):
                    stale.unlink()
                cmd = [sys.executable, "-m", "jaxspec.cli", "batch", str(src), str(out), "--batch-size",
                       str(args.batch_size), "--scheduler", scheduler, "--no-progress", "--no-plot",
                       "--compile-cache", str(cache)]
                cmd += ["--no-draft"] if method == "plain" else ["--num-draft-tokens", method.split("=")[1]]
                cmd += ["--dtype", args.dtype] if args.dtype else []
                total = timed_process(cmd, env)
                run = json.loads(out.with_suffix(".summary.json").read_text())["this_run"]
                row = {"scheduler": scheduler, "method": method, "phase": phase, "process_s": total,
                       "import_s": import_s, "load_s": run["load_s"], "compile_s": run["compile_s"],
                       "decode_s": run["decode_s"], "job_wall_s": run["wall_s"],
                       "graphs": run["graph_cache"]["misses"], "from_disk": run["graph_cache"]["disk_hits"],
                       "records": run["records"], "decode_tokens_per_s": run["decode_tokens_per_s"]}
                row["other_s"] = total - import_s - row["load_s"] - row["job_wall_s"]
                rows.append(row)
                print(json.dumps(row), flush=True)
    print("\n| scheduler | method | run | process s | imports | load | compile | decode | other | graphs "
          "(from disk) | decode tokens/s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['scheduler']} | {r['method']} | {r['phase']} | {r['process_s']:.1f} | {r['import_s']:.1f} | "
              f"{r['load_s']:.1f} | {r['compile_s']:.1f} | {r['decode_s']:.1f} | {r['other_s']:.1f} | "
              f"{r['graphs']} ({r['from_disk']}) | {r['decode_tokens_per_s']:.0f} |")
    (work / "time_to_result.json").write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
