#!/usr/bin/env python3
"""Run a jaxspec command (`bench`, ...) with the 8-bit rows rule changed, to measure a rule end to
end beside the engine's own (`ROW_RULES` in jaxspec/model/forward.py):

    python3 scripts/bench_rows_rule.py --rule "fp8=1:matvec,16:matmul,xla" -- bench --shape llama3-8b ...

A rule is `FORMAT=MOST:KERNEL,...,KERNEL`: up to MOST rows that kernel (matvec, matmul, xla), the
first that holds; the last without MOST takes the rest. Formats not named keep the engine's rule.
"""

from __future__ import annotations

import argparse
import sys

from jaxspec.cli import main as jaxspec_main
from jaxspec.model import forward


def parse_rule(text: str) -> tuple[str, tuple]:
    """"fp8=1:matvec,xla" -> ("fp8", ((1, "matvec"), (None, "xla")))."""
    fmt, sep, body = text.partition("=")
    if not sep or fmt not in forward.ROW_RULES:
        raise ValueError(f"--rule must start with one of {', '.join(forward.ROW_RULES)} and '='; got {text!r}")
    steps = []
    for item in body.split(","):
        most, _, kernel = item.rpartition(":")
        if kernel not in forward.QUANTIZED_KERNELS or (most and not most.isdigit()):
            kernels = ", ".join(forward.QUANTIZED_KERNELS)
            raise ValueError(f"--rule step must be MOST:KERNEL or KERNEL with KERNEL in {kernels}; got {item!r}")
        steps.append((int(most) if most else None, kernel))
    if steps[-1][0] is not None:
        raise ValueError(f"--rule must end with a kernel for the remaining rows (no MOST); got {text!r}")
    return fmt, tuple(steps)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rule", action="append", default=[], help="FORMAT=MOST:KERNEL,...,KERNEL (repeatable)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the jaxspec command line")
    args = p.parse_args(argv)
    for text in args.rule:
        try:
            fmt, steps = parse_rule(text)
        except ValueError as e:
            p.error(str(e))
        forward.ROW_RULES[fmt] = steps
    print(f"# rows rule: {forward.ROW_RULES}", flush=True)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    return jaxspec_main(command)


if __name__ == "__main__":
    sys.exit(main())
