"""`jaxspec.load`: a converted checkpoint (fast path) or a Hugging Face folder, ready to run."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxspec import compile_cache
from jaxspec.errors import CheckpointError, InputError
from jaxspec.graphs import GraphCache
from jaxspec.model.checkpoint import (
    hf_fp8_blocks,
    hf_quantization,
    is_converted,
    read_checkpoint,
    stored_quantization,
)
from jaxspec.model.config import ModelConfig, load_config
from jaxspec.model.hf_loading import load_hf_weights
from jaxspec.model.tokenizer import load_tokenizer
from jaxspec.model.sharding import (
    check_expert_parallel,
    check_tensor_parallel,
    make_mesh,
    replicate,
    serving_config,
)
from jaxspec.model.eagle import EagleHead, is_eagle3, load_eagle
from jaxspec.model.quantize import check_scheme
from jaxspec.model.weights import Weights, field_shardings, quantize_weights, weights_from_fields

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def default_dtype():
    """bfloat16 on accelerators, float32 on the CPU (where bf16 matmuls are slow)."""
    return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16


@dataclasses.dataclass(frozen=True, eq=False)
class Model:
    config: ModelConfig
    weights: Weights  # arrays in `dtype`, on the default device
    tokenizer: object | None  # tokenizer.load_tokenizer's: encode/decode as transformers', None without one
    name: str  # folder name, logged as the model id
    path: Path
    dtype: jnp.dtype
    mesh: object = None  # the jax.sharding.Mesh its arrays are on (split or whole); None: the default device
    graphs: GraphCache = dataclasses.field(default_factory=GraphCache)  # compiled graphs run with it as target
    quantize: str | None = None  # "int8" / "fp8": its projections in 8 bits (jaxspec.model.quantize)

    @property
    def tensor_parallel(self) -> int:
        return 1 if self.weights.mesh is None else self.weights.mesh.size

    @property
    def expert_parallel(self) -> bool:
        """Its experts split by expert over its devices (False when whole or split by columns)."""
        return self.weights.expert_parallel


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # "org/name", as the Hugging Face hub names models
HUB_FILES = ["*.json", "*.safetensors", "tokenizer.model", "merges.txt", "vocab.txt", "*.jinja"]


def model_folder(path: str | Path) -> tuple[Path, str]:
    """(folder, model name): a folder as given, or for a hub id ("org/name") that is no folder
    here, its snapshot in the Hugging Face cache ($HF_HUB_CACHE), downloaded first where the
    network allows."""
    folder = Path(path)
    if folder.is_dir():
        return folder, folder.name
    if not HUB_ID.match(str(path)):
        raise CheckpointError(f"model folder {path} does not exist (nor is it a hub id such as org/name)")
    from huggingface_hub import snapshot_download  # with transformers; only hub ids need it
    from huggingface_hub.errors import LocalEntryNotFoundError

    kw = dict(repo_id=str(path), cache_dir=os.environ.get("HF_HUB_CACHE"), allow_patterns=HUB_FILES)
    try:
        return Path(snapshot_download(local_files_only=True, **kw)), str(path)
    except LocalEntryNotFoundError:
        if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
            raise CheckpointError(f"model {str(path)!r} is no folder here and not in the Hugging Face cache "
                                  "(HF_HUB_OFFLINE is set: no download)") from None
    try:
        return Path(snapshot_download(**kw)), str(path)
    except Exception as e:  # offline, unknown id, no access: the hub raises many kinds
        raise CheckpointError(
            f"model {str(path)!r} is no folder here and not in the Hugging Face cache, and the hub could not "
            f"provide it ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        ) from None


def load(path: str | Path, dtype: str | jnp.dtype | None = None, tensor_parallel: int = 1,
         quantize: str | None = None, expert_parallel: bool = False) -> Model:
    """Loads a model folder: converted (has jaxspec.json) or HF (config.json + *.safetensors), or a
    Hugging Face hub id ("meta-llama/Llama-3.1-8B") from the hub's cache (downloaded if need be).

    dtype: compute dtype, "float32" / "bfloat16" / "float16"; default float32 on CPU, bf16 on GPU.
    tensor_parallel: split the model over this many devices (the first N of jax.devices(), over
    all hosts under jax.distributed), by heads, ffn columns and vocabulary (jaxspec.model.sharding).
    A converted checkpoint is restored straight into each device's shards.
    expert_parallel: a mixture of experts' experts split by expert instead (vLLM's
    enable_expert_parallel): each of the tensor_parallel devices holds E / tensor_parallel whole
    experts and runs the tokens routed to them; attention stays split by heads.
    quantize: "int8" or "fp8" (e4m3fn): the projections (a mixture of experts' experts too) in 8
    bits with a float32 scale per output channel, embeddings, norms and routers in `dtype`
    (jaxspec.model.quantize); decode steps then read about half the bytes.
    """
    check_scheme(quantize)
    path, name = model_folder(path)
    compile_cache.enable()  # on by default (jaxspec.compile_cache): graphs compiled once per machine
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise InputError(f"dtype {dtype!r} is not supported; allowed: {', '.join(DTYPES)}")
        dtype = DTYPES[dtype]
    dtype = jnp.dtype(dtype or default_dtype())
    if is_eagle3(path):
        if tensor_parallel != 1 or quantize is not None or expert_parallel is not False:
            raise InputError(f"{path.name} is an EAGLE-3 head: it loads whole and unquantized (tensor_parallel=1, "
                             "quantize=None, expert_parallel=False) and drafts for a target that may be split or "
                             "quantized")
        return load_eagle(path, dtype)
    config = load_config(path)
    expert_parallel = check_expert_parallel(config, expert_parallel, path.name)
    tp = check_tensor_parallel(config, tensor_parallel, path.name, expert_parallel)
    expert_parallel = expert_parallel and tp > 1  # one device: nothing to split
    mesh = make_mesh(tp) if tp > 1 else None
    converted = is_converted(path)
    stored, quantized = stored_quantization(path) if converted else (hf_quantization(path), ())
    if quantize is not None and stored is not None and quantize != stored:
        raise InputError(f"quantize {quantize!r}: {path} stores its weights in {stored}; load it with "
                         f"quantize={stored!r} or None")
    fp8_blocks = not converted and hf_fp8_blocks(path) is not None
    if expert_parallel and stored and not converted:  # (its scales are read split by columns)
        raise InputError(f"expert_parallel: {path.name} is an {stored} folder with per-channel scales, whose experts "
                         "split only by their columns for now; convert it first (jaxspec convert, which keeps its "
                         "8 bits), or load it with expert_parallel=False")
    requantize = None
    if converted:
        # Straight into device memory (each device its own shards): a host copy first made the 8B
        # shape's load 12.8 s on an H200 against 9.7 s this way.
        shardings = field_shardings(config, mesh, quantized, expert_parallel) if mesh is not None else dict.fromkeys(
            field_shardings(config, None, quantized), jax.sharding.SingleDeviceSharding(jax.devices()[0]))
        fields = read_checkpoint(path, config, shardings)
        weights = weights_from_fields(config, fields, dtype, mesh, stored, expert_parallel)
    else:
        # A block-wise fp8 folder asked for 8 bits is requantized as it loads, from its float32
        # weights (one rounding to 8 bits, not a second one after the first to `dtype`).
        requantize = quantize if fp8_blocks else None
        weights = load_hf_weights(path, config, dtype, mesh, requantize, expert_parallel)
    config = serving_config(config, tp)
    if quantize is not None and stored is None and requantize is None:
        weights = quantize_weights(weights, config, quantize)
    quantize = quantize or stored
    return Model(config, weights, load_tokenizer(path), name, path, dtype, mesh, quantize=quantize)


def replicated_on(model: Model | EagleHead, mesh) -> Model | EagleHead:
    """`model` (a draft model or an EAGLE-3 head) whole on every device of `mesh` (a small draft
    beside a split target), so one compiled graph runs both. A model already on that mesh is
    returned as it is."""
    if model.mesh == mesh:
        return model
    if model.mesh is not None or mesh is None:
        sizes = lambda m: 1 if m is None else m.size  # noqa: E731
        raise InputError(
            f"model {model.name!r} is on {sizes(model.mesh)} device(s) and the model it runs with on a different "
            f"set of {sizes(mesh)}: load the draft with tensor_parallel 1 or the target's, never more than the target's"
        )
    key = (model, mesh)
    if key not in _replicas:
        _replicas.clear()  # one replica at a time: a long job reuses it, a new pair replaces it
        _replicas[key] = dataclasses.replace(model, weights=replicate(model.weights, mesh), mesh=mesh)
    return _replicas[key]


_replicas: dict = {}


def check_target(target) -> None:
    """Refuses, before any work, a target that is no model from jaxspec.load: an EAGLE-3 head
    (it only drafts, reading a target's hidden states) or a folder not loaded yet."""
    if isinstance(target, EagleHead):
        raise InputError(f"target must be a model from jaxspec.load (a model folder); got an EAGLE-3 head "
                         f"({target.path}): pass it as the draft")
    if not isinstance(target, Model):
        got = f"the path {str(target)!r}: load it first" if isinstance(target, (str, Path)) else type(target).__name__
        raise InputError(f"target must be a model from jaxspec.load; got {got}")


def check_draft_model(target: Model, draft: Model) -> None:
    """A draft model must share the target's vocabulary (and tokenizer, where both have one)."""
    tv, dv = target.config.vocab_size, draft.config.vocab_size
    if tv != dv:
        raise InputError(
            f"draft {draft.name!r} has vocab_size {dv} but target {target.name!r} has {tv}: "
            "draft and target must share one tokenizer"
        )
    if target.tokenizer is not None and draft.tokenizer is not None:
        if target.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
            raise InputError(
                f"draft {draft.name!r} and target {target.name!r} have different tokenizers: "
                "they must share one vocabulary"
            )
