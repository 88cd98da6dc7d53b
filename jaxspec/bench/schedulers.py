"""The lognormal-budget job (jaxspec.bench.workloads.lognormal_budgets) under the static and the continuous
scheduler, side by side: records/s, wall clock less compiling, and every record's tokens compared.

Each row of the job ends at its own budget. Two cases of it:
- lengths "seen": the schedulers use the budgets, as a batch job does when its records carry
  them. Static batches hold one prompt and budget bucket (the batch job's planner,
  jaxspec.jobs.local.plan_chunks); the continuous slots admit the largest budget first.
- lengths "hidden": the budgets stand for where answers end (an end-of-text token), which no
  scheduler knows up front; the case of real instruct models with one max_new_tokens for all.
  Static batches are planned by prompt length alone (as generate() plans them); the continuous
  slots admit in arrival order.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from jaxspec.bench.common import machine
from jaxspec.bench.workloads import lognormal_budgets
from jaxspec.decoding.method import DecodeMethod
from jaxspec.jobs.local import plan_chunks
from jaxspec.jobs.records import Record
from jaxspec.sampling_params import GREEDY
from jaxspec.serving.options import RunOptions
from jaxspec.serving.requests import Request
from jaxspec.serving.runner import run

LENGTHS = ("seen", "hidden")


def lengths_cases(text: str) -> list[str]:
    """--lengths (argparse type): comma-separated cases of LENGTHS."""
    cases = [c for c in text.split(",") if c]
    if not cases or set(cases) - set(LENGTHS):
        raise argparse.ArgumentTypeError(f"comma-separated {' and/or '.join(LENGTHS)}; got {text!r}")
    return cases


def lognormal_requests(prompts: list[list[int]], seed: int = 0, cap: int = 1024):
    """One greedy Request per prompt, its budget drawn from the fixed-seed lognormal mix (at most cap)."""
    budgets = lognormal_budgets(len(prompts), cap=cap, seed=seed)
    return [Request(tuple(p), dataclasses.replace(GREEDY, max_tokens=int(b))) for p, b in zip(prompts, budgets)]


def _seen_static(requests) -> list[list[int]]:
    """Indices of the requests in the batch job's groups (one prompt and budget bucket each)."""
    records = [Record(line=i, key=str(i), id=i, data=None, request=r) for i, r in enumerate(requests)]
    return [[r.line for r in chunk] for chunk in plan_chunks(records, len(records))]


def scheduler_rows(model, requests, batch: int, attention: str, *, method: DecodeMethod = DecodeMethod(),
                   draft=None, label: str = "plain", refills=(None,), lengths=LENGTHS, emit=None) -> list[dict]:
    """Rows of records/s for the static scheduler and the continuous one at each refill policy,
    in each lengths case, decoding by `method` (its draft model: `draft`); `same_as_static`:
    records whose tokens equal the static scheduler's. emit(row): called as each row is measured
    (default: print it)."""
    def timed(groups, **kw):
        seconds, compile_s, tokens, out = 0.0, 0.0, 0, {}
        for group in groups:
            done = run(model, [requests[i] for i in group], batch, method, draft, attention=attention, **kw)
            seconds += done.metrics.wall_s - done.metrics.compile_s
            compile_s += done.metrics.compile_s
            tokens += done.metrics.new_tokens
            out.update({i: c.token_ids for i, c in zip(group, done)})
        return seconds, compile_s, tokens, out

    rows = []
    everyone = [list(range(len(requests)))]
    for case in lengths:
        order = "longest" if case == "seen" else "arrival"
        runs = [("static", None, _seen_static(requests) if case == "seen" else everyone, {})]
        runs += [("continuous", r, everyone, {"scheduler": "continuous", "refill_at": r, "admit_order": order})
                 for r in refills]
        static_out = static_rate = None
        for scheduler, refill_at, groups, kw in runs:
            seconds, compile_s, tokens, out = timed(groups, **kw)
            row = {"part": "continuous", "model": model.name, "method": label, "lengths": case,
                   "scheduler": scheduler, "refill_at": refill_at, "batch": batch, "records": len(requests),
                   "new_tokens": tokens, "seconds": seconds, "compile_s": compile_s,
                   "records_per_s": len(requests) / seconds, "tokens_per_s": tokens / seconds}
            if static_out is None:
                static_out, static_rate = out, row["records_per_s"]
            else:
                row["vs_static"] = row["records_per_s"] / static_rate
                row["same_as_static"] = sum(out[i] == static_out[i] for i in out)
            rows.append(row)
            (emit or (lambda r: print(format_row(r), flush=True)))(row)
    return rows


def format_row(r: dict) -> str:
    refill = f" refill at {r['refill_at']}" if r.get("refill_at") else ""
    vs = f", {r['vs_static']:.2f}x static, {r['same_as_static']}/{r['records']} same" if "vs_static" in r else ""
    return (f"| {r['method']} | lengths {r['lengths']} | {r['scheduler']}{refill} | B={r['batch']}, {r['records']} "
            f"lognormal records | {r['seconds']:.2f} s | {r['tokens_per_s']:.0f} tokens/s | "
            f"{r['records_per_s']:.2f} records/s{vs} |")


def run_embedded(args, target, draft, prompts) -> list[dict]:
    """`jaxspec bench --parts continuous` on the embedded pair (or --target/--draft): plain, each
    --k chain and each --ngram-k lookup, at each batch size."""
    attention = RunOptions(args.attention).attention_impl
    requests = lognormal_requests(prompts, args.seed)
    methods = [(DecodeMethod(), "plain")] + [(DecodeMethod("draft", k), f"K={k}") for k in args.k]
    methods += [(DecodeMethod("ngram", k), f"ngram K={k}") for k in args.ngram_k]
    rows = []

    def emit(row):  # every row printed and saved as it is measured: a cut-short run keeps them
        rows.append(row)
        print(format_row(row), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({"machine": machine(), "args": vars(args), "rows": rows},
                                                  indent=2, default=str))

    for b in args.batch_sizes:
        for method, label in methods:
            scheduler_rows(target, requests, b, attention, method=method, draft=draft, label=label,
                           refills=args.refill_at or [None], lengths=args.lengths, emit=emit)
    return rows
