"""`jaxspec.generate`: the Python entry point."""

from __future__ import annotations

from typing import Sequence

from jaxspec.errors import InputError
from jaxspec.loading import Model
from jaxspec.requests import (
    Request, SamplingSettings, check_max_new_tokens, check_token_ids, encode_prompt, seeds_for,
)
from jaxspec.runner import run
from jaxspec.stats import Completions


def build_requests(
    prompts, model: Model, max_new_tokens, temperature, top_k, top_p, seed
) -> list[Request]:
    if isinstance(prompts, str) or not isinstance(prompts, Sequence) or not prompts:
        raise InputError("prompts must be a non-empty list of strings or of token-id lists")
    max_new_tokens = check_max_new_tokens(max_new_tokens)
    sampling = SamplingSettings(temperature, top_k, top_p)
    seeds = seeds_for(seed, len(prompts))
    c = model.config
    requests = []
    for i, prompt in enumerate(prompts):
        field = f"prompts[{i}]"
        ids = encode_prompt(prompt, model.tokenizer, field)
        ids = check_token_ids(ids, c.vocab_size, c.max_position_embeddings, max_new_tokens, field)
        requests.append(Request(ids, max_new_tokens, sampling, seeds[i]))
    return requests


def generate(
    prompts: Sequence[str] | Sequence[Sequence[int]],
    target: Model,
    *,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | Sequence[int] = 0,
    max_batch_size: int = 32,
) -> Completions:
    """Generates a completion for each prompt with the target model.

    prompts: strings (tokenized with the model's tokenizer) or lists of token ids.
    temperature 0 is greedy; top_k 0 and top_p 1 switch those filters off. seed: one int for all
    prompts (each prompt still draws from its own stream) or one int per prompt.
    Returns Completions (a list, in prompt order) with `.metrics` for the whole call.
    """
    if not isinstance(max_batch_size, int) or max_batch_size < 1:
        raise InputError(f"max_batch_size must be an integer >= 1; got {max_batch_size!r}")
    requests = build_requests(prompts, target, max_new_tokens, temperature, top_k, top_p, seed)
    return run(target, requests, max_batch_size)
