"""Qwen3-MoE (30B-A3B, 235B-A22B): Qwen3's attention, every layer's MLP a softmax router's top-k of
its experts (renormalized when norm_topk_prob)."""

from jaxspec.errors import ConfigError
from jaxspec.model.families.family import Family, attention_bias, experts, no_sliding_window


def fields(cfg):
    no_sliding_window(cfg)
    step, dense = int(cfg.get("decoder_sparse_step", 1)), list(cfg.get("mlp_only_layers") or [])
    if step != 1 or dense:
        raise ConfigError(f"qwen3_moe with dense layers (decoder_sparse_step={step}, mlp_only_layers={dense}) is not "
                          "supported yet; every layer must be sparse (decoder_sparse_step 1, mlp_only_layers [])")
    # the hub's configs say num_experts; transformers 5 writes num_local_experts
    count = "num_experts" if "num_experts" in cfg else "num_local_experts"
    return dict(qkv_bias=attention_bias(cfg), qk_norm=True,
                **experts(cfg, count, "moe_intermediate_size", bool(cfg.get("norm_topk_prob", False))))


FAMILY = Family("qwen3_moe", "Qwen3-MoE (every layer sparse)", fields,
                expert_names=("mlp", "gate", "gate_proj", "up_proj", "down_proj"))
