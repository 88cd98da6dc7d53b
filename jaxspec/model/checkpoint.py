"""Checkpoint I/O: Hugging Face safetensors in, the engine's Orbax checkpoint out, and loading.

A converted checkpoint is a folder holding `jaxspec.json` (format marker), the HF `config.json`
and tokenizer files, and `weights/` (Orbax, one array per weight in the engine's layout, layers
stacked). Only safetensors are ever read: never pickles.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import numpy as np

from jaxspec.errors import CheckpointError
from jaxspec.model.config import ModelConfig, load_config
from jaxspec.model.eagle import convert_eagle, is_eagle3
from jaxspec.model.quantize import (
    SCALE,
    STORED_DTYPES,
    block_grid,
    check_scheme,
    checkpoint_contracted,
    dequantize_blocks,
    quantize_checkpoint,
)
from jaxspec.model.safetensors_files import FP8_E4M3, open_all, read_tensor  # noqa: F401 (public here too)
from jaxspec.model.weights import ParamSpec, param_specs

FORMAT = "jaxspec-orbax-v1"
MARKER = "jaxspec.json"
# Files copied beside the weights so a converted checkpoint is self-contained.
SIDE_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja",
)
# Buffers some exporters save that are not parameters (recomputed from the config).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _safetensors_files(hf_dir: Path) -> list[Path]:
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index} is corrupt: {e}") from None
        files = [hf_dir / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"shard {f.name} listed in {index.name} is missing from {hf_dir}")
        return files
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in hf_dir.glob("*.bin")) + sorted(p.name for p in hf_dir.glob("*.pt"))
        hint = f" (found {', '.join(pickles)}: pickle files are never loaded; convert them to safetensors)" if pickles else ""
        raise CheckpointError(f"no *.safetensors files in {hf_dir}{hint}")
    return files


def _expected(config: ModelConfig) -> dict[str, tuple[ParamSpec, int | None]]:
    """HF tensor name -> (spec, layer index or None)."""
    out: dict[str, tuple[ParamSpec, int | None]] = {}
    for spec in param_specs(config):
        if spec.per_layer:
            for i in spec.held_by(config.num_layers):
                out[spec.hf_name.format(i=i)] = (spec, i)
        else:
            out[spec.hf_name] = (spec, None)
    return out


WEIGHT_SCALE, INPUT_SCALE = ".weight_scale", ".input_scale"  # beside an fp8 projection's ".weight"
WEIGHT_SCALE_INV = ".weight_scale_inv"  # beside a block-wise fp8 weight: its grid of scales (hf_fp8_blocks)
SUPPORTED_FP8 = (
    "jaxspec reads fp8 e4m3 weights with per-tensor or per-channel scales (quant_method \"fp8\", or "
    "\"compressed-tensors\" with 8-bit float weights by tensor or channel), or with block-wise scales "
    "(quant_method \"fp8\" with weight_block_size [rows, columns] and activation_scheme \"dynamic\")")


def _quantization_config(hf_dir: str | Path) -> dict | None:
    try:
        return json.loads((Path(hf_dir) / "config.json").read_text()).get("quantization_config") or None
    except (OSError, json.JSONDecodeError):
        return None  # load_config reports a missing or corrupt config.json


def hf_quantization(hf_dir: str | Path) -> str | None:
    """"fp8" when the folder's config.json declares fp8 e4m3 weights with per-tensor or
    per-channel scales (quant_method "fp8", or "compressed-tensors" with 8-bit float weights by
    tensor or channel), as vLLM reads them: their bits are kept. None when it declares none, or
    block-wise scales (hf_fp8_blocks: those are dequantized as they load); other schemes are
    refused by name. Activation scales (input_scale) are ignored: activations stay in the model's
    dtype."""
    qc = _quantization_config(hf_dir)
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "fp8":
        return None if hf_fp8_blocks(hf_dir) else "fp8"
    detail = f"quant_method {method!r}"
    if method == "compressed-tensors":
        groups = [g.get("weights") or {} for g in (qc.get("config_groups") or {}).values()]
        unsupported = [w for w in groups if not (w.get("num_bits") == 8 and w.get("type") == "float"
                                                  and w.get("strategy") in ("tensor", "channel"))]
        if groups and not unsupported:
            return "fp8"
        if unsupported:
            w = unsupported[0]
            detail += (f" and weights num_bits {w.get('num_bits')!r}, type {w.get('type')!r}, "
                       f"strategy {w.get('strategy')!r}")
    raise CheckpointError(f"{Path(hf_dir) / 'config.json'}: quantization_config with {detail} is not supported; "
                          f"{SUPPORTED_FP8}")


def hf_fp8_blocks(hf_dir: str | Path) -> tuple[int, int] | None:
    """(rows, columns) of each scale's block when the folder's config.json declares fp8 e4m3
    weights with block-wise scales (quant_method "fp8" with weight_block_size, as Qwen3-*-FP8 and
    DeepSeek-V3 publish them: weight [out, in] in F8_E4M3 beside weight_scale_inv, one float32 per
    block); None otherwise. Anything but two positive block sizes, or activation scales other
    than dynamic ones (no published checkpoint has them; vLLM refuses them too), is refused."""
    qc = _quantization_config(hf_dir)
    if not qc or qc.get("quant_method") != "fp8" or qc.get("weight_block_size") is None:
        return None
    where = f"{Path(hf_dir) / 'config.json'}: quantization_config"
    block = qc["weight_block_size"]
    if not (isinstance(block, list) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise CheckpointError(f"{where}.weight_block_size must be two positive integers [rows, columns], as "
                              f"[128, 128]; got {block!r}")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise CheckpointError(f"{where}.activation_scheme {qc['activation_scheme']!r} with weight_block_size is not "
                              f"supported; block-wise fp8 is read with activation_scheme \"dynamic\"")
    if qc.get("fmt", "e4m3") != "e4m3":
        raise CheckpointError(f"{where}.fmt {qc['fmt']!r} is not supported; block-wise fp8 is read in \"e4m3\"")
    return tuple(block)


def _fp8_scales(found: dict, expected: dict, blocks: tuple | None) -> dict:
    """HF name of each fp8 weight's scale -> (spec, layer): a projection's weight_scale, or with
    `blocks` any linear weight's weight_scale_inv (experts' and the router's too: they are
    dequantized, so any [out, in] weight may be block-wise)."""
    suffix = WEIGHT_SCALE_INV if blocks else WEIGHT_SCALE
    scales = {}
    for name, (spec, layer) in expected.items():
        base = name.removesuffix(".weight")
        if (spec.transpose if blocks else checkpoint_contracted(spec.field)) and base + suffix in found:
            scales[base + suffix] = (spec, layer)
    return scales


def open_hf(hf_dir: str | Path, config: ModelConfig, framework: str = "numpy") -> dict[str, tuple]:
    """HF tensor name -> (spec, layer index or None, file, open safetensors handle) for every
    tensor the config implies, after checking every name and shape in the folder (before any
    data is read); the error names the offending tensor and file. An fp8 folder (hf_quantization)
    adds each fp8 projection's weight_scale (name ending WEIGHT_SCALE, its projection's spec); a
    block-wise one (hf_fp8_blocks) each fp8 weight's grid of scales (WEIGHT_SCALE_INV)."""
    hf_dir = Path(hf_dir)
    found = open_all(_safetensors_files(hf_dir), framework)
    expected = _expected(config)
    blocks = hf_fp8_blocks(hf_dir)
    suffix = WEIGHT_SCALE_INV if blocks else WEIGHT_SCALE
    scales = _fp8_scales(found, expected, blocks) if blocks or hf_quantization(hf_dir) else {}
    tied_head = config.tie_word_embeddings and "lm_head.weight" in found
    unexpected = [
        n for n in found
        if n not in expected and n not in scales and not n.endswith(IGNORED_SUFFIXES)
        and not (tied_head and n == "lm_head.weight") and not (scales and n.endswith(INPUT_SCALE))
    ]
    if unexpected:
        raise CheckpointError(
            f"unexpected tensor(s) for model_type {config.model_type!r}: {', '.join(sorted(unexpected)[:5])}"
            + (f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else "")
        )
    missing = [n for n in expected if n not in found]
    if missing:
        raise CheckpointError(
            f"missing tensor(s) in {hf_dir}: {', '.join(missing[:5])}"
            + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        )
    for name, (spec, _) in expected.items():
        path, handle = found[name]
        shape = tuple(handle.get_slice(name).get_shape())
        if shape != spec.hf_shape:
            raise CheckpointError(
                f"tensor {name} in {path.name} has shape {shape}; the config implies {spec.hf_shape}"
            )
        fp8 = handle.get_slice(name).get_dtype() == FP8_E4M3
        if fp8 != (name.removesuffix(".weight") + suffix in scales):
            raise CheckpointError(f"tensor {name} in {path.name} is {'fp8 without' if fp8 else 'not fp8 but has'} a "
                                  f"{suffix.lstrip('.')}: an fp8 weight needs its scale and only it")
    # Per-channel fp8 stays 8-bit, stacked over layers: one dtype per field. Block-wise fp8 is
    # dequantized tensor by tensor, so its layers may differ.
    mixed = set() if blocks else {spec.field for spec, _ in scales.values()} & {
        spec.field for name, (spec, _) in expected.items() if name.removesuffix(".weight") + suffix not in scales}
    if mixed:
        raise CheckpointError(f"{hf_dir}: {', '.join(sorted(mixed))} are fp8 in some layers only; "
                              "a projection must be fp8 in every layer or in none")
    for name, (spec, _) in scales.items():
        path, handle = found[name]
        shape = tuple(handle.get_slice(name).get_shape())
        if blocks and shape != block_grid(spec.hf_shape, blocks):
            raise CheckpointError(
                f"tensor {name} in {path.name} has shape {shape}; weight_block_size {list(blocks)} over its weight "
                f"{name.removesuffix(suffix)}.weight of shape {spec.hf_shape} implies {block_grid(spec.hf_shape, blocks)}")
        if not blocks and int(np.prod(shape)) not in (1, spec.hf_shape[0]):
            raise CheckpointError(f"tensor {name} in {path.name} has {int(np.prod(shape))} scales; per-tensor (1) or "
                                  f"per-channel ({spec.hf_shape[0]}) are supported")
    return {name: (spec, layer, *found[name]) for name, (spec, layer) in (expected | scales).items()}


