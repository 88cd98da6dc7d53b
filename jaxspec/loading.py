"""`jaxspec.load`: a converted checkpoint (fast path) or a Hugging Face folder, ready to run."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxspec.checkpoint import is_converted, read_checkpoint, read_hf_weights
from jaxspec.config import ModelConfig, load_config
from jaxspec.errors import CheckpointError, InputError
from jaxspec.model import Weights, weights_from_fields

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def default_dtype():
    """bfloat16 on accelerators, float32 on the CPU (where bf16 matmuls are slow)."""
    return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16


@dataclasses.dataclass(frozen=True, eq=False)
class Model:
    config: ModelConfig
    weights: Weights  # arrays in `dtype`, on the default device
    tokenizer: object | None  # a transformers tokenizer, or None when the folder has none
    name: str  # folder name, logged as the model id
    path: Path
    dtype: jnp.dtype


def _load_tokenizer(path: Path):
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def load(path: str | Path, dtype: str | jnp.dtype | None = None) -> Model:
    """Loads a model folder: converted (has jaxspec.json) or HF (config.json + *.safetensors).

    dtype: compute dtype, "float32" / "bfloat16" / "float16"; default float32 on CPU, bf16 on GPU.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"model folder {path} does not exist")
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise InputError(f"dtype {dtype!r} is not supported; allowed: {', '.join(DTYPES)}")
        dtype = DTYPES[dtype]
    dtype = jnp.dtype(dtype or default_dtype())
    config = load_config(path)
    fields = read_checkpoint(path, config) if is_converted(path) else read_hf_weights(path, config)
    weights = weights_from_fields(config, fields, dtype)
    return Model(config, weights, _load_tokenizer(path), path.name, path, dtype)
