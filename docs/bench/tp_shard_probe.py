"""One shard's share of a tensor-parallel-2 8B step, on one GPU and without the collectives: the
8B config with half the heads, kv heads, ffn columns and vocabulary. A lower bound on the split
step. Also the whole 8B for comparison, in the same process."""
import dataclasses
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from jaxspec.bench.scale import forward_ms
from jaxspec.bench.shapes import random_weights, shape_config, step_weight_bytes
from jaxspec.model.loading import Model

c = shape_config("llama3-8b")
half = dataclasses.replace(c, num_heads=16, num_kv_heads=4, intermediate_size=c.intermediate_size // 2,
                           vocab_size=c.vocab_size // 2)
one = np.ones((1, 1), bool)
for label, cfg in (("whole", c), ("one shard of 2", half)):
    m = Model(cfg, random_weights(cfg, jnp.bfloat16, 0), None, label, Path(label), jnp.dtype(jnp.bfloat16))
    for b in (1, 32):
        ms = forward_ms(m, b, 128, one, "pallas", steps=32, repeats=3)
        print(json.dumps({"model": label, "batch": b, "ms": round(ms, 3), "bytes": step_weight_bytes(m)}), flush=True)
    del m
