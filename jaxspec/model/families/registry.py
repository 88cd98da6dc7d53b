"""Every supported family by model_type. A new family: a file beside these holding its FAMILY,
and its line here."""

from jaxspec.model.families import llama, mistral, mixtral, qwen2, qwen3, qwen3_moe

FAMILIES = {f.model_type: f for f in (llama.FAMILY, mistral.FAMILY, qwen2.FAMILY, qwen3.FAMILY, qwen3_moe.FAMILY,
                                      mixtral.FAMILY)}
