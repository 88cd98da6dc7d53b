"""Qwen3-MoE (30B-A3B, 235B-A22B): Qwen3's attention, a layer's MLP a softmax router's top-k of
its experts (renormalized when norm_topk_prob), or dense where mlp_only_layers or
decoder_sparse_step say so (transformers' Qwen3MoeDecoderLayer rule)."""

from jaxspec.errors import ConfigError
from jaxspec.model.families.family import Family, attention_bias, experts, no_sliding_window


def dense_layers(cfg) -> tuple[int, ...]:
    """Layer i is sparse unless i is in mlp_only_layers or (i + 1) is no multiple of decoder_sparse_step."""
    layers, step = int(cfg["num_hidden_layers"]), cfg.get("decoder_sparse_step", 1)
    only = cfg.get("mlp_only_layers") or []
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ConfigError(f"decoder_sparse_step must be an integer >= 1; got {step!r}")
    if not isinstance(only, list) or not all(isinstance(i, int) and 0 <= i < layers for i in only):
        raise ConfigError(f"mlp_only_layers must be a list of layer indices in [0, {layers}); got {only!r}")
    dense = tuple(i for i in range(layers) if i in only or (i + 1) % step)
    if len(dense) == layers:
        raise ConfigError(f"qwen3_moe with every layer dense (decoder_sparse_step={step}, mlp_only_layers={only}) "
                          "has no experts: load it as model_type qwen3")
    return dense


def fields(cfg):
    no_sliding_window(cfg)
    # the hub's configs say num_experts; transformers 5 writes num_local_experts
    count = "num_experts" if "num_experts" in cfg else "num_local_experts"
    return dict(qkv_bias=attention_bias(cfg), qk_norm=True, dense_layers=dense_layers(cfg),
                **experts(cfg, count, "moe_intermediate_size", bool(cfg.get("norm_topk_prob", False))))


FAMILY = Family("qwen3_moe", "Qwen3-MoE", fields,
                expert_names=("mlp", "gate", "gate_proj", "up_proj", "down_proj"))
