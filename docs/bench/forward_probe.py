"""Times one forward pass of t tokens (B=1, 128-token prefix, 32 passes in one jitted loop) for
named shapes, printing a JSON line per shape and t. Run it with PYTHONPATH at two checkouts to
compare engines in one session (docs/REAL_SCALE.md, run 5):

    PYTHONPATH=<checkout> python3 docs/bench/forward_probe.py LABEL llama3.2-1b:1,2 llama3-8b:1
"""
import json
import sys
import time

import numpy as np

from jaxspec.bench.scale import forward_ms
from jaxspec.bench.shapes import random_model
from jaxspec.decoding.trees import NAMED_TREES, ancestor_mask

label = sys.argv[1]
for spec in sys.argv[2:]:
    name, ts = spec.split(":")
    m = random_model(name)
    for t in ts.split(","):
        mask = ancestor_mask(NAMED_TREES[t]) if t in NAMED_TREES else np.tril(np.ones((int(t), int(t)), bool))
        t0 = time.perf_counter()
        try:
            ms = forward_ms(m, 1, 128, mask, "pallas", 32, 3)
            print(json.dumps({"variant": label, "shape": name, "t": t, "ms": round(ms, 4),
                              "wall_s": round(time.perf_counter() - t0, 1)}), flush=True)
        except Exception as e:  # a flag the runtime rejects: record it and go on
            print(json.dumps({"variant": label, "shape": name, "t": t, "error": repr(e)[:300]}), flush=True)
    del m
