"""Qwen3: RMSNorm on each head's q and k before RoPE; optional attention biases."""

from jaxspec.model.families.family import Family, attention_bias, no_sliding_window


def fields(cfg):
    no_sliding_window(cfg)
    return dict(qkv_bias=attention_bias(cfg), o_bias=attention_bias(cfg), qk_norm=True)


FAMILY = Family("qwen3", "Qwen3", fields)
