#!/usr/bin/env python3
"""Where a mixture-of-experts pass's time goes, kernel by kernel (issue 51): one forward pass at
batch 1 over T tokens (T = 1: a plain decode step; T = K + 1: a chain's verify pass), --steps of
them inside one jitted loop (`jaxspec bench`'s forward_loop: the passes its forward rows time),
traced by JAX's profiler; the device's kernels summed by name, one
JSON line each (us per pass, launches per pass), then a line per T with the device's busy time and
the wall time per pass (their difference: gaps between kernels).

    python3 scripts/gpu_probes/moe_profile.py --shape qwen3-30b-a3b-8l --tokens 1,4

On the CPU (no device stream in the trace) the host's XLA threads are summed instead: a check
that the script runs, not a measurement.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import pathlib
import re
import tempfile
import time

import jax
import numpy as np

import jaxspec.model.forward as fwd
from jaxspec.bench.experts import ROUTINGS, unique_experts, with_routing
from jaxspec.bench.scale import forward_loop, forward_tokens
from jaxspec.bench.shapes import random_model
from jaxspec.serving.options import RunOptions


def emit(**row):
    print(json.dumps(row), flush=True)


def device_events(trace: dict) -> tuple[list[dict], str]:
    """The trace's complete events on the device's streams (its derived lines of XLA modules and
    ops left out: they overlap the kernels), or, with no device, the host's XLA threads'."""
    meta = [e for e in trace["traceEvents"] if e.get("ph") == "M"]
    processes = {e["pid"]: e["args"]["name"] for e in meta if e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e.get("name") == "thread_name"}
    device = {key: name for key, name in threads.items() if "/device:" in processes.get(key[0], "")
              and "CPU" not in processes[key[0]]}
    chosen = ({key for key, name in device.items() if name.startswith("Stream")}
              or {key for key, name in threads.items() if name.startswith("tf_XLA")})
    where = ", ".join(sorted({threads[key] for key in chosen})) or f"nothing of {sorted(set(threads.values()))[:20]}"
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and (e["pid"], e.get("tid")) in chosen
              and not e["name"].startswith("end: ")]
    return events, where


def op_names(text: str) -> dict[str, str]:
    """Each instruction of a compiled program's text by name (as the trace names its kernels) ->
    the JAX operation it came from (the HLO's op_name metadata, its jit and loop prefixes dropped)."""
    names = {}
    for line in text.splitlines():
        m = re.match(r'\s*(?:ROOT )?%?([\w.\-]+) = .*?metadata=\{[^}]*op_name="([^"]+)"', line)
        if m:  # (the trace writes a kernel's dots as underscores: gemm_fusion_dot.172 runs as gemm_fusion_dot_172)
            op = re.sub(r"jit\([^)]*\)/|closed_call/|while/body/", "", m.group(2))[-100:]
            for name in (m.group(1), m.group(1).replace(".", "_")):
                names.setdefault(name, op)
    return names


def profile(run, steps: int) -> tuple[list[dict], float, str]:
    """run (forward_loop's: it blocks until its passes are done) traced once, warm."""
    run()  # compiled and warm
    with tempfile.TemporaryDirectory() as folder:
        with jax.profiler.trace(folder):
            start = time.perf_counter()
            run()
            wall = time.perf_counter() - start
        trace_file, = pathlib.Path(folder).glob("plugins/profile/*/*.trace.json.gz")
        with gzip.open(trace_file) as f:
            trace = json.load(f)
    events, where = device_events(trace)
    return events, wall / steps, where


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tokens", default="1,4", help="tokens per pass, comma-separated")
    p.add_argument("--prompt-len", type=int, default=128, help="the prefix in the cache (0: none)")
    p.add_argument("--steps", type=int, default=32, help="passes in the traced loop")
    p.add_argument("--top", type=int, default=25, help="kernels reported per pass, by time")
    p.add_argument("--routing", choices=ROUTINGS, default="random")
    p.add_argument("--hlo", help="a folder for each pass's compiled program (hlo-t<T>.txt.gz): which operations each "
                   "kernel fuses")
    args = p.parse_args()
    model = with_routing(random_model(args.shape, args.dtype), args.routing)
    emit(kind="machine", shape=args.shape, device=str(jax.devices()[0].device_kind), routing=args.routing,
         expert_path=fwd.FORCED_EXPERT_PATH or "engine's choice", router=fwd.ROUTER_PATH)
    for t in (int(x) for x in args.tokens.split(",") if x):
        # the passes `jaxspec bench`'s forward rows time: t tokens after the prefix, shifted each pass
        run = forward_loop(model, 1, args.prompt_len, np.tril(np.ones((t, t), bool)), RunOptions().attention_impl,
                           args.steps)
        events, wall, where = profile(run, args.steps)
        text = run.compiled_text()
        ops = op_names(text)
        if args.hlo:
            pathlib.Path(args.hlo).mkdir(parents=True, exist_ok=True)
            with gzip.open(pathlib.Path(args.hlo) / f"hlo-t{t}.txt.gz", "wt") as f:
                f.write(text)
        total, count = collections.Counter(), collections.Counter()
        for e in events:
            total[e["name"]] += float(e.get("dur", 0))
            count[e["name"]] += 1
        busy = sum(total.values()) / args.steps
        for name, us in total.most_common(args.top):
            emit(kind="kernel", tokens=t, name=name[:120], us_per_pass=round(us / args.steps, 2),
                 launches_per_pass=round(count[name] / args.steps, 2), op=ops.get(name, ""))
        tokens = forward_tokens(model.config.vocab_size, 1, t)
        experts = unique_experts(model, tokens, args.prompt_len, passes=4) if model.config.is_moe else 0
        emit(kind="pass", tokens=t, experts_per_layer=experts, where=where, busy_us=round(busy, 1), wall_us=round(1e6 * wall, 1),
             kernels=len(total), launches_per_pass=round(sum(count.values()) / args.steps, 1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
