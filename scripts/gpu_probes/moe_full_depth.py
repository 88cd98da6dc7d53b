"""Carry an 8-layer mixture-of-experts bench run (`jaxspec bench --shape qwen3-30b-a3b-8l ... --json
F`) to the model's full depth, and print the speedups it projects there.

The 8-layer shapes exist because no whole model fits the device machine's disk; but a draft model
is measured at its own full depth (Qwen3-0.6B: 28 layers), so the run's own projection sets a whole
draft against a sixth of the target and understates speculation. Here each target time is split
into its LM head (its bytes at the run's floor bandwidth) and 8 equal layers, and the layers are
scaled to the real count:

    full_ms = (ms - head_ms) / 8 * layers + head_ms

for the plain step and the K + 1-token verify forward; the draft's (or head's) time is the run's
own. projected = tokens per round x full plain step / (draft + full verify). The loop's own saving
over separate calls (the run's negative "overhead") is left out, so the estimate is conservative.

    python3 scripts/gpu_probes/moe_full_depth.py docs/bench/h200-moe-projection-random-2026-12-06.json ...
"""

import argparse
import json
from pathlib import Path

from jaxspec.bench.shapes import SHAPES

FULL_DEPTH = {"qwen3-30b-a3b-8l": 48, "mixtral-8x7b-8l": 32}


def full_depth_rows(run: dict) -> list[dict]:
    shape = run["args"]["shape"]
    if shape not in FULL_DEPTH:
        raise SystemExit(f"moe_full_depth: shape {shape!r} is not an 8-layer MoE shape ({', '.join(FULL_DEPTH)})")
    if run["args"].get("quantize") or run["args"].get("dtype") not in (None, "bfloat16"):
        raise SystemExit("moe_full_depth: bf16 runs only (the LM head's bytes are counted at 2 a weight)")
    config, layers = SHAPES[shape], FULL_DEPTH[shape]
    measured = config["num_hidden_layers"]
    head_ms = config["vocab_size"] * config["hidden_size"] * 2 / run["ceilings"]["floor_bandwidth"] * 1e3

    def full(ms):
        return (ms - head_ms) / measured * layers + head_ms

    rows = run["rows"]
    plain = next(r["ms_per_step"] for r in rows if r["part"] == "plain" and r["batch"] == 1)
    verify = {r["tokens"]: r["ms"] for r in rows if r["part"] == "forward" and r["role"] == "target"}
    projected = {r["method"]: r for r in rows if r["part"] == "projection"}
    out = []
    for spec in (r for r in rows if r["part"] == "spec"):
        k = int(spec["method"].rsplit("=", 1)[1])
        if spec["method"] not in projected or k + 1 not in verify:
            continue
        tokens = projected[spec["method"]]["tokens_per_round"]
        round_ms = spec["draft_ms"] + full(verify[k + 1])
        out.append({"routing": run["args"]["routing"], "method": spec["method"], "layers": layers,
                    "plain_ms": full(plain), "verify_ms": full(verify[k + 1]), "draft_ms": spec["draft_ms"],
                    "tokens_per_round": tokens, "projected_8_layers": projected[spec["method"]]["projected_speedup"],
                    "projected_full_depth": tokens * full(plain) / round_ms})
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="jaxspec bench --json files of an 8-layer MoE shape")
    args = parser.parse_args()
    print("| run | routing | method | layers | plain ms | verify ms | draft ms | tokens / round | projected, 8 layers | projected, full depth |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for path in args.runs:
        with open(path) as f:
            for r in full_depth_rows(json.load(f)):
                print(f"| {Path(path).stem} | {r['routing']} | {r['method']} | {r['layers']} | {r['plain_ms']:.2f} | {r['verify_ms']:.2f} "
                      f"| {r['draft_ms']:.2f} | {r['tokens_per_round']:.2f} | {r['projected_8_layers']:.2f}x "
                      f"| {r['projected_full_depth']:.2f}x |")


if __name__ == "__main__":
    main()