def channel_scales(scale: np.ndarray, spec: ParamSpec) -> np.ndarray:
    """An fp8 projection's weight_scale (per tensor or per output channel) as one float32 scale
    per output channel, in the engine's output axes (spec.shape past the contracted ones)."""
    out_shape = spec.shape[checkpoint_contracted(spec.field):]
    flat = np.asarray(scale, np.float32).reshape(-1)
    return np.broadcast_to(flat, (int(np.prod(out_shape)),)).reshape(out_shape)


def read_hf_weights(hf_dir: str | Path, config: ModelConfig, dtype=None, projections=None) -> dict[str, np.ndarray]:
    """Reads and validates a HF safetensors checkpoint into host arrays in the engine's
    checkpoint layout (layers stacked), in `dtype` (None: the source's): what conversion writes.
    A block-wise fp8 folder's weights are dequantized in float32 and rounded once, to `dtype` (None:
    that of its floating-point weights); projections: the projections' dtype instead (float32 for
    quantize_checkpoint to requantize them from, rounding once)."""
    tensors = open_hf(hf_dir, config)
    blocks = hf_fp8_blocks(hf_dir)
    if blocks and dtype is None:  # embeddings are never fp8 (not linear weights): their dtype is the source's
        _, _, path, handle = tensors["model.embed_tokens.weight"]
        dtype = handle.get_slice("model.embed_tokens.weight")[:1].dtype
    # Each field is allocated once, stacked over layers, and filled tensor by tensor (cast on the
    # way in): a checkpoint of many shards never sits in host memory twice. An fp8 folder's
    # projections stay 8-bit (their bits), with float32 scales under the field's name + SCALE.
    fields: dict[str, np.ndarray] = {}
    for name, (spec, layer, path, handle) in tensors.items():
        if name.endswith(WEIGHT_SCALE_INV):
            continue  # read with its weight
        arr = read_tensor(name, path, handle)
        scale_inv = name.removesuffix(".weight") + WEIGHT_SCALE_INV
        if scale_inv in tensors:
            arr = dequantize_blocks(arr, read_tensor(scale_inv, *tensors[scale_inv][2:]), blocks)
        field = spec.field
        if name.endswith(WEIGHT_SCALE):
            arr, field = channel_scales(arr, spec), spec.field + SCALE
        else:
            arr = (arr.T if spec.transpose else arr).reshape(spec.shape)
        held = spec.held_by(config.num_layers)
        if field not in fields:
            shape = ((len(held),) if layer is not None else ()) + arr.shape
            keep = arr.dtype == np.uint8 or field.endswith(SCALE) or dtype is None
            want = projections if projections is not None and checkpoint_contracted(field) else dtype
            fields[field] = np.empty(shape, arr.dtype if keep else np.dtype(want))
        if layer is None:
            fields[field][...] = arr
        else:
            fields[field][held.index(layer)] = arr
        del arr
    return fields


