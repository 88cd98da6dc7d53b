#!/usr/bin/env python3
"""Where deterministic mode's extra time goes: one decode step (a jitted loop of forward passes
of one token per row over a --prefix-token cache) in the default mode, in deterministic mode,
and in deterministic mode with one of its parts put back on XLA (its norms, or its
projections, or its LM head), or with the matmul kernel's k splits off; the differences place
the cost. The XLA variants are not deterministic: they only measure. --kernels N also prints,
for each variant, the N kernels that take the most time in a profiler trace of the step.

    python3 scripts/deterministic_cost.py [--shape llama3-8b] [--batch 1] [--prefix 128] \
        [--variants default deterministic] [--kernels 25] [--quantize int8]
"""

from __future__ import annotations

import argparse

import jax
import numpy as np

import jaxspec.model.forward as fwd
import pallas_kernels.matmul as matmul_kernel
import pallas_kernels.rms_norm as norm_kernel
from jaxspec.bench.common import best_seconds
from jaxspec.bench.profile import kernel_table, kernel_times
from jaxspec.bench.scale import forward_loop
from jaxspec.bench.shapes import random_model
from jaxspec.model.quantize import SCHEMES


def _xla_norm(x, weight, eps, interpret=False):
    return fwd.rms_norm(x, weight, eps)  # the default mode's (deterministic=False)


def _xla_projection(spec, x, w, out_dtype=None):
    return fwd._einsum(spec, x, w, **({"preferred_element_type": out_dtype} if out_dtype else {}))


_KERNEL_PROJECT = fwd._kernel_project


def _xla_head(spec, x, w, out_dtype=None):
    """The LM head (its output is the vocabulary) on XLA, the other projections through the kernel."""
    head = spec.endswith("->btv")
    return (_xla_projection if head else _KERNEL_PROJECT)(spec, x, w, out_dtype)


VARIANTS = {
    "default": ("pallas", {}),
    "deterministic": ("deterministic", {}),
    "deterministic, norms on XLA": ("deterministic", {(norm_kernel, "rms_norm"): _xla_norm}),
    "deterministic, projections on XLA": ("deterministic", {(fwd, "_kernel_project"): _xla_projection}),
    "deterministic, LM head on XLA": ("deterministic", {(fwd, "_kernel_project"): _xla_head}),
    # still deterministic: tiles without k splits are fixed by (k, n) too, and need no partial sums
    "deterministic, no k splits": ("deterministic", {(matmul_kernel, "MAX_SPLIT_K"): 1}),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama3-8b")
    p.add_argument("--batch", type=int, nargs="+", default=[1])
    p.add_argument("--prefix", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    p.add_argument("--kernels", type=int, default=0, help="print the N costliest kernels of each variant's step")
    p.add_argument("--quantize", choices=SCHEMES, help="the projections in 8 bits (docs/quantization.md)")
    args = p.parse_args(argv)
    model = random_model(args.shape, quantize=args.quantize)
    steps = 32
    for batch in args.batch:
        for name in args.variants:
            attention, patches = VARIANTS[name]
            saved = {key: getattr(*key) for key in patches}
            for (module, attr), value in patches.items():
                setattr(module, attr, value)
            try:
                jax.clear_caches()  # the loop is traced afresh with the parts patched
                run = forward_loop(model, batch, args.prefix, np.ones((1, 1), bool), attention, steps)
                ms = 1000 * best_seconds(run, args.repeats) / steps
                kernels = kernel_times(run, 2, steps) if args.kernels else None
            finally:
                for (module, attr), value in saved.items():
                    setattr(module, attr, value)
            print(f"| {args.shape} | B={batch} | {name} | {ms:.3f} ms |", flush=True)
            if kernels is not None:
                print(kernel_table(kernels, args.kernels), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
