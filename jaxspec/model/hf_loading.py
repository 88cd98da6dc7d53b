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
import jax.numpy as jnp
from jax.sharding import Mesh
from tqdm.auto import tqdm

from jaxspec.model import layout
from jaxspec.model.checkpoint import WEIGHT_SCALE, WEIGHT_SCALE_INV, channel_scales, hf_fp8_blocks, open_hf
from jaxspec.model.safetensors_files import read_tensor
from jaxspec.model.config import ModelConfig
from jaxspec.model.sharding import named, put, spec, split_axes
from jaxspec.model.quantize import (
    as_quantized,
    checkpoint_contracted,
    dequantize_blocks,
    expand_block_scales,
    quantize_in_weight_layout,
)
from jaxspec.model.weights import ParamSpec, Weights, assemble, expert_sharding, fuse_quantized_layer, join_experts

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


def split_block_scales(grid, shape: tuple, block: tuple, split: tuple) -> tuple:
    """A block-wise fp8 weight's grid of scales, ready to split over devices as the weight is
    (split: each HF axis's mesh axis or None): along a split axis expanded to one scale per row
    (or column), so each device's slice of it is its slice of the weight's even where a device's
    share cuts a block. -> (that grid, the block sizes left to expand there: 1 on split axes)."""
    left = tuple(1 if a is not None else b for a, b in zip(split, block))
    sizes = tuple(n if a is not None else g for n, g, a in zip(shape, grid.shape, split))
    return expand_block_scales(grid, sizes, tuple(b if a is not None else 1 for a, b in zip(split, block))), left


@functools.partial(jax.jit, static_argnames=("layout", "blocks", "dtype", "config", "mlp", "requantize"))
def _to_engine(raw: dict, scales: dict, grids: dict, *, layout: tuple, blocks: tuple, dtype, config: ModelConfig | None,
               mlp: bool, requantize: str | None) -> dict:
    """HF-layout tensors on their devices -> the engine layout in `dtype`, fused (fuse_layer)
    when `config` is given: one graph for every layer (and one for the top-level tensors), not
    one per tensor shape. layout: (field, transpose, engine shape) of each tensor. Tensors with
    `scales` (fp8 bits; their per-channel scales in the engine's output axes) stay 8-bit. Tensors
    with `grids` (block-wise fp8 bits; blocks: (field, block sizes left to expand) of each, see
    split_block_scales) are dequantized in float32, then rounded once: to `dtype`, or with
    `requantize` ("int8" / "fp8") every projection to 8 bits per channel from its float32 values."""
    left = dict(blocks)
    raw = {name: dequantize_blocks(a, grids[name], left[name]) if name in grids else a for name, a in raw.items()}
    out = {name: (raw[name].T if transpose else raw[name]).reshape(shape) for name, transpose, shape in layout}
    fmt = "fp8"
    if requantize:  # every projection, from float32 (dequantized, or as stored): its one rounding
        key = lambda n: n if config is None else "layers." + n  # noqa: E731 (checkpoint_contracted's name)
        quantized = {n: quantize_in_weight_layout(a.astype(jnp.float32), checkpoint_contracted(key(n)), requantize)
                     for n, a in out.items() if checkpoint_contracted(key(n))}
        out |= {n: values for n, (values, _) in quantized.items()}
        scales, fmt = {n: scale for n, (_, scale) in quantized.items()}, requantize
    out = {name: a if name in scales else a.astype(dtype) for name, a in out.items()}
    if config is not None:
        return fuse_quantized_layer(config, out, scales, mlp, fmt)
    return out | {name: as_quantized(out[name], s, fmt, checkpoint_contracted(name)) for name, s in scales.items()}


