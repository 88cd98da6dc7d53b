#!/usr/bin/env python3
"""Adaptive K's round costs: ms per round of each K (0: the paused loop, a verify pass of the pending
token alone) at each row count, through the engine's own loops (jaxspec.decoding.adaptive), greedy,
EOS off. A round's ms = (decode of n2 new tokens - decode of n1) / (its rounds at n2 - at n1): the
prefill cancels. Prints one JSON line per (rows, K) and writes --out, {rows: {K: ms}}, the table
scripts/project_adaptive_k.py reads.

    # random weights at real shapes (on a GPU)
    python3 scripts/gpu_probes/adaptive_k_costs.py --shape llama3-8b --draft-shape llama3.2-1b --out costs.json
    # the embedded pair (on this CPU)
    python3 scripts/gpu_probes/adaptive_k_costs.py --model checkpoints/hf/code-target-16m \\
        --draft checkpoints/hf/code-draft-4m --dtype float32 --out costs.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json

import jax
import numpy as np

import jaxspec
from jaxspec.bench.common import best_seconds, machine
from jaxspec.bench.shapes import random_model
from jaxspec.decoding.adaptive import adaptive_loops, k_choices
from jaxspec.decoding.loop import decode
from jaxspec.decoding.method import DecodeMethod
from jaxspec.sampling_params import GREEDY
from jaxspec.serving.batching import bucket, cache_capacity, make_batch, stop_plan
from jaxspec.serving.generate import build_requests
from jaxspec.serving.options import RunOptions


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", help="a named shape with random weights (jaxspec.bench.shapes)")
    p.add_argument("--draft-shape")
    p.add_argument("--model", help="a model folder instead of --shape")
    p.add_argument("--draft", help="a draft model folder instead of --draft-shape")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--k", type=int, default=3, help="the widest K (the set: k_choices)")
    p.add_argument("--rows", default="16,8,4,2,1")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", default="33,97", help="n1,n2")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out")
    args = p.parse_args()
    if args.model:
        target, draft = (jaxspec.load(x, dtype=args.dtype) for x in (args.model, args.draft))
        if target.config.eos_token_ids:  # every row decodes its whole budget
            target = dataclasses.replace(target, config=dataclasses.replace(target.config, eos_token_ids=()))
    else:
        target, draft = random_model(args.shape, args.dtype), random_model(args.draft_shape, args.dtype, seed=1)
    method = DecodeMethod("draft", args.k)
    widest, params = method.loop(target, draft)
    loops = adaptive_loops(widest, k_choices(args.k), method.name)
    attention = RunOptions().attention_impl
    n1, n2 = (int(x) for x in args.new_tokens.split(","))
    print(json.dumps({"machine": machine(), "target": target.name, "draft": draft.name, "dtype": args.dtype,
                      "attention": attention, "prompt_len": args.prompt_len, "new_tokens": [n1, n2]}), flush=True)
    rng = np.random.default_rng(0)
    # One graph per (rows, K), its budget a runtime value: n1 and n2 share it. Compiled in parallel.
    calls = {}
    for rows in (int(r) for r in args.rows.split(",")):
        prompts = rng.integers(1, target.config.vocab_size, (rows, args.prompt_len)).tolist()
        batches = {}
        for new in (n1, n2):
            reqs = build_requests(prompts, target, dataclasses.replace(GREEDY, max_tokens=new))
            batches[new] = make_batch(reqs, rows, bucket(args.prompt_len), target.config.pad_token_id,
                                      stop_plan(reqs, target))
        static = dict(capacity=cache_capacity(bucket(args.prompt_len), bucket(n2), widest.slack), max_out=bucket(n2),
                      greedy_only=True, attention=attention)
        for k, loop in loops.items():
            calls[rows, k] = (decode.lower(target.weights, params, batches[n1], loop=loop, **static), batches)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        compiled = dict(zip(calls, pool.map(lambda c: c[0].compile(), calls.values())))
    table: dict[int, dict[int, float]] = {}
    for (rows, k), (_, batches) in calls.items():
        exe = compiled[rows, k]
        timed = []
        for new in (n1, n2):
            run = lambda: jax.block_until_ready(exe(target.weights, params, batches[new]))  # noqa: E731
            out = run()
            timed.append((best_seconds(run, args.repeats), int(np.max(np.asarray(out["rounds"])))))
        (s1, r1), (s2, r2) = timed
        ms = 1000 * (s2 - s1) / (r2 - r1)
        table.setdefault(rows, {})[k] = ms
        print(json.dumps({"rows": rows, "k": k, "ms_per_round": round(ms, 4), "rounds": [r1, r2]}), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"target": target.name, "draft": draft.name, "machine": machine(), "ms_per_round": table}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
