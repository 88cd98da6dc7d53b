"""A Hugging Face folder straight onto the devices: each tensor read from its memory-mapped
safetensors file as stored, sent to its devices in the HF layout (under tensor parallelism, each
device only its own shard), and transposed, reshaped and cast there; the layers are read in
parallel, a layer at a time per thread, so the host never holds more than a few layers and no
float32 copy of the model is ever made."""

from __future__ import annotations

import concurrent.futures
import functools
import math
import os
from pathlib import Path

import jax
from jax.sharding import Mesh
from tqdm.auto import tqdm

from jaxspec.model import layout
from jaxspec.model.checkpoint import open_hf, read_tensor
from jaxspec.model.config import ModelConfig
from jaxspec.model.sharding import named, put, spec, split_axes
from jaxspec.model.weights import ParamSpec, Weights, assemble, fuse_layer

PROGRESS_AFTER_S = 3.0  # a progress bar appears on loads that take longer than this
MAX_READERS = 8  # layers read at once: enough to keep the disk and the host-to-device copies busy


def hf_axes(p: ParamSpec) -> tuple:
    """The logical axes of the tensor as HF stores it ([out, in] where the engine keeps [in, out],
    heads flattened): each HF dimension takes the first named axis of the engine dimensions it
    flattens, so splitting it evenly hands every device whole heads (or its vocabulary or ffn
    slice), as the engine layout's split does."""
    axes = p.axes or (None,) * len(p.shape)
    dims = list(zip(p.shape, axes))
    if p.transpose:  # HF [out, in]: the engine's trailing dims, then its leading ones
        lead = next(i for i in range(len(dims) + 1) if math.prod(d for d, _ in dims[:i]) == p.hf_shape[1])
        dims = dims[lead:] + dims[:lead]
    out, i = [], 0
    for size in p.hf_shape:
        group, prod = [], 1
        while i < len(dims) and (prod < size or dims[i][0] == 1):  # size-1 dims join the group they sit in
            prod *= dims[i][0]
            group.append(dims[i][1])
            i += 1
        out.append(next((a for a in group if a is not None), None))
    return tuple(out)


@functools.partial(jax.jit, static_argnames=("transpose", "shape", "dtype", "sharding"))
def _to_engine(x, *, transpose: bool, shape: tuple, dtype, sharding):
    """An HF-layout tensor on its devices -> the engine layout, in `dtype`, on `sharding`."""
    x = (x.T if transpose else x).reshape(shape).astype(dtype)
    return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)


def _tensor(entry, config: ModelConfig, dtype, mesh: Mesh | None):
    name, (p, _, path, handle) = entry
    tp = 1 if mesh is None else mesh.size
    hf_sharding = named(mesh, spec(split_axes(hf_axes(p), config, tp)))
    engine_sharding = named(mesh, spec(split_axes(p.axes or (None,) * len(p.shape), config, tp)))
    raw = put(read_tensor(name, path, handle), hf_sharding)
    return _to_engine(raw, transpose=p.transpose, shape=p.shape, dtype=dtype, sharding=engine_sharding)


def load_hf_weights(hf_dir: str | Path, config: ModelConfig, dtype, mesh: Mesh | None = None) -> Weights:
    """The weights of a HF folder (checked first: every name and shape) in `dtype`, split over
    `mesh` (None: the default device), as weights_from_fields builds them from a checkpoint."""
    tensors = open_hf(hf_dir, config)
    by_layer: list[list] = [[] for _ in range(config.num_layers)]
    top_entries = []
    for entry in tensors.items():
        layer = entry[1][1]
        (top_entries if layer is None else by_layer[layer]).append(entry)
    mlp = layout.fuse_mlp()
    field = lambda entry: entry[1][0].field.split(".", 1)[-1]  # noqa: E731  ("layers.wq" -> "wq")

    def read_layer(entries) -> dict:
        return fuse_layer(config, {field(e): _tensor(e, config, dtype, mesh) for e in entries}, mlp)

    workers = max(1, min(MAX_READERS, os.cpu_count() or 1, config.num_layers))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool, tqdm(
        total=config.num_layers, desc=f"loading {Path(hf_dir).name}", unit="layer", delay=PROGRESS_AFTER_S,
        leave=False,
    ) as bar:
        futures = [pool.submit(read_layer, entries) for entries in by_layer]
        top = {field(e): _tensor(e, config, dtype, mesh) for e in top_entries}
        layers = []
        for f in futures:
            layers.append(f.result())
            bar.update(1)
    return assemble(config, top, layers, mesh)
