"""Tiny random-weight HF models of every supported family, built with transformers from a config."""

from __future__ import annotations

import torch
import transformers

BASE = dict(
    vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
    initializer_range=0.2,  # large random weights give decisive argmaxes for greedy comparisons
    bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
)
TINY = {
    "llama_gqa": ("llama", {}),
    "llama_tied_mqa": ("llama", dict(num_key_value_heads=1, tie_word_embeddings=True)),
    # head_dim 16, theta 1e4: wavelengths 6.3 (kept), 19.9 (blended), 63+ (divided by 8) against
    # the 8..32 band that original_max_position_embeddings=32 defines.
    "llama3_rope": ("llama", dict(rope_parameters=dict(
        rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
        high_freq_factor=4.0, original_max_position_embeddings=32,
    ))),
    "llama_bias": ("llama", dict(attention_bias=True, mlp_bias=True)),
    "mistral_swa": ("mistral", dict(sliding_window=8)),  # shorter than every prompt below
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", dict(head_dim=32)),  # != hidden / heads = 16
    # mixtures of experts: top-2 of 4 experts, renormalized (Mixtral always; Qwen3-MoE by its flag)
    "qwen3_moe": ("qwen3_moe", dict(head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=96,
                                    norm_topk_prob=False)),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
    # a dense layer between two sparse ones (mlp_only_layers), of its own width (intermediate_size)
    "qwen3_moe_dense_layer": ("qwen3_moe", dict(head_dim=32, num_experts=4, num_experts_per_tok=2,
                                                moe_intermediate_size=96, norm_topk_prob=True, num_hidden_layers=3,
                                                mlp_only_layers=[1])),
}


def build_tiny_hf(family: str, overrides: dict, seed: int = 0):
    """A float32 HF model with every parameter random (norm weights near 1, biases nonzero)."""
    config = transformers.AutoConfig.for_model(family, **{**BASE, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation="eager"
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.1)
            elif "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    return model.eval()




def save_tiny(path, family: str, overrides: dict | None = None, seed: int = 0):
    """Builds a tiny model and saves it as a HF folder (safetensors) at `path`; returns path."""
    build_tiny_hf(family, overrides or {}, seed).save_pretrained(path, safe_serialization=True)
    return path


def request(ids, max_tokens: int, seed: int = 0, **sampling):
    """A Request for the token ids `ids`: greedy unless `sampling` (SamplingParams fields) says otherwise."""
    from jaxspec.sampling_params import SamplingParams
    from jaxspec.serving.requests import Request

    return Request(tuple(ids), SamplingParams(**{"temperature": 0.0, **sampling}, max_tokens=max_tokens, seed=seed))
