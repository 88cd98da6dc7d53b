"""Requests and their validation: every bad input raises InputError naming the field at fault."""

from __future__ import annotations

import dataclasses
from typing import Sequence

from jaxspec.checks import check_int, check_number, is_int
from jaxspec.errors import InputError


@dataclasses.dataclass(frozen=True)
class SamplingSettings:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off

    def __post_init__(self):
        check_sampling(self.temperature, self.top_k, self.top_p)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclasses.dataclass(frozen=True)
class Request:
    token_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingSettings
    seed: int


def check_sampling(temperature, top_k, top_p) -> None:
    check_number(temperature, "temperature", "a finite number >= 0 (0 = greedy)", lambda t: t >= 0)
    check_int(top_k, "top_k", 0, note=" (0 = off)")
    check_number(top_p, "top_p", "in (0, 1] (1 = off)", lambda p: 0 < p <= 1)


def check_max_new_tokens(max_new_tokens) -> int:
    return check_int(max_new_tokens, "max_new_tokens", 1)


def check_seed(seed, field: str = "seed") -> int:
    return check_int(seed, field, 0, 2**32 - 1, allowed="in [0, 2**32)")


def seeds_for(seed, n: int) -> list[int]:
    """An int applies to every prompt (each still gets its own stream), or one int per prompt."""
    if isinstance(seed, Sequence) and not isinstance(seed, str):
        if len(seed) != n:
            raise InputError(f"seed has {len(seed)} entries for {n} prompts; give one int or one per prompt")
        return [check_seed(s, f"seed[{i}]") for i, s in enumerate(seed)]
    return [check_seed(seed)] * n


def check_token_ids(
    token_ids, vocab_size: int, context: int, max_new_tokens: int, field: str
) -> tuple[int, ...]:
    """Validates one tokenized prompt against the vocabulary and the context length."""
    ids = tuple(token_ids)
    if not ids:
        raise InputError(f"{field} is empty; a prompt needs at least one token")
    for t in ids:
        if not is_int(t) or not 0 <= t < vocab_size:
            raise InputError(f"{field} contains token id {t!r} outside the vocabulary [0, {vocab_size})")
    if len(ids) > context:
        raise InputError(
            f"{field} has {len(ids)} tokens, longer than the model's context of {context} "
            "(max_position_embeddings)"
        )
    if len(ids) + max_new_tokens > context:
        raise InputError(
            f"max_new_tokens={max_new_tokens} with the {len(ids)}-token {field} exceeds the model's "
            f"context of {context} tokens; lower max_new_tokens to at most {context - len(ids)}"
        )
    return tuple(int(t) for t in ids)


def encode_prompt(prompt, tokenizer, field: str):
    """A str (tokenized) or a sequence of token ids, as given."""
    if isinstance(prompt, str):
        if not prompt:
            raise InputError(f"{field} is empty; a prompt needs at least one token")
        if tokenizer is None:
            raise InputError(f"{field} is text but the model has no tokenizer; pass token ids instead")
        return tokenizer.encode(prompt, add_special_tokens=True)
    if isinstance(prompt, Sequence) or hasattr(prompt, "tolist"):
        return list(prompt.tolist() if hasattr(prompt, "tolist") else prompt)
    raise InputError(f"{field} must be a str or a list of token ids; got {type(prompt).__name__}")
