"""Where a job's start-up goes on this machine (issue 23 probe): the seconds of each step of
loading the embedded target, and how XLA compiles several decode graphs, serially against in
threads, and where a converted checkpoint's load goes.
python docs/bench/startup_probe.py load | compile | converted DIR"""

import concurrent.futures
import sys
import time
from pathlib import Path

t = time.perf_counter
T0 = t()
import jax  # noqa: E402

jax.devices()
T1 = t()
import jax.numpy as jnp  # noqa: E402

import jaxspec  # noqa: E402
from jaxspec.model.checkpoint import read_checkpoint  # noqa: E402
from jaxspec.model.config import load_config  # noqa: E402
from jaxspec.model.hf_loading import load_hf_weights  # noqa: E402
from jaxspec.model.tokenizer import load_tokenizer  # noqa: E402
from jaxspec.model.weights import weights_from_fields  # noqa: E402

T2 = t()
compiles = []
jax.monitoring.register_event_duration_secs_listener(
    lambda e, d, **k: compiles.append(d) if e == "/jax/core/compile/backend_compile_duration" else None)
HF = Path("checkpoints/hf/code-target-16m")


def load_probe():
    print(f"jax import + backend {T1 - T0:.2f} s, import jaxspec {T2 - T1:.2f} s", flush=True)
    a = t(); tok = load_tokenizer(HF); b = t()  # noqa: E702
    print(f"tokenizer {b - a:.2f} s ({type(tok).__name__})", flush=True)
    c = load_config(HF)
    for i in range(2):
        n = len(compiles); a = t()  # noqa: E702
        w = load_hf_weights(HF, c, jnp.bfloat16)
        jax.block_until_ready(w); b = t()  # noqa: E702
        print(f"weights load {i}: {b - a:.2f} s, {len(compiles) - n} compiles, {sum(compiles[n:]):.2f} s compiling",
              flush=True)
    a = t(); jaxspec.load(HF); b = t()  # noqa: E702
    print(f"jaxspec.load again: {b - a:.2f} s", flush=True)


def compile_probe():
    from jaxspec.decoding.loop import decode
    from jaxspec.decoding.method import DecodeMethod
    from jaxspec.serving.batching import cache_capacity, make_batch
    from jaxspec.serving.requests import Request, SamplingSettings

    target = jaxspec.load(HF)
    loop, params = DecodeMethod().loop(target.config, None)

    def lowered(p, mo):
        b = make_batch([Request((1, 2, 3), mo, SamplingSettings(), 0)], 16, p, 0)
        return decode.lower(target.weights, params, b, loop=loop, capacity=cache_capacity(p, mo, 0), max_out=mo,
                            greedy_only=True, attention="pallas")

    a = t(); ls = [lowered(p, 64) for p in (16, 32, 64, 128, 256, 512)]; b = t()  # noqa: E702
    print(f"lowering 6 graphs {b - a:.2f} s", flush=True)
    for lo in ls[:2]:
        a = t(); lo.compile(); print(f"one compile {t() - a:.2f} s", flush=True)  # noqa: E702
    a = t()
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        list(ex.map(lambda lo: lo.compile(), ls[2:]))
    print(f"4 compiles in 4 threads {t() - a:.2f} s", flush=True)


def converted_probe(folder):
    folder = Path(folder)
    c = load_config(folder)
    a = t(); fields = read_checkpoint(folder, c); b = t()  # noqa: E702
    print(f"orbax restore to the host {b - a:.2f} s ({sum(f.nbytes for f in fields.values()) / 1e9:.2f} GB)", flush=True)
    w = weights_from_fields(c, fields, jnp.bfloat16)
    jax.block_until_ready(w); d = t()  # noqa: E702
    print(f"weights_from_fields {d - b:.2f} s", flush=True)
    del w, fields
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    a = t(); fields = read_checkpoint(folder, c, {f: one for f in ("embed",)} | _all(c, one)); b = t()  # noqa: E702
    jax.block_until_ready(fields)
    print(f"orbax restore straight to the device {t() - a:.2f} s", flush=True)
    w = weights_from_fields(c, fields, jnp.bfloat16)
    jax.block_until_ready(w)
    print(f"weights_from_fields from device arrays {t() - b:.2f} s", flush=True)


def _all(config, sharding):
    from jaxspec.model.weights import param_specs

    return {p.field: sharding for p in param_specs(config)}


{"load": load_probe, "compile": compile_probe, "converted": lambda: converted_probe(sys.argv[2])}[sys.argv[1]]()
