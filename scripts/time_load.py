#!/usr/bin/env python3
"""Seconds to import jaxspec and to load one model folder (or hub id) onto the devices, in this
fresh process:

    python scripts/time_load.py /tmp/llama3-8b [--dtype bfloat16] [--tensor-parallel N]
"""

import argparse
import time

t0 = time.perf_counter()
import jax  # noqa: E402

import jaxspec  # noqa: E402

imported = time.perf_counter() - t0

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--dtype")
    p.add_argument("--tensor-parallel", type=int, default=1)
    args = p.parse_args()
    t1 = time.perf_counter()
    model = jaxspec.load(args.model, dtype=args.dtype, tensor_parallel=args.tensor_parallel)
    jax.block_until_ready(model.weights)
    loaded = time.perf_counter() - t1
    gb = sum(a.nbytes for a in jax.tree.leaves(model.weights)) / 1e9
    print(f"{args.model}: import {imported:.1f} s, load {loaded:.1f} s ({gb:.2f} GB of {model.dtype} weights on "
          f"{jax.devices()[0].device_kind}, jax {jax.__version__})", flush=True)
