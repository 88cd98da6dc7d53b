"""Mistral: Llama's layer with a sliding attention window."""

from jaxspec.model.families.family import Family, attention_bias, sliding_window

FAMILY = Family("mistral", "Mistral", lambda cfg: dict(qkv_bias=attention_bias(cfg),
                                                     sliding_window=sliding_window(cfg)))
