"""Where a jitted step's device time goes: a JAX profiler trace of a few calls, its GPU kernels
summed by name (numbered copies of one fusion or kernel counted together), per step.

Used by scripts/gpu_probes/deterministic_cost.py --kernels. Only accelerators' planes hold kernels: on the
CPU the table is empty.
"""

from __future__ import annotations

import collections
import re
import tempfile
from pathlib import Path

import jax
from jax.profiler import ProfileData

_NUMBERED = re.compile(r"([._]\d+)+$")  # loop_add_fusion_12, gemm_fusion_dot.3 -> one name


def kernel_name(name: str) -> str:
    return _NUMBERED.sub("", name)


def kernel_times(run, calls: int, steps_per_call: int) -> list[tuple[str, float, float]]:
    """[(kernel name, us per step, launches per step)], longest first, over `calls` calls of
    run() (already compiled and warm) of steps_per_call steps each."""
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(calls):
                run()
        traces = sorted(Path(d).rglob("*.xplane.pb"))
        if not traces:
            raise RuntimeError(f"the profiler wrote no trace under {d}")
        data = ProfileData.from_file(str(traces[-1]))
        total_ns, count = collections.Counter(), collections.Counter()
        for plane in data.planes:
            if not plane.name.startswith("/device:"):
                continue
            for line in plane.lines:
                if not line.name.startswith("Stream"):  # the other lines regroup the same kernels
                    continue
                for event in line.events:
                    total_ns[kernel_name(event.name)] += event.duration_ns
                    count[kernel_name(event.name)] += 1
    steps = calls * steps_per_call
    return [(name, ns / 1e3 / steps, count[name] / steps) for name, ns in total_ns.most_common()]


def kernel_table(rows: list[tuple[str, float, float]], top: int) -> str:
    """Markdown: the top kernels, then the total of all of them."""
    lines = ["| kernel | us / step | launches / step |", "| --- | --- | --- |"]
    lines += [f"| {name[:90]} | {us:.1f} | {n:.1f} |" for name, us, n in rows[:top]]
    lines.append(f"| all ({len(rows)} names) | {sum(r[1] for r in rows):.1f} | {sum(r[2] for r in rows):.1f} |")
    return "\n".join(lines)
