#!/usr/bin/env python3
"""Deterministic bf16 with the request settings set: under each drafter (a draft model's chain,
n-gram lookup, an EAGLE-3 head's chain), greedy tokens and logprobs equal plain decoding's bit for
bit, with stop strings, stop ids and the three penalties (issue 48).

    python3 scripts/gpu_probes/deterministic_settings.py                       # embedded pair + head
    python3 scripts/gpu_probes/deterministic_settings.py --shape llama3-8b --draft-shape llama3.2-1b

The embedded run uses the HumanEval stop strings; a --shape run (random weights, a random head)
stops on ids drawn from a free plain run instead. Prints one line per drafter: records with equal
tokens, with bit-equal logprobs, the largest logprob difference, the acceptance and tokens/s.
"""

from __future__ import annotations

import argparse
import json

import jaxspec
from jaxspec.bench.common import machine
from jaxspec.bench.humaneval import load_prompts
from jaxspec.bench.shapes import random_head, random_model
from jaxspec.defaults import DEFAULT_DRAFT, DEFAULT_TARGET, embedded_model

HUMANEVAL_STOPS = ["\nclass", "\ndef", "\n#", "\nif", "\nprint"]
EMBEDDED_HEAD = "checkpoints/hf/code-eagle-16m"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", help="random-weight target of this shape (default: the embedded target)")
    p.add_argument("--draft-shape", default="llama3.2-1b", help="random-weight draft of this shape (with --shape)")
    p.add_argument("--records", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--k", type=int, default=3)
    args = p.parse_args(argv)
    tokenizer_model = jaxspec.load(embedded_model(DEFAULT_TARGET), dtype="bfloat16")
    if args.shape:
        target = random_model(args.shape)
        draft = random_model(args.draft_shape, seed=1)
        head = random_head(target.config, 32000)
    else:
        target = tokenizer_model
        draft = jaxspec.load(embedded_model(DEFAULT_DRAFT), dtype="bfloat16")
        head = jaxspec.load(EMBEDDED_HEAD, dtype="bfloat16")
    vocab = target.config.vocab_size
    prompts = [[t % vocab for t in tokenizer_model.tokenizer.encode(x)] for x in load_prompts(limit=args.records)]
    common = dict(max_batch_size=args.batch, deterministic=True, warn_below_acceptance=0.0)
    sampling = jaxspec.SamplingParams(temperature=0.0, max_tokens=args.max_tokens, repetition_penalty=1.2,
                                      presence_penalty=0.3, frequency_penalty=0.2, logprobs=5)
    if args.shape:  # no text to match: stop every other record on an id its free run makes
        free = jaxspec.generate(prompts, target, sampling=sampling.updated({"logprobs": None}), **common)
        per = [sampling.updated({"stop_token_ids": [c.token_ids[len(c.token_ids) // 2]] if i % 2 == 0 else []})
               for i, c in enumerate(free)]
    else:
        per = [sampling.updated({"stop": HUMANEVAL_STOPS})] * len(prompts)
    print(json.dumps({"machine": machine(), "target": target.name, "records": len(prompts),
                      "max_tokens": args.max_tokens}), flush=True)
    plain = jaxspec.generate(prompts, target, sampling=per, **common)
    finished = sum(c.finish_reason == "stop" for c in plain)
    runs = [("draft model", draft, dict(num_draft_tokens=args.k)), ("n-gram", "ngram", dict(num_draft_tokens=4)),
            ("EAGLE-3 head", head, dict(num_draft_tokens=args.k))]
    for label, drafter, kw in runs:
        spec = jaxspec.generate(prompts, target, drafter, sampling=per, **kw, **common)
        tokens = sum(a.token_ids == b.token_ids for a, b in zip(spec, plain))
        bits = sum(a.logprobs == b.logprobs for a, b in zip(spec, plain))
        diff = max((abs(x[t] - y[t]) for a, b in zip(spec, plain) for x, y in zip(a.logprobs, b.logprobs)
                    for t in x if t in y), default=0.0)
        m = spec.metrics
        print(json.dumps({"drafter": label, "equal_tokens": f"{tokens}/{len(plain)}",
                          "bit_equal_logprobs": f"{bits}/{len(plain)}", "max_logprob_diff": diff,
                          "finished_stop": f"{finished}/{len(plain)}", "acceptance": m.acceptance_rate,
                          "tokens_per_s": round(m.new_tokens / m.decode_s, 1),
                          "plain_tokens_per_s": round(plain.metrics.new_tokens / plain.metrics.decode_s, 1)}),
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
