"""Mixtral: Mistral's attention, every layer's MLP the top-2 of 8 experts, weighted by the softmax
over the chosen logits (the top-k of the softmax, renormalized)."""

from jaxspec.model.families.family import Family, attention_bias, experts, sliding_window

FAMILY = Family("mixtral", "Mixtral", lambda cfg: dict(
    qkv_bias=attention_bias(cfg), sliding_window=sliding_window(cfg),
    **experts(cfg, "num_local_experts", "intermediate_size", norm_topk_prob=True)),
    expert_names=("block_sparse_moe", "gate", "w1", "w3", "w2"))
