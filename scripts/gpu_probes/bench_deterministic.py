#!/usr/bin/env python3
"""Records whose tokens are identical across batch sizes, schedulers and drafters, in the default
mode and in deterministic mode (issue 25), with each run's tokens/s.

The job: the HumanEval prompts, greedy, each record's budget drawn from the fixed-seed lognormal
mix (jaxspec.bench.workloads). The reference is plain decoding under the static scheduler at
--batch; against it, in each mode: the draft model's chain (K=--k), n-gram lookup (K=--ngram-k),
the continuous scheduler refilled as each row ends, and batch 1 on the first --alone records.

    python scripts/gpu_probes/bench_deterministic.py [--dtype bfloat16] [--records 164] [--batch 16]
    python scripts/gpu_probes/bench_deterministic.py --shape llama3-8b --draft-shape llama3.2-1b --records 64

--shape: random weights of a named shape (jaxspec.bench.shapes) for the target and draft, the
prompts tokenized by the embedded target's tokenizer (ids modulo the shape's vocabulary). Everything printed is measured in this run.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from jaxspec.bench.common import machine
from jaxspec.bench.humaneval import load_prompts
from jaxspec.bench.schedulers import lognormal_requests
from jaxspec.bench.shapes import random_model
from jaxspec.decoding.method import DecodeMethod
from jaxspec.defaults import DEFAULT_DRAFT, DEFAULT_TARGET, embedded_model
from jaxspec.model.loading import load
from jaxspec.serving.options import RunOptions
from jaxspec.serving.runner import run


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", help="random-weight target of this shape (default: the embedded target)")
    p.add_argument("--draft-shape", help="random-weight draft of this shape (with --shape)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--records", type=int, default=164)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--alone", type=int, default=32, help="records also decoded one at a time (default 32)")
    p.add_argument("--k", type=int, default=3, help="the draft model's chain length (default 3)")
    p.add_argument("--ngram-k", type=int, default=8, help="n-gram lookup length (default 8)")
    p.add_argument("--max-budget", type=int, default=1024, help="cap on the lognormal budgets (default 1024)")
    p.add_argument("--modes", default="default,deterministic")
    p.add_argument("--json", help="write the rows here too")
    return p.parse_args(argv)


def main(argv=None) -> list[dict]:
    """Prints (and with --json writes) one row per run; returns the rows."""
    args = parse_args(argv)
    tokenizer_model = load(embedded_model(DEFAULT_TARGET), dtype=args.dtype)
    if args.shape:
        target = random_model(args.shape, args.dtype)
        draft = random_model(args.draft_shape, args.dtype, seed=1) if args.draft_shape else None
    else:
        target, draft = tokenizer_model, load(embedded_model(DEFAULT_DRAFT), dtype=args.dtype)
    vocab = target.config.vocab_size  # a small random shape's vocabulary may be smaller than the tokenizer's
    prompts = [[t % vocab for t in tokenizer_model.tokenizer.encode(p)] for p in load_prompts(limit=args.records)]
    requests = lognormal_requests(prompts, cap=args.max_budget)
    budgets = [r.max_new_tokens for r in requests]
    alone = list(range(min(args.alone, len(requests))))
    runs = [("plain, static", DecodeMethod(), {}, None),
            (f"draft model K={args.k}, static", DecodeMethod("draft", args.k), {}, None),
            (f"n-gram K={args.ngram_k}, static", DecodeMethod("ngram", args.ngram_k), {}, None),
            ("plain, continuous refill 1", DecodeMethod(), {"scheduler": "continuous", "refill_at": 1}, None),
            (f"plain, batch 1 ({len(alone)} records)", DecodeMethod(), {}, alone)]
    if draft is None:
        runs = [r for r in runs if r[1].kind != "draft"]
    rows = []
    print(f"target {target.name}, draft {draft.name if draft else None}, {args.dtype}, {len(requests)} records, "
          f"batch {args.batch}, budgets {min(budgets)}-{max(budgets)} (total {sum(budgets)})", flush=True)
    for mode in args.modes.split(","):
        attention = RunOptions(deterministic=mode == "deterministic").attention_impl
        reference = None
        for label, method, kw, subset in runs:
            idx = subset if subset is not None else list(range(len(requests)))
            batch = 1 if subset is not None else args.batch
            t0 = time.perf_counter()
            outs = run(target, [requests[i] for i in idx], batch, method, draft, attention=attention, **kw)
            wall = time.perf_counter() - t0
            tokens = [c.token_ids for c in outs]
            if reference is None:
                reference = tokens
            same = sum(t == reference[i] for i, t in zip(idx, tokens))
            m = outs.metrics
            row = {"mode": mode, "run": label, "records": len(idx), "identical": same,
                   "tokens_per_s": m.new_tokens / m.decode_s if m.decode_s > 0 else 0.0, "decode_s": m.decode_s,
                   "compile_s": m.compile_s, "wall_s": wall, "acceptance": m.acceptance_rate}
            rows.append(row)
            acc = f", acceptance {m.acceptance_rate:.2f}" if m.acceptance_rate is not None else ""
            print(f"| {mode} | {label} | {same}/{len(idx)} identical | {row['tokens_per_s']:.0f} tokens/s "
                  f"(decode {m.decode_s:.1f} s, compile {m.compile_s:.1f} s{acc}) |", flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps({"machine": machine(), "args": vars(args), "rows": rows},
                                                      indent=2))
    return rows


if __name__ == "__main__":
    main()
