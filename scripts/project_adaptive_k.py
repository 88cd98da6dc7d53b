#!/usr/bin/env python3
"""Projects a continuous job's decode time under plain decoding, a fixed K and adaptive K, from
round costs measured on a machine ({rows: {K: ms}}: scripts/gpu_probes/adaptive_k_costs.py) and a
job's measured acceptance (each record's output length and per-position acceptance, from the output
file of a fixed-K run of it), by replaying the continuous scheduler round by round with the
engine's rules: records admitted by largest budget, a return to the host each time refill_at rows
have finished, and for adaptive K its chooser (jaxspec.serving.adaptive_k.AdaptiveK, the engine's
own class): a few timed rounds of each K at each row count, then the K of most tokens per second,
and the loop shrunk to a power of two of rows once the job drains. Each round's accepted drafts are
drawn per record from its own measured rates (fixed seed). A return to the host costs
--return-steps plain steps at the full batch; prefills cost the same under every setting and are
left out. A projection, labelled so: it pairs one machine's round costs with another's acceptance.

    python scripts/project_adaptive_k.py --costs costs.json --input runs/adaptive/lognormal.jsonl \\
        --output runs/adaptive/lognormal1.jsonl --batch 16
"""

from __future__ import annotations

import argparse
import collections
import json

import numpy as np

from jaxspec.serving.adaptive_k import TIMED_ROUNDS, AdaptiveK
from jaxspec.serving.batching import bucket


def read_records(input_path: str, output_path: str) -> list[dict]:
    """Per record: its budget, output length and conditional acceptance per draft position."""
    budgets = {}
    for line in open(input_path, encoding="utf-8"):
        x = json.loads(line)
        budgets[x["id"]] = x.get("max_new_tokens", 128)
    records = []
    for line in open(output_path, encoding="utf-8"):
        x = json.loads(line)
        s = x["stats"]
        cumulative = [a / d if d else 0.0 for a, d in zip(s["accepted_per_position"], s["drafted_per_position"])]
        previous = [1.0, *cumulative[:-1]]
        conditional = [min(1.0, c / p) if p else 0.0 for c, p in zip(cumulative, previous)]
        records.append({"budget": budgets[x["id"]], "length": len(x["token_ids"]), "rates": conditional})
    return records


def simulate(records, costs: dict, batch: int, refill_at: int, return_ms: float, fixed_k: int | None, seed: int = 0):
    """(seconds, rounds per K, returns) of the job: fixed_k None is adaptive K."""
    rng = np.random.default_rng(seed)
    depth = len(records[0]["rates"])
    ks = tuple(sorted(costs[batch]))
    chooser = AdaptiveK(ks, depth) if fixed_k is None else None
    pending = collections.deque(sorted(records, key=lambda r: -r["budget"]))
    slots: list[dict | None] = [None] * batch
    seconds, returns, used = 0.0, 0, collections.Counter()
    while pending or any(slots):
        for i, s in enumerate(slots):  # admit (the prefill commits the first token)
            if s is None and pending:
                r = pending.popleft()
                slots[i] = {"left": r["length"] - 1, "rates": r["rates"]} if r["length"] > 1 else None
        live = [s for s in slots if s]
        if not live:
            continue
        rows, timing, k = len(slots), False, fixed_k
        if chooser is not None:
            if not pending and bucket(len(live), 1) <= rows // 2:  # shrink, as continuous._Slots.shrink
                slots = live + [None] * (bucket(len(live), 1) - len(live))
                rows = len(slots)
            k, timing = chooser.next(rows)
        need = min(refill_at, len(pending)) if pending else rows + 1
        if chooser is not None and not pending:
            need = max(1, len(live) - rows // 2)
        if timing:  # timed rounds run on whatever finishes
            need = rows + 1
        limit = 1 + TIMED_ROUNDS if timing else None
        finished = rounds = 0
        accepted, drafted = np.zeros(depth), np.zeros(depth)
        while any(slots) and finished < need and (limit is None or rounds < limit):
            rounds += 1
            seconds += costs[rows][k] / 1000
            for i, s in enumerate(slots):
                if not s:
                    continue
                a = 0
                while a < k and rng.random() < s["rates"][a]:
                    a += 1
                accepted[:a] += 1
                drafted[:k] += 1
                s["left"] -= min(s["left"], a + 1)
                if s["left"] == 0:
                    slots[i] = None
                    finished += 1
        used[k] += rounds
        if chooser is not None:
            if timing:
                chooser.timed(k, rows, costs[rows][k] / 1000 * TIMED_ROUNDS, TIMED_ROUNDS)
            chooser.record(accepted, drafted)
        seconds += return_ms / 1000
        returns += 1
    return seconds, dict(sorted(used.items())), returns


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--costs", required=True)
    p.add_argument("--input", required=True, help="the job's input file (its budgets)")
    p.add_argument("--output", required=True, help="a fixed-K run's output file (its acceptance)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--refill-at", type=int, help="default: the engine's on the costs' backend")
    p.add_argument("--return-steps", type=float, default=2.0)
    p.add_argument("--seeds", type=int, default=5)
    args = p.parse_args()
    table = json.load(open(args.costs))
    costs = {int(rows): {int(k): ms for k, ms in by_k.items()} for rows, by_k in table["ms_per_round"].items()}
    cpu = table["machine"]["backend"] == "cpu"
    refill_at = args.refill_at or (1 if cpu else max(1, args.batch // 8))
    records = read_records(args.input, args.output)
    return_ms = args.return_steps * costs[args.batch][0]
    k_max = max(costs[args.batch])
    print(f"projection: {len(records)} records, batch {args.batch}, refill at {refill_at}, a return = "
          f"{args.return_steps} plain steps ({return_ms:.2f} ms); round costs of {table['target']} + {table['draft']} "
          f"on {table['machine']}; acceptance of {args.output}; mean of {args.seeds} seeds")
    print("| setting | projected decode s | rounds per K | returns | time (plain's; adaptive K: the better one's) |")
    print("| --- | --- | --- | --- | --- |")
    results = {}
    for name, k in (("plain", 0), (f"K={k_max}", k_max), ("adaptive K", None)):
        runs = [simulate(records, costs, args.batch, refill_at, return_ms, k, seed) for seed in range(args.seeds)]
        results[name] = float(np.mean([r[0] for r in runs]))
        best = min(v for n, v in results.items() if n != "adaptive K") if name == "adaptive K" else results["plain"]
        print(f"| {name} | {results[name]:.2f} | {runs[0][1]} | {runs[0][2]} | {results[name] / best:.3f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
