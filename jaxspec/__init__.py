"""jaxspec: speculative decoding for LLMs in JAX/XLA, for AMD (ROCm), NVIDIA and CPU."""

import os

# jaxspec takes only tokenizers and configs from transformers: its "PyTorch was not found"
# advice is noise here (set the variable to 0 to see transformers' advice again).
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

from jaxspec import xla_flags  # noqa: E402

xla_flags.apply()  # before any backend starts: jaxspec/xla_flags.py says what and why

from jaxspec.decoding.method import DecodeMethod
from jaxspec.errors import CheckpointError, ConfigError, InputError, JaxspecError
from jaxspec.graphs import GraphCache
from jaxspec.model.config import ModelConfig, load_config
from jaxspec.model.loading import Model, load
from jaxspec.sampling_params import SamplingParams
from jaxspec.serving.generate import generate
from jaxspec.serving.options import RunOptions
from jaxspec.serving.stats import CallMetrics, Completion, Completions, RequestStats
from jaxspec.structured_outputs import StructuredOutputsParams

__all__ = [
    "CallMetrics", "CheckpointError", "Completion", "Completions", "ConfigError", "DecodeMethod", "GraphCache",
    "InputError", "JaxspecError", "Model", "ModelConfig", "RequestStats", "RunOptions", "SamplingParams",
    "StructuredOutputsParams", "generate", "load", "load_config",
]
__version__ = "0.1.0"
