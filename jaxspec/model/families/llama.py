"""Llama 2 / 3 / 3.1 / 3.2: optional biases on attention (q/k/v and o) and on the MLP."""

from jaxspec.model.families.family import Family, attention_bias

FAMILY = Family("llama", "Llama 2 / 3 / 3.1 / 3.2", lambda cfg: dict(
    qkv_bias=attention_bias(cfg), o_bias=attention_bias(cfg), mlp_bias=bool(cfg.get("mlp_bias", False))))
