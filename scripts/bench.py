#!/usr/bin/env python3
"""Benchmark plain and speculative decoding against HF transformers; same as `jaxspec bench`.

    python scripts/bench.py --prompts 20 --max-new-tokens 128 --batch-sizes 1,8 --k 2,3,4
"""

import argparse
import sys

from jaxspec.bench.main import __doc__ as DOC
from jaxspec.bench.main import add_bench_args, run_bench

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bench_args(parser)
    sys.exit(run_bench(parser.parse_args()))
