#!/usr/bin/env python3
"""Is a long job's memory bounded? Runs a batch job of many near-duplicate records (so the suffix
corpus and the shared-prefix store fill up and turn over) and prints the peak memory seen up to
each checkpoint (records written): the device's peak bytes in use where JAX reports it (GPUs),
else the peak of JAX's live arrays, sampled every 0.1 s (the CPU, where device arrays live in
host memory); and the process' peak resident set beside it. Bounded means the peak after the
last checkpoint is within a few percent of the peak after the first.

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


def device_bytes() -> tuple[int, str]:
    """(bytes, what they are): the device's peak in use, else the bytes of JAX's live arrays now."""
    import jax

    stats = jax.devices()[0].memory_stats()
    if stats and "peak_bytes_in_use" in stats:
        return int(stats["peak_bytes_in_use"]), "device peak bytes in use"
    return sum(a.nbytes for a in jax.live_arrays()), "peak of live JAX arrays (sampled)"


def resident_peak() -> int:
    """This process' peak resident set (host memory: Python objects, compiled code, arrays on the CPU)."""
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmHWM:")).split()[1]) * 1024


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
    peaks: dict[int, tuple[int, int]] = {}  # checkpoint -> (device peak, resident peak)
    what = device_bytes()[1]
    done = threading.Event()
    seen = [0]  # the largest device figure sampled so far

    def watch():  # the peaks when the output first holds each checkpoint's records
        written, last_count = 0, 0.0
        while not done.is_set():
            seen[0] = max(seen[0], device_bytes()[0])
            if time.perf_counter() - last_count > 1.0:  # counting the output's lines costs more: once a second
                written, last_count = (sum(1 for _ in open(dst, "rb")) if dst.exists() else 0), time.perf_counter()
            for c in checkpoints:
                if c not in peaks and written >= c:
                    peaks[c] = (seen[0], resident_peak())
                    print(json.dumps({"records": written, "device_bytes": peaks[c][0], "what": what,
                                      "resident_peak_bytes": peaks[c][1]}), flush=True)
            time.sleep(0.1)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    t0 = time.perf_counter()
    summary = run_job(src, dst, target, draft, JobSettings(
        max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, progress=False, plot_path=None))
    done.set()
    thread.join()
    total = summary["totals"]["records"]
    for c in checkpoints:  # a checkpoint past the job's end reads the final peaks
        peaks.setdefault(c, (seen[0], resident_peak()))
    print(f"\n{total} records ({src.name}, draft {args.draft}, batch {args.batch_size}, {args.max_new_tokens} new "
          f"tokens) in {time.perf_counter() - t0:.0f} s on {summary['settings']['backend']}:")
    for i, name in enumerate((what, "process peak resident set (VmHWM)")):
        print(f"  {name}: " + ", ".join(f"after {c} records {peaks[c][i] / 2**20:.1f} MiB" for c in checkpoints)
              + f"; last / first {peaks[checkpoints[-1]][i] / peaks[checkpoints[0]][i]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
