#!/usr/bin/env python3
"""Is a long job's memory bounded? Runs a batch job of many near-duplicate records (so the suffix
corpus and the shared-prefix store fill up and turn over) and prints the peak memory seen up to
each checkpoint (records written): the device's peak bytes in use where JAX reports it (GPUs),
else the process' resident set (the CPU, where arrays live in host memory). Bounded means the
peak after the last checkpoint is within a few percent of the peak after the first.

    python scripts/memory_bound.py --records 10000 --checkpoints 1000,10000

Records: HumanEval stubs renamed (jaxspec.bench.workloads.renamed), each stub in as many variants
as the record count needs, in a fixed random order; --draft suffix by default.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def memory_bytes() -> tuple[int, str]:
    """(bytes, what they are): the device's peak in use, else this process' peak resident set."""
    import jax

    stats = jax.devices()[0].memory_stats()
    if stats and "peak_bytes_in_use" in stats:
        return int(stats["peak_bytes_in_use"]), "device peak bytes in use"
    with open("/proc/self/status") as f:
        rss = next(line for line in f if line.startswith("VmHWM:"))
    return int(rss.split()[1]) * 1024, "process peak resident set (VmHWM)"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", type=int, default=10000)
    p.add_argument("--checkpoints", default="1000,10000", help="records written at which to read the peak")
    p.add_argument("--draft", default="suffix", help='"suffix", "ngram", "none" or a draft model folder')
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--out", default="runs/memory")
    args = p.parse_args()

    import jaxspec
    from jaxspec.batch import JobSettings, run_job
    from jaxspec.bench.humaneval import load_prompts
    from jaxspec.bench.workloads import write_near_duplicate_jsonl
    from jaxspec.defaults import CHECKPOINTS

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stubs = len(load_prompts())
    src = out / f"neardup-{args.records}.jsonl"
    if not src.exists():
        write_near_duplicate_jsonl(src, stubs=stubs, variants=math.ceil(args.records / stubs))
    dst = out / "out.jsonl"
    for stale in out.glob("out.*"):
        stale.unlink()
    target = jaxspec.load(CHECKPOINTS / "hf" / "code-target-16m")
    draft = None if args.draft == "none" else args.draft if args.draft in ("suffix", "ngram") else jaxspec.load(args.draft)
    checkpoints = sorted(int(c) for c in args.checkpoints.split(","))
    peaks: dict[int, int] = {}
    what = memory_bytes()[1]
    done = threading.Event()

    def watch():  # the peak when the output first holds each checkpoint's records
        while not done.is_set():
            written = sum(1 for _ in open(dst, "rb")) if dst.exists() else 0
            for c in checkpoints:
                if c not in peaks and written >= c:
                    peaks[c] = memory_bytes()[0]
                    print(json.dumps({"records": written, "peak_bytes": peaks[c], "what": what}), flush=True)
            time.sleep(0.5)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    t0 = time.perf_counter()
    summary = run_job(src, dst, target, draft, JobSettings(
        max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, progress=False, plot_path=None))
    done.set()
    thread.join()
    total = summary["totals"]["records"]
    for c in checkpoints:  # a checkpoint past the job's end reads the final peak
        peaks.setdefault(c, memory_bytes()[0])
    first, last = peaks[checkpoints[0]], peaks[checkpoints[-1]]
    print(f"\n{total} records ({src.name}, draft {args.draft}, batch {args.batch_size}, {args.max_new_tokens} new "
          f"tokens) in {time.perf_counter() - t0:.0f} s on {summary['settings']['backend']}; {what}:")
    for c in checkpoints:
        print(f"  after {c} records: {peaks[c] / 2**20:.1f} MiB")
    print(f"  last / first: {last / first:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
