#!/usr/bin/env python3
"""Greedy tokens of a named shape with random weights (jaxspec.bench.shapes), plain and
speculative with a random draft, in each --quantize format: JSON on stdout, and on stderr
whether each speculative run equals its plain one. Run it in two checkouts and diff the JSON to
show a change leaves the engine's output bit for bit as it was, at real shapes on a GPU.

    python3 scripts/greedy_tokens.py [--shape llama3-8b] [--draft-shape llama3.2-1b] \
        [--quantize none fp8] [--new-tokens 40] > tokens.json
"""

from __future__ import annotations

import argparse
import json
import sys

import jaxspec
from jaxspec.bench.shapes import random_model

# Two rows of different lengths (ids low enough for every named shape's vocabulary).
PROMPTS = [list(range(11, 11 + 37)), list(range(300, 300 + 130))]


def tokens(shape: str, draft_shape: str, quantize: str | None, new_tokens: int, k: int) -> dict[str, list]:
    """{"<format>-plain": rows' token ids, "<format>-spec": the same with the draft}."""
    target = random_model(shape, quantize=quantize)
    draft = random_model(draft_shape, seed=1, quantize=quantize)
    fmt = quantize or "bf16"
    return {f"{fmt}-{name}": [r.token_ids for r in jaxspec.generate(PROMPTS, target, d, max_new_tokens=new_tokens,
                                                                      num_draft_tokens=k)]
            for name, d in (("plain", None), ("spec", draft))}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama3-8b")
    p.add_argument("--draft-shape", default="llama3.2-1b")
    p.add_argument("--quantize", nargs="+", default=["none", "fp8"], choices=["none", "int8", "fp8"])
    p.add_argument("--new-tokens", type=int, default=40)
    p.add_argument("--num-draft-tokens", type=int, default=3)
    args = p.parse_args(argv)
    out = {}
    for q in args.quantize:
        out |= tokens(args.shape, args.draft_shape, None if q == "none" else q, args.new_tokens,
                      args.num_draft_tokens)
    for key in (k for k in out if k.endswith("-spec")):
        same = out[key] == out[key.replace("-spec", "-plain")]
        print(f"{key}: {'equals' if same else 'DIFFERS from'} plain", file=sys.stderr)
    json.dump(out, sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
