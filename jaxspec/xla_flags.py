"""XLA settings jaxspec picks for GPUs, set in XLA_FLAGS before a backend starts (importing
jaxspec sets them; a process whose GPU backend already started keeps its own).

`--xla_gpu_autotune_level=1`: XLA still times every candidate kernel of each matmul fusion and
keeps the fastest, but skips filling the buffers and checking each candidate's output against a
reference first (the default, level 4). On an H200 (JAX 0.11.2, bf16, 2026-12-01) that cut the
164-record HumanEval job's cold compile from 14.4 to 13.4 s plain and from 40.8 to 24.1 s with
K=3, and left decoding as it was (Llama-3.1-8B shape: 4.26 / 4.27 ms per step at B=1, 6.19 /
6.18 ms at B=64). Any autotune level already in XLA_FLAGS is kept:
XLA_FLAGS=--xla_gpu_autotune_level=4 restores XLA's checks.
"""

from __future__ import annotations

import os

AUTOTUNE_LEVEL = 1


def with_defaults(flags: str) -> str:
    """An XLA_FLAGS value with jaxspec's settings added where it names none of its own."""
    if "--xla_gpu_autotune_level" in flags:
        return flags
    return f"{flags} --xla_gpu_autotune_level={AUTOTUNE_LEVEL}".strip()


def apply(environ=os.environ) -> None:
    environ["XLA_FLAGS"] = with_defaults(environ.get("XLA_FLAGS", ""))
