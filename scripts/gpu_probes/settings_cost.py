#!/usr/bin/env python3
"""What request settings cost: plain decoding at a real shape (random weights) through
jaxspec.generate, with every setting at its default and with each named group of settings set,
the groups alternating within each repeat. Prints one JSON line per (batch, settings) with the
median decode seconds of the repeats and the tokens/s.

    python3 scripts/gpu_probes/settings_cost.py --shape llama3-8b --batch-sizes 1,64 --repeats 5 \\
        [--settings default,penalties,logprobs,stops] [--model checkpoints/hf/code-target-16m]

It runs on checkouts from before jaxspec.SamplingParams too (only `default` there), so the same
command on an older tree (PYTHONPATH=OLD_TREE) gives the baseline of a before/after comparison.
"""

from __future__ import annotations

import argparse
import json
import statistics

import numpy as np

import jaxspec
from jaxspec.bench.shapes import random_model

SETTINGS = {
    "default": {},
    "penalties": dict(repetition_penalty=1.1, presence_penalty=0.3, frequency_penalty=0.2),
    "logprobs": dict(logprobs=5),
    "stops": dict(stop_token_ids=[7, 11, 13]),  # ids a random model rarely draws: rows run to their budget
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama3-8b")
    p.add_argument("--model", help="a model folder instead of --shape (e.g. checkpoints/hf/code-target-16m on a CPU)")
    p.add_argument("--batch-sizes", default="1,64")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--settings", default="default", help=f"comma-separated of {', '.join(SETTINGS)}")
    p.add_argument("--label", default="", help="a name for this tree, printed on each line (before, after)")
    args = p.parse_args(argv)
    names = args.settings.split(",")
    model = jaxspec.load(args.model) if args.model else random_model(args.shape)
    rng = np.random.default_rng(0)
    for b in (int(x) for x in args.batch_sizes.split(",")):
        prompts = rng.integers(1, model.config.vocab_size, size=(b, args.prompt_len)).tolist()
        calls = {n: dict(max_new_tokens=args.new_tokens, max_batch_size=b, warn_below_acceptance=0.0, **SETTINGS[n])
                 for n in names}
        for kw in calls.values():
            jaxspec.generate(prompts, model, **kw)  # compiles
        seconds = {n: [] for n in names}
        tokens = {}
        for _ in range(args.repeats):
            for n, kw in calls.items():  # the groups alternate within each repeat
                out = jaxspec.generate(prompts, model, **kw)
                seconds[n].append(out.metrics.decode_s)
                tokens[n] = out.metrics.new_tokens
        for n in names:
            s = statistics.median(seconds[n])
            print(json.dumps({"label": args.label, "shape": args.model or args.shape, "batch": b, "settings": n,
                              "median_decode_s": round(s, 5), "tokens_per_s": round(tokens[n] / s, 1),
                              "runs_s": [round(x, 5) for x in seconds[n]]}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
