"""Qwen2 / Qwen2.5: q/k/v biases always."""

from jaxspec.model.families.family import Family, no_sliding_window


def fields(cfg):
    no_sliding_window(cfg)
    return dict(qkv_bias=True)


FAMILY = Family("qwen2", "Qwen2 / Qwen2.5", fields)
