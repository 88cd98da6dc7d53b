"""How this backend lays out and runs the layers: scanned over stacked weights on the CPU,
unrolled over separate arrays on accelerators; gate and up fused into one matmul or not."""

from __future__ import annotations

import jax


def scan_layers() -> bool:
    """Whether this backend runs the layers as a lax.scan over stacked weights (the CPU) rather
    than unrolled over separate arrays. On the project's 2-core EPYC (JAX 0.10.2) the unrolled
    graph ran a K=3 speculative round of the embedded pair in 18.9 ms against 12.3 with the scan,
    plain steps about the same (4.8 against 5.2 ms): its gate/up matmuls took 307 against 115 us
    each, the scan's slice copy having just pulled the weights into cache."""
    return jax.default_backend() == "cpu"


def stack_layers(config) -> bool:
    """Whether a model of `config` (a ModelConfig) keeps its layers stacked, weights and cache
    alike: where this backend scans them and every layer has the same parts (a mixture of
    experts with dense layers runs unrolled: no stack holds both kinds)."""
    return scan_layers() and not config.dense_layers


def fuse_mlp() -> bool:
    """Whether gate and up are one [d, 2, f] matrix on this backend. On GPUs one wider matmul per
    step is one weight read and one kernel; on the CPU the fused matrix outgrows the cache and ran
    1.6-2x slower than two (embedded target's layer, 2-core EPYC, JAX 0.10.2: 189 vs 84 us at 4
    tokens), so there they stay apart."""
    return jax.default_backend() != "cpu"