def _convert(entries, config: ModelConfig, dtype, mesh: Mesh | None, fuse: bool, block: tuple | None,
             requantize: str | None, expert_parallel: bool = False) -> dict:
    """Reads `entries` (open_hf items) onto their devices, each device only its own shard, and
    converts them there; an fp8 projection's weight_scale becomes one scale per output channel,
    split as that channel axis is; a block-wise fp8 weight's weight_scale_inv (`block` sizes)
    goes with its weight (split_block_scales). expert_parallel: each expert's tensors go whole to
    its device (a block-wise fp8 one dequantized there), and are fused there (weights.join_experts;
    load refuses a per-channel fp8 folder with it)."""
    tp = 1 if mesh is None else mesh.size
    raw, scales, grids, blocks, shapes, experts, expert_grids = {}, {}, {}, [], [], {}, {}
    for name, (p, _, path, handle) in entries:
        field = p.field.split(".", 1)[-1]  # "layers.wq" -> "wq"
        tensor = read_tensor(name, path, handle)
        if name.endswith(WEIGHT_SCALE):
            out_axes = p.axes[checkpoint_contracted(p.field):] if p.axes else ()
            scales[field] = put(channel_scales(tensor, p), named(mesh, spec(split_axes(out_axes, config, tp))))
            continue
        split = split_axes(hf_axes(p), config, tp) if tp > 1 else (None,) * len(p.hf_shape)
        owner = expert_sharding(p, config, mesh, expert_parallel)
        if name.endswith(WEIGHT_SCALE_INV) and owner:  # an expert's grid: whole, beside its expert
            expert_grids[field] = put(tensor, owner)
            continue
        if name.endswith(WEIGHT_SCALE_INV):
            grid, left = split_block_scales(tensor, p.hf_shape, block, split)
            grids[field] = put(grid, named(mesh, spec(split)))
            blocks.append((field, left))
            continue
        (experts if owner else raw)[field] = put(tensor, owner or named(mesh, spec(split)))
        shapes.append((field, p.transpose, p.shape))
    for field, grid in expert_grids.items():  # dequantized on the expert's device, rounded once below
        experts[field] = _dequantize_blocks(experts[field], grid, block)

    def convert(part: dict, scales: dict, grids: dict) -> dict:
        return _to_engine(part, scales, grids, layout=tuple(s for s in shapes if s[0] in part),
                          blocks=tuple(sorted(b for b in blocks if b[0] in grids)), dtype=dtype,
                          config=config if fuse else None, mlp=layout.fuse_mlp(), requantize=requantize)
    experts = join_experts(lambda part: convert(part, {}, {}), experts, config, mesh) if experts else {}
    return convert(raw, scales, grids) | experts


_dequantize_blocks = jax.jit(dequantize_blocks, static_argnums=2)


def load_hf_weights(hf_dir: str | Path, config: ModelConfig, dtype, mesh: Mesh | None = None,
                    requantize: str | None = None, expert_parallel: bool = False) -> Weights:
    """The weights of a HF folder (checked first: every name and shape) in `dtype`, split over
    `mesh` (None: the default device; expert_parallel: a mixture of experts by expert), as
    weights_from_fields builds them from a checkpoint. A block-wise fp8 folder (hf_fp8_blocks)
    is dequantized as it loads, a layer at a time; requantize "int8" / "fp8": the projections
    then come out 8-bit per channel, quantized from their float32 values in the same pass (never
    a whole model in float32)."""
    tensors = open_hf(hf_dir, config)
    block = hf_fp8_blocks(hf_dir)
    by_layer: list[list] = [[] for _ in range(config.num_layers)]
    top_entries = []
    for entry in tensors.items():
        layer = entry[1][1]
        (top_entries if layer is None else by_layer[layer]).append(entry)
    workers = max(1, min(MAX_READERS, os.cpu_count() or 1, config.num_layers))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool, tqdm(
        total=config.num_layers, desc=f"loading {Path(hf_dir).name}", unit="layer", delay=PROGRESS_AFTER_S,
        leave=False,
    ) as bar:
        # The first layer of each kind (dense, sparse) alone compiles its graph; the rest share
        # them, in parallel.
        convert = functools.partial(_convert, config=config, dtype=dtype, mesh=mesh, fuse=True, block=block,
                                    requantize=requantize, expert_parallel=expert_parallel)
        first = {i in config.dense_layers: i for i in reversed(range(config.num_layers))}.values()
        layers = {i: convert(by_layer[i]) for i in sorted(first)}
        bar.update(len(layers))
        futures = {i: pool.submit(convert, entries) for i, entries in enumerate(by_layer) if i not in layers}
        top = _convert(top_entries, config, dtype, mesh, False, block, requantize)
        for i, f in futures.items():
            layers[i] = f.result()
            bar.update(1)
    return assemble(config, top, [layers[i] for i in range(config.num_layers)], mesh, expert_parallel)
