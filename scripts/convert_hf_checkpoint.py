#!/usr/bin/env python3
"""Convert a Hugging Face checkpoint (config.json + safetensors) to a jaxspec Orbax checkpoint.

    python scripts/convert_hf_checkpoint.py HF_DIR [OUT_DIR] [--dtype bfloat16] [--quantize int8|fp8]
"""

import argparse
import sys

from jaxspec.cli import add_convert_args, run_convert
from jaxspec.errors import JaxspecError

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_convert_args(parser)
    try:
        sys.exit(run_convert(parser.parse_args()))
    except JaxspecError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
