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

# model_type -> (q/k/v bias default, uses q/k RMSNorm)
SUPPORTED_FAMILIES = {
    "llama": "Llama 2 / 3 / 3.1 / 3.2",
    "mistral": "Mistral",
    "qwen2": "Qwen2 / Qwen2.5",
    "qwen3": "Qwen3",
    "qwen3_moe": "Qwen3-MoE (every layer sparse)",
    "mixtral": "Mixtral",
}
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
    # Mixture of experts (qwen3_moe, mixtral; 0 experts: a dense MLP): every layer's MLP is num_experts
    # SwiGLU experts of width moe_intermediate_size, experts_per_token of them per token, picked by
    # a softmax router (top-k of the softmax, renormalized when norm_topk_prob)
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False

    @property
    def queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def ffn_size(self) -> int:
        """The MLP width tensor parallelism splits: an expert's in a mixture of experts."""
        return self.moe_intermediate_size if self.is_moe else self.intermediate_size


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
        attention_bias = bool(cfg.get("attention_bias", False))
        sliding_window = None
        if model_type in ("mistral", "mixtral"):
            sliding_window = cfg.get("sliding_window")
        if model_type in ("qwen2", "qwen3", "qwen3_moe") and cfg.get("use_sliding_window", False):
            raise ConfigError(f"use_sliding_window=true is not supported for model_type {model_type!r}")
        moe = _moe_fields(model_type, cfg)
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
            qkv_bias=True if model_type == "qwen2" else attention_bias,
            o_bias=attention_bias if model_type in ("llama", "qwen3") else False,
            mlp_bias=bool(cfg.get("mlp_bias", False)) if model_type == "llama" else False,
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            sliding_window=int(sliding_window) if sliding_window else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos,
            pad_token_id=int(pad),
            **moe,
        )
    except KeyError as e:
        raise ConfigError(f"config.json lacks the required field {e.args[0]!r}") from None


def _moe_fields(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields of a Mixture-of-Experts config (none for a dense family)."""
    out = _moe_counts(model_type, cfg)
    if out and not 1 <= out["experts_per_token"] <= out["num_experts"]:
        raise ConfigError(f"num_experts_per_tok must be in [1, {out['num_experts']}] (the experts); "
                          f"got {out['experts_per_token']}")
    return out


def _moe_counts(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    if model_type == "mixtral":  # softmax over the chosen logits = the top-k of the softmax, renormalized
        return dict(num_experts=int(cfg["num_local_experts"]), experts_per_token=int(cfg["num_experts_per_tok"]),
                    moe_intermediate_size=int(cfg["intermediate_size"]), norm_topk_prob=True)
    if model_type != "qwen3_moe":
        return {}
    # the hub's configs say num_experts; transformers 5 writes num_local_experts
    experts = int(cfg["num_experts"] if "num_experts" in cfg else cfg["num_local_experts"])
    step = int(cfg.get("decoder_sparse_step", 1))
    dense = list(cfg.get("mlp_only_layers") or [])
    if step != 1 or dense:
        raise ConfigError(f"qwen3_moe with dense layers (decoder_sparse_step={step}, mlp_only_layers={dense}) is not "
                          "supported yet; every layer must be sparse (decoder_sparse_step 1, mlp_only_layers [])")
    if experts <= 0:
        raise ConfigError(f"num_experts must be > 0 for qwen3_moe; got {experts}")
    return dict(num_experts=experts, experts_per_token=int(cfg["num_experts_per_tok"]),
                moe_intermediate_size=int(cfg["moe_intermediate_size"]),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)))


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
