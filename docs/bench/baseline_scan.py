"""Baseline for docs/REAL_SCALE.md: the engine as it was at commit 55b7a1d (layers stacked, run by a
lax.scan), at the Llama-3.1-8B / Llama-3.2-1B shapes with random bf16 weights, timed as
jaxspec.bench.scale times plain decoding (decode time minus prefill time, over steps or rounds).

    mkdir -p .scratch/baseline && git archive 55b7a1d jaxspec pallas_kernels | tar -x -C .scratch/baseline
    python docs/bench/baseline_scan.py      # on the GPU machine, from the repository root
"""
import dataclasses
import functools
import json
import sys
import time

sys.path.insert(0, ".scratch/baseline")
import jax
import jax.numpy as jnp
import numpy as np

import jaxspec
from jaxspec.decoding.state import prefill
from jaxspec.model.config import config_from_hf
from jaxspec.model.loading import Model
from jaxspec.model.weights import param_specs, weights_from_fields
from jaxspec.serving.generate import build_requests
from jaxspec.serving.batching import bucket, cache_capacity, make_batch

assert "scratch/baseline" in jaxspec.__file__, jaxspec.__file__
ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}
LLAMA = {"model_type": "llama", "vocab_size": 128256, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
         "max_position_embeddings": 131072, "num_key_value_heads": 8, "num_attention_heads": 32}
SHAPES = {  # as jaxspec.shapes.SHAPES
    "llama3-8b": LLAMA | {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                          "head_dim": 128, "rope_scaling": ROPE, "tie_word_embeddings": False},
    "llama3.2-1b": LLAMA | {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                            "head_dim": 64, "rope_scaling": ROPE | {"factor": 32.0}, "tie_word_embeddings": True},
}

def model(name, seed):
    c = dataclasses.replace(config_from_hf(SHAPES[name]), eos_token_ids=(), bos_token_id=None)
    key = jax.random.PRNGKey(seed)
    fields = {}
    for s in param_specs(c):
        shape = ((c.num_layers,) if s.per_layer else ()) + s.shape
        key, sub = jax.random.split(key)
        fields[s.field] = jnp.ones(shape, jnp.bfloat16) if s.field.endswith("norm") else (0.02 * jax.random.normal(sub, shape, jnp.float32)).astype(jnp.bfloat16)
    return Model(c, weights_from_fields(fields), None, name, name, jnp.dtype(jnp.bfloat16))

def best(f, r=2):
    f(); b = 1e9
    for _ in range(r):
        t0 = time.perf_counter(); f(); b = min(b, time.perf_counter() - t0)
    return b

def prefill_s(m, prompts, new, slack):
    reqs = build_requests(prompts, m, new, 0.0, 0, 1.0, 0)
    P = bucket(len(prompts[0])); batch = make_batch(reqs, bucket(len(prompts), 1), P, 0)
    f = jax.jit(functools.partial(prefill, config=m.config, capacity=cache_capacity(P, bucket(new), slack), dtype=m.dtype))
    return best(lambda: jax.block_until_ready(f(m.weights, batch=batch)))

t = model("llama3-8b", 0); d = model("llama3.2-1b", 1)
rng = np.random.default_rng(0); N = 256
for B, K in [(1, 0), (64, 0), (1, 3)]:
    prompts = rng.integers(1, t.config.vocab_size, (B, 128)).tolist()
    kw = dict(draft=d, num_draft_tokens=K) if K else {}
    call = lambda: jaxspec.generate(prompts, t, max_new_tokens=N, max_batch_size=B, warn_below_acceptance=0, attention="pallas", **kw)
    first = call(); outs = min((call() for _ in range(2)), key=lambda o: o.metrics.decode_s)
    pre = prefill_s(t, prompts, N, (K + 2) if K else 0) + (prefill_s(d, prompts, N, K + 2) if K else 0)
    steps = sum(o.stats.target_steps - 1 for o in outs) / B
    print(json.dumps({"baseline": "stacked+scan", "batch": B, "K": K, "compile_s": first.metrics.compile_s,
                      "ms_per_step_or_round": 1000 * (outs.metrics.decode_s - pre) / steps}), flush=True)
