"""Model configuration read from a Hugging Face ``config.json``.

Every numeric constant the model uses (RMS eps, RoPE theta and scaling, biases, tied embeddings,
head_dim) comes from here, so one frozen, hashable dataclass fully describes the graph that jit
compiles.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from jaxspec.errors import ConfigError
from jaxspec.model.families.registry import FAMILIES

# model_type -> the models it covers (one file each: jaxspec/model/families/)
SUPPORTED_FAMILIES = {t: f.description for t, f in FAMILIES.items()}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"  # one of SUPPORTED_ROPE_TYPES
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # q/k/v projections carry biases (Qwen2, or Llama attention_bias)
    o_bias: bool  # output projection carries a bias (Llama attention_bias)
    mlp_bias: bool  # gate/up/down carry biases (Llama mlp_bias)
    qk_norm: bool  # RMSNorm on q and k per head before RoPE (Qwen3)
    sliding_window: int | None  # Mistral: keys further back than this are masked
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int
    # Mixture of experts (qwen3_moe, mixtral; 0 experts: a dense MLP): a sparse layer's MLP is
    # num_experts SwiGLU experts of width moe_intermediate_size, experts_per_token of them per token,
    # picked by a softmax router (top-k of the softmax, renormalized when norm_topk_prob)
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    # the layers of a mixture of experts whose MLP is dense instead (of width intermediate_size:
    # Qwen3-MoE's mlp_only_layers and decoder_sparse_step); every other layer is sparse
    dense_layers: tuple[int, ...] = ()

    @property
    def queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        """The layers whose MLP is a mixture of experts (none in a dense model)."""
        return tuple(i for i in range(self.num_layers) if i not in self.dense_layers) if self.is_moe else ()


def _rope_from_hf(cfg: dict[str, Any]) -> RopeConfig:
    # transformers 5 puts everything under rope_parameters; older configs use rope_theta plus an
    # optional rope_scaling dict whose type key is "rope_type" or (older still) "type".
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = merged.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"rope_type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if merged.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError("partial_rotary_factor != 1.0 is not supported")
    kwargs: dict[str, Any] = {"theta": float(theta), "rope_type": rope_type}
    if rope_type in ("linear", "llama3"):
        kwargs["factor"] = float(merged["factor"])
    if rope_type == "llama3":
        kwargs["low_freq_factor"] = float(merged["low_freq_factor"])
        kwargs["high_freq_factor"] = float(merged["high_freq_factor"])
        kwargs["original_max_position_embeddings"] = int(merged["original_max_position_embeddings"])
    return RopeConfig(**kwargs)


def _as_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    """Builds a ModelConfig from the dict of a HF config.json; raises ConfigError if unsupported."""
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_FAMILIES:
        raise ConfigError(
            f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_FAMILIES)}"
        )
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"hidden_act {act!r} is not supported; only 'silu'")
    try:
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        if heads % kv_heads:
            raise ConfigError(
                f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})"
            )
        own = dict(qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False, sliding_window=None)
        own |= FAMILIES[model_type].fields(cfg)
        eos = _as_tuple(cfg.get("eos_token_id"))
        pad = cfg.get("pad_token_id")
        if pad is None:
            pad = eos[0] if eos else 0
        return ModelConfig(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=_rope_from_hf(cfg),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos,
            pad_token_id=int(pad),
            **own,
        )
    except KeyError as e:
        raise ConfigError(f"config.json lacks the required field {e.args[0]!r}") from None


def read_config_json(model_dir: str | Path) -> dict[str, Any]:
    """A folder's config.json as a dict; ConfigError, naming the file, when it is missing or no
    JSON object (every reader of it goes through here, so none raises a bare JSONDecodeError)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"no config.json in {model_dir}")
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path} holds a JSON {type(cfg).__name__}, not an object of config fields")
    return cfg


def load_config(model_dir: str | Path) -> ModelConfig:
    """config.json, with the EOS ids of generation_config.json (where present) added to its own, as
    vLLM and HF generate() stop on both (a chat model's end-of-turn token is often only there)."""
    cfg = read_config_json(model_dir)
    gen = Path(model_dir) / "generation_config.json"
    if gen.is_file():
        try:
            extra = _as_tuple(json.loads(gen.read_text()).get("eos_token_id"))
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
            raise ConfigError(f"{gen} is not a valid JSON object: {e}") from None
        own = _as_tuple(cfg.get("eos_token_id"))
        cfg = {**cfg, "eos_token_id": list(dict.fromkeys(own + extra))}
    return config_from_hf(cfg)
