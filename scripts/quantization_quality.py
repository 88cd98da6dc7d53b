#!/usr/bin/env python3
"""What 8-bit weights cost in quality, on the embedded target and the HumanEval records:

  - cross-entropy per token of each record's prompt + canonical solution (teacher-forced), and
    its increase over the unquantized model in the same compute dtype;
  - greedy agreement with the unquantized model: tokens until the first difference (of
    --new-tokens) and the records whose whole continuation is identical;
  - the embedded draft's acceptance at K=3 against each target (the draft unquantized).

    python scripts/quantization_quality.py [--dtype bfloat16] [--records 164] [--new-tokens 64]

Everything printed is measured in this run on this machine.
"""

from __future__ import annotations

import argparse
import gzip
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxspec
from jaxspec.bench.humaneval import DEFAULT_PATH
from jaxspec.defaults import DEFAULT_DRAFT, DEFAULT_TARGET, embedded_model
from jaxspec.model.cache import KVCache
from jaxspec.model.forward import forward
from jaxspec.serving.batching import bucket


def records(limit: int) -> list[dict]:
    with gzip.open(DEFAULT_PATH, "rt") as f:
        return [json.loads(line) for line in f][:limit]


def cross_entropy(model, texts: list[str]) -> float:
    """Mean negative log-likelihood per predicted token (nats), over all texts."""
    @jax.jit
    def nll(weights, tokens, length):
        cache = KVCache.create(model.config, 1, tokens.shape[1], model.dtype,
                               stacked=not isinstance(weights.layers, tuple))
        logits = forward(weights, model.config, tokens, cache)[0][0]  # [t, v] float32
        logp = jax.nn.log_softmax(logits[:-1], axis=-1)
        picked = jnp.take_along_axis(logp, tokens[0, 1:, None], axis=1)[:, 0]
        return -jnp.sum(jnp.where(jnp.arange(tokens.shape[1] - 1) < length - 1, picked, 0.0))

    total, count = 0.0, 0
    for text in texts:
        ids = model.tokenizer.encode(text)
        padded = np.zeros((1, bucket(len(ids))), np.int32)  # a handful of shapes, one graph each
        padded[0, : len(ids)] = ids
        total += float(nll(model.weights, jnp.asarray(padded), len(ids)))
        count += len(ids) - 1
    return total / count


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="compute dtype (default float32)")
    p.add_argument("--records", type=int, default=164)
    p.add_argument("--new-tokens", type=int, default=64)
    args = p.parse_args()
    recs = records(args.records)
    texts = [r["prompt"] + r["canonical_solution"] for r in recs]
    prompts = [r["prompt"] for r in recs]
    draft = jaxspec.load(embedded_model(DEFAULT_DRAFT), dtype=args.dtype)
    rows, base_tokens, base_ce = [], None, None
    print(f"embedded target, {len(recs)} HumanEval records, {args.dtype} on {jax.devices()[0].device_kind}, "
          f"jax {jax.__version__}", flush=True)
    for scheme in (None, "int8", "fp8"):
        t0 = time.perf_counter()
        target = jaxspec.load(embedded_model(DEFAULT_TARGET), dtype=args.dtype, quantize=scheme)
        ce = cross_entropy(target, texts)
        tokens = [c.token_ids for c in jaxspec.generate(prompts, target, max_new_tokens=args.new_tokens)]
        spec = jaxspec.generate(prompts, target, draft, num_draft_tokens=3, max_new_tokens=args.new_tokens,
                                warn_below_acceptance=0.0)
        if scheme is not None:
            assert [c.token_ids for c in spec] == tokens, "speculative output differs from the target's own"
        accepted = sum(c.stats.accepted for c in spec) / max(1, sum(c.stats.drafted for c in spec))
        if scheme is None:
            base_tokens, base_ce = tokens, ce
        firsts = [first_difference(a, b) for a, b in zip(tokens, base_tokens)]
        identical = sum(a == b for a, b in zip(tokens, base_tokens))
        rows.append((scheme or f"none ({args.dtype})", ce, ce - base_ce, np.mean(firsts), identical, accepted,
                     time.perf_counter() - t0))
        print(f"{rows[-1][0]}: done in {rows[-1][-1]:.0f} s", flush=True)
    print(f"\n| weights | cross-entropy nats/token | increase | mean first difference (of {args.new_tokens}) "
          f"| records identical | draft acceptance K=3 |\n| --- | --- | --- | --- | --- | --- |")
    for name, ce, up, first, same, acc, _ in rows:
        print(f"| {name} | {ce:.4f} | {up:+.4f} | {first:.1f} | {same}/{len(recs)} | {acc:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
