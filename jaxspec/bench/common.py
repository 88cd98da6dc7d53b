"""What the benchmarks share: the machine a run was measured on, and prompts in groups."""

from __future__ import annotations

import os
import platform
import time

import jax


def machine() -> dict:
    """CPU, devices and versions, recorded beside every benchmark's numbers."""
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "cpu": cpu, "cpus": os.cpu_count(), "jax": jax.__version__, "backend": jax.default_backend(),
        "devices": [d.device_kind for d in jax.devices()], "python": platform.python_version(),
    }


def committed(tree):
    """The arrays of `tree` committed to the devices they are on, as a jitted loop hands back a
    donated cache: passed in uncommitted, its second call would compile the loop again."""
    return jax.tree.map(lambda a: jax.device_put(a, a.sharding), tree)


def best_seconds(fn, repeats: int) -> float:
    """Best wall seconds of fn() over `repeats` calls after one warm-up call (fn must block until
    its device work is done)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def groups(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]
