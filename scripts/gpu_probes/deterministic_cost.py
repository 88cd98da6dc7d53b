#!/usr/bin/env python3
"""Where deterministic mode's extra time goes: one decode step (a jitted loop of forward passes
of one token per row over a --prefix-token cache) in the default mode, in deterministic mode,
and in deterministic mode with one of its parts put back on XLA (its norms, or its
projections, or its LM head), or with the matmul kernel's k splits off; the differences place
the cost. The XLA variants are not deterministic: they only measure. --kernels N also prints,
for each variant, the N kernels that take the most time in a profiler trace of the step. The
variants are settings of the engine (jaxspec.model.forward.DeterministicParts), not patches.

    python3 scripts/gpu_probes/deterministic_cost.py [--shape llama3-8b] [--batch 1] [--prefix 128] \
        [--variants default deterministic] [--kernels 25] [--quantize int8]
"""

from __future__ import annotations

import argparse

import numpy as np

from jaxspec.bench.common import best_seconds
from jaxspec.bench.profile import kernel_table, kernel_times
from jaxspec.bench.scale import forward_loop
from jaxspec.bench.shapes import random_model
from jaxspec.model.forward import DeterministicParts
from jaxspec.model.quantize import SCHEMES

# forward's `attention` for each variant: a DeterministicParts puts parts of the mode back on XLA
VARIANTS = {
    "default": "pallas",
    "deterministic": "deterministic",
    "deterministic, norms on XLA": DeterministicParts(norms=False),
    "deterministic, projections on XLA": DeterministicParts(projections=False, head=False),
    "deterministic, LM head on XLA": DeterministicParts(head=False),
    # still deterministic: tiles without k splits are fixed by (k, n) too, and need no partial sums
    "deterministic, no k splits": DeterministicParts(split_k=False),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama3-8b")
    p.add_argument("--batch", type=int, nargs="+", default=[1])
    p.add_argument("--prefix", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=32, help="forward passes in the timed loop")
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    p.add_argument("--kernels", type=int, default=0, help="print the N costliest kernels of each variant's step")
    p.add_argument("--quantize", choices=SCHEMES, help="the projections in 8 bits (docs/quantization.md)")
    args = p.parse_args(argv)
    model = random_model(args.shape, quantize=args.quantize)
    steps = args.steps
    for batch in args.batch:
        for name in args.variants:
            run = forward_loop(model, batch, args.prefix, np.ones((1, 1), bool), VARIANTS[name], steps)
            ms = 1000 * best_seconds(run, args.repeats) / steps
            kernels = kernel_times(run, 2, steps) if args.kernels else None
            print(f"| {args.shape} | B={batch} | {name} | {ms:.3f} ms |", flush=True)
            if kernels is not None:
                print(kernel_table(kernels, args.kernels), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
