"""Run from the repository root on a GPU: PYTHONPATH=. python3 docs/bench/h200-xla-layout-driver.py 32 16 4

XLA's GEMM on 8-bit weights stored [n, k] (as the engine keeps them) vs [k, n], at verify and
batch row counts, us per projection and per 8B layer (timed as scripts/gpu_probes/matmul_sweep.py times)."""
import json, os, sys
sys.path.insert(0, "scripts/gpu_probes")
import jax, jax.numpy as jnp
from jax import lax
from matmul_sweep import timed, weights
from jaxspec.bench.shapes import projection_shapes, shape_config

CONV = {"int8": lambda w, d: w.astype(d), "fp8": lambda w, d: lax.bitcast_convert_type(w, jnp.float8_e4m3fn).astype(d),
        "float": lambda w, d: w}

def product(fmt, nk):
    spec = "mk,nk->mn" if nk else "mk,kn->mn"
    def f(x, w, scale):
        y = jnp.einsum(spec, x, CONV[fmt](w, x.dtype), preferred_element_type=jnp.float32)
        return (y * scale).astype(x.dtype)
    return f

shapes = projection_shapes(shape_config("llama3-8b"))
out = open(os.path.join(os.environ.get("OUT", "."), "layout_kn.jsonl"), "w")
print(jax.devices()[0].device_kind, jax.__version__, flush=True)
for rows in [int(r) for r in sys.argv[1:]] or [32, 16, 4]:
    for fmt in ("fp8", "int8", "float"):
        for nk in (True, False):
            per = {}
            for name in ("wqkv", "wo", "w_gate_up", "w_down"):
                k, n = shapes[name]
                x = jax.random.normal(jax.random.PRNGKey(0), (rows, k), jnp.bfloat16)
                scale = jnp.ones((n,), jnp.float32)
                copies = min(64, max(2, -(-(256 << 20) // (k * n))))
                w = weights(k, n, fmt, copies, nk=nk)
                per[name] = timed(product(fmt, nk), w, x, scale, 3) * 1e6
                del w
            layer = per["wqkv"] + per["wo"] + per["w_gate_up"] + per["w_down"]
            rec = {"rows": rows, "fmt": fmt, "layout": "nk" if nk else "kn", **{k: round(v, 2) for k, v in per.items()},
                   "layer_us": round(layer, 1)}
            print(json.dumps(rec), flush=True)
            out.write(json.dumps(rec) + "\n"); out.flush()
