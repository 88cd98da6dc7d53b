#!/usr/bin/env python3
"""Run a jaxspec command (`bench`, ...) with the 8-bit rows rule changed, to measure a rule end to
end beside the engine's own (`DEFAULT_ROW_RULES` in jaxspec/model/forward.py):

    python3 scripts/gpu_probes/bench_rows_rule.py --rule "fp8=1:matvec,16:matmul,xla" -- bench --shape llama3-8b ...

A rule is `FORMAT=MOST:KERNEL,...,KERNEL`: up to MOST rows that kernel (matvec, matmul, xla), the
first that holds; the last without MOST takes the rest. Formats not named keep the engine's rule.
The rules reach the engine through its setting, the JAXSPEC_ROWS_RULE variable, in the command's
own process.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from jaxspec.errors import InputError
from jaxspec.model.forward import ROWS_RULE_ENV, row_rules


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rule", action="append", default=[], help="FORMAT=MOST:KERNEL,...,KERNEL (repeatable)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the jaxspec command line")
    args = p.parse_args(argv)
    env = ";".join(args.rule)
    try:
        rules = row_rules(env)
    except InputError as e:
        p.error(str(e))
    print(f"# rows rule: {rules}", flush=True)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    return subprocess.run([sys.executable, "-m", "jaxspec.cli", *command], env={**os.environ, ROWS_RULE_ENV: env}).returncode


if __name__ == "__main__":
    sys.exit(main())
