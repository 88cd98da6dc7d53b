"""A model family: how its config.json maps onto ModelConfig's per-family fields, and, for a
mixture of experts, what its checkpoint calls the MLP's parts."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from jaxspec.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Family:
    model_type: str  # config.json's model_type
    description: str  # the models it covers, as errors and docs list them
    # config.json -> the ModelConfig fields this family reads its own way (qkv_bias, o_bias,
    # mlp_bias, qk_norm, sliding_window, the experts'); unnamed ones keep ModelConfig's defaults
    fields: Callable[[dict[str, Any]], dict[str, Any]]
    # a mixture of experts' HF names: (the MLP block, its router, an expert's gate, up, down)
    expert_names: tuple[str, str, str, str, str] | None = None


def attention_bias(cfg: dict[str, Any]) -> bool:
    return bool(cfg.get("attention_bias", False))


def sliding_window(cfg: dict[str, Any]) -> int | None:
    window = cfg.get("sliding_window")
    return int(window) if window else None


def no_sliding_window(cfg: dict[str, Any]) -> None:
    """Qwen's configs carry a sliding_window that only use_sliding_window turns on."""
    if cfg.get("use_sliding_window", False):
        raise ConfigError(f"use_sliding_window=true is not supported for model_type {cfg.get('model_type')!r}")


def experts(cfg: dict[str, Any], count: str, width: str, norm_topk_prob: bool) -> dict[str, Any]:
    """The ModelConfig fields of a mixture of experts: `count` and `width` name config.json's
    fields for the expert count and an expert's width."""
    out = dict(num_experts=int(cfg[count]), experts_per_token=int(cfg["num_experts_per_tok"]),
               moe_intermediate_size=int(cfg[width]), norm_topk_prob=norm_topk_prob)
    if out["num_experts"] <= 0:
        raise ConfigError(f"{count} must be > 0 for {cfg.get('model_type')}; got {out['num_experts']}")
    if not 1 <= out["experts_per_token"] <= out["num_experts"]:
        raise ConfigError(f"num_experts_per_tok must be in [1, {out['num_experts']}] (the experts); "
                          f"got {out['experts_per_token']}")
    return out