def _abstract_fields(config: ModelConfig, dtype, shardings: dict | None, quantize: str | None = None,
                     quantized: tuple = ()) -> dict[str, jax.ShapeDtypeStruct]:
    """What a checkpoint holds: every field in `dtype`, but the `quantized` ones: their 8-bit
    values (in `quantize`) and float32 scales (jaxspec.model.quantize)."""
    out = {}
    where = lambda name: None if shardings is None else shardings[name]  # noqa: E731
    for spec in param_specs(config):
        lead = (len(spec.held_by(config.num_layers)),) if spec.per_layer else ()
        contract = checkpoint_contracted(spec.field) if spec.field in quantized else None
        stored = STORED_DTYPES[quantize] if contract else np.dtype(dtype)
        out[spec.field] = jax.ShapeDtypeStruct(lead + spec.shape, stored, sharding=where(spec.field))
        if contract:
            out[spec.field + SCALE] = jax.ShapeDtypeStruct(lead + spec.shape[contract:], np.float32,
                                                           sharding=where(spec.field + SCALE))
    return out


def _checkpointer():
    import orbax.checkpoint as ocp

    return ocp.StandardCheckpointer()


def write_checkpoint(fields: dict[str, np.ndarray], source_dir: str | Path, out_dir: str | Path,
                     quantize: str | None = None) -> Path:
    """Writes fields with Orbax plus the side files of source_dir; returns out_dir. quantize: the
    projections are 8-bit values with their scales (quantize_checkpoint's fields)."""
    out_dir = Path(out_dir).absolute()
    source_dir = Path(source_dir)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    quantized = [name for name in fields if checkpoint_contracted(name) and name + SCALE in fields]
    eight_bit = set(quantized) | {name + SCALE for name in quantized}
    dtypes = {str(a.dtype) for name, a in fields.items() if name not in eight_bit}
    if len(dtypes) != 1:
        raise CheckpointError(f"weights must share one dtype to be saved; got {sorted(dtypes)}")
    ckptr = _checkpointer()
    ckptr.save(out_dir / "weights", {k: np.ascontiguousarray(a) for k, a in fields.items()})
    ckptr.wait_until_finished()
    for name in SIDE_FILES:
        if (source_dir / name).is_file():
            shutil.copy2(source_dir / name, out_dir / name)
    marker = {"format": FORMAT, "dtype": dtypes.pop(), "source": source_dir.name}
    if quantize:
        marker |= {"quantize": quantize, "quantized": quantized}
    (out_dir / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    return out_dir


def read_checkpoint(ckpt_dir: str | Path, config: ModelConfig, shardings: dict | None = None) -> dict:
    """field -> array: host arrays, or with `shardings` (field -> jax.sharding.Sharding) device
    arrays restored straight into those shards (each host reads only its own devices' part)."""
    ckpt_dir = Path(ckpt_dir).absolute()
    marker = _marker(ckpt_dir)
    target = _abstract_fields(config, jax.numpy.dtype(marker["dtype"]), shardings, marker.get("quantize"),
                              tuple(marker.get("quantized", ())))
    ckptr = _checkpointer()
    _check_stored(ckptr, ckpt_dir / "weights", target)
    try:
        restored = ckptr.restore(ckpt_dir / "weights", target)
    except Exception as e:
        raise CheckpointError(f"cannot restore Orbax weights from {ckpt_dir / 'weights'}: {e}") from None
    return restored if shardings is not None else {k: np.asarray(v) for k, v in restored.items()}


def _check_stored(ckptr, weights_dir: Path, target: dict[str, jax.ShapeDtypeStruct]) -> None:
    """Refuses, by field, what the checkpoint's metadata says does not fit `target` (a missing or
    unexpected field, a shape or dtype other than the config and marker imply), before any array
    is read: Orbax's own refusal of a shape names no field and leaves its read tasks behind."""
    try:
        meta = ckptr.metadata(weights_dir)
    except Exception as e:
        raise CheckpointError(f"cannot read Orbax metadata from {weights_dir}: {e}") from None
    item = getattr(meta, "item_metadata", meta)  # a StepMetadata, or (older Orbax) the item's metadata itself
    stored = getattr(item, "tree", item)
    missing = sorted(set(target) - set(stored))
    if missing:
        raise CheckpointError(f"field(s) {', '.join(missing)} missing from {weights_dir}")
    unexpected = sorted(set(stored) - set(target))
    if unexpected:
        raise CheckpointError(f"unexpected field(s) {', '.join(unexpected)} in {weights_dir}: not weights of this "
                              f"model's config and {MARKER}")
    for name, want in target.items():
        got = stored[name]
        shape, dtype = tuple(got.shape), np.dtype(got.dtype)
        if shape != tuple(want.shape) or dtype != np.dtype(want.dtype):
            raise CheckpointError(f"field {name} in {weights_dir} has shape {shape} {dtype}; the config and "
                                  f"{MARKER} imply {tuple(want.shape)} {np.dtype(want.dtype)}")


def is_converted(path: str | Path) -> bool:
    return (Path(path) / MARKER).is_file()


def _marker(ckpt_dir: Path) -> dict:
    """A converted checkpoint's jaxspec.json, checked to be this format's."""
    try:
        marker = json.loads((ckpt_dir / MARKER).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{ckpt_dir / MARKER} is missing or corrupt: {e}") from None
    if marker.get("format") != FORMAT:
        raise CheckpointError(f"{ckpt_dir / MARKER}: format {marker.get('format')!r}, expected {FORMAT!r}")
    return marker


def stored_quantization(path: str | Path) -> tuple[str | None, tuple[str, ...]]:
    """(the 8-bit scheme a converted checkpoint stores projections in, which fields); (None, ())
    when it stores every weight in its dtype."""
    marker = _marker(Path(path))
    scheme, fields = marker.get("quantize"), tuple(marker.get("quantized", ()))
    if scheme is not None and scheme not in STORED_DTYPES:
        raise CheckpointError(f"{Path(path) / MARKER}: quantize {scheme!r} is not one of {', '.join(STORED_DTYPES)}")
    if not all(checkpoint_contracted(f) for f in fields):
        raise CheckpointError(f"{Path(path) / MARKER}: quantized fields {sorted(fields)} are not all projections")
    return scheme, fields


def _check_out_dir(out_dir: Path) -> None:
    """Refuses an output folder that is, or lies under, an existing file, before any weights are
    read (mkdir and rmtree would fail there with a bare OSError after the whole read)."""
    for p in (out_dir, *out_dir.parents):
        if p.exists():
            if not p.is_dir():
                where = "is" if p == out_dir else f"lies under {p}, which is"
                raise CheckpointError(f"output folder {out_dir} {where} an existing file: name a folder to write")
            return


def convert_hf_checkpoint(hf_dir: str | Path, out_dir: str | Path, dtype: str | None = None,
                          quantize: str | None = None) -> Path:
    """HF folder -> converted checkpoint folder; dtype None keeps the source dtype; quantize
    "int8" / "fp8" stores the projections in 8 bits (a load then reads about half the bytes)."""
    check_scheme(quantize)
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise CheckpointError(f"HF checkpoint folder {hf_dir} does not exist")
    _check_out_dir(Path(out_dir))
    if is_eagle3(hf_dir):
        if quantize:
            raise CheckpointError(f"{hf_dir} is an EAGLE-3 head: quantize applies to models; heads stay in "
                                  f"floating point (their step reads a fifth of a 1B draft's bytes)")
        return convert_eagle(hf_dir, out_dir, dtype)
    config = load_config(hf_dir)
    stored = hf_quantization(hf_dir)
    if stored and quantize and quantize != stored:
        raise CheckpointError(f"{hf_dir} stores its projections in {stored}: convert it with --quantize {stored} or none")
    # Block-wise fp8 asked for 8 bits is requantized per channel from its float32 weights: one rounding.
    projections = np.float32 if quantize and hf_fp8_blocks(hf_dir) else None
    fields = read_hf_weights(hf_dir, config, None if dtype is None else jax.numpy.dtype(dtype), projections)
    if quantize and not stored:
        fields = quantize_checkpoint(fields, quantize)
    return write_checkpoint(fields, hf_dir, out_dir, quantize or stored)
