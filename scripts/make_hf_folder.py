#!/usr/bin/env python3
"""Writes a Hugging Face folder of random weights at a named real shape (config.json, safetensors
shards and their index), to time loading at real scale without downloading a model:

    python scripts/make_hf_folder.py llama3-8b /tmp/llama3-8b [--dtype bfloat16] [--shard-gb 5]

Shapes: jaxspec.bench.shapes.SHAPES. The weights are drawn on the default device (fast on a GPU).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

from jaxspec.bench.shapes import SHAPES, shape_config
from jaxspec.model.weights import param_specs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("shape", choices=sorted(SHAPES))
    p.add_argument("out", type=Path)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--shard-gb", type=float, default=5.0, help="bytes per safetensors shard, in GB (default 5)")
    args = p.parse_args()
    config = shape_config(args.shape)
    dtype = jnp.dtype(args.dtype)
    names = []
    for spec in param_specs(config):
        layers = range(config.num_layers) if spec.per_layer else [None]
        names += [(spec.hf_name.format(i=i), spec.hf_shape, spec.field.endswith("norm")) for i in layers]
    args.out.mkdir(parents=True, exist_ok=True)
    key, shard, shard_bytes, weight_map, files = jax.random.PRNGKey(0), {}, 0, {}, []

    def flush():
        nonlocal shard, shard_bytes
        if shard:
            files.append(f"model-{len(files) + 1:05d}.safetensors")
            save_file(shard, str(args.out / files[-1]), metadata={"format": "pt"})
            weight_map.update({n: files[-1] for n in shard})
            shard, shard_bytes = {}, 0

    for name, shape, norm in names:
        key, sub = jax.random.split(key)
        x = jnp.ones(shape, dtype) if norm else (jax.random.normal(sub, shape, jnp.float32) * 0.02).astype(dtype)
        shard[name] = np.asarray(x)
        shard_bytes += shard[name].nbytes
        if shard_bytes >= args.shard_gb * 1e9:
            flush()
    flush()
    total = sum((args.out / f).stat().st_size for f in files)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (args.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    hf_config = dict(SHAPES[args.shape], architectures=["LlamaForCausalLM" if SHAPES[args.shape]["model_type"] == "llama"
                                                          else "Qwen2ForCausalLM"], torch_dtype=args.dtype)
    (args.out / "config.json").write_text(json.dumps(hf_config, indent=2))
    print(f"wrote {args.out}: {len(files)} shards, {total / 1e9:.2f} GB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
