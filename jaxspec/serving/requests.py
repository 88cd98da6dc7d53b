"""Requests and their validation: every bad input raises InputError naming the field at fault."""

from __future__ import annotations

import dataclasses
from typing import Sequence

from jaxspec.checks import is_int
from jaxspec.errors import InputError
from jaxspec.model.tokenizer import vocab_bytes
from jaxspec.sampling_params import GREEDY, SamplingParams
from jaxspec.structured_outputs import compile_constraint


@dataclasses.dataclass(frozen=True)
class Request:
    """One prompt's tokens and its settings (a seed always set: SamplingParams.with_seed)."""

    token_ids: tuple[int, ...]
    sampling: SamplingParams = GREEDY
    index: int = 0  # which of the prompt's n samples (SamplingParams.n)

    def __post_init__(self):
        object.__setattr__(self, "sampling", self.sampling.with_seed())

    @property
    def max_new_tokens(self) -> int:
        return self.sampling.max_tokens

    @property
    def seed(self) -> int:
        return self.sampling.seed


def per_prompt(value, n: int, field: str) -> list:
    """One value for every prompt, or a list of one per prompt (checked for length)."""
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        if len(value) != n:
            raise InputError(f"{field} has {len(value)} entries for {n} prompts; give one or one per prompt")
        return list(value)
    return [value] * n


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


def make_request(prompt_ids, sampling: SamplingParams, vocab_size: int, context: int, field: str,
                 tokenizer=None, eos_ids: tuple[int, ...] = ()) -> Request:
    """A checked Request: the prompt's ids (check_token_ids), the stop token ids in the vocabulary,
    a tokenizer for stop strings and output constraints (they are matched on the tokens' bytes),
    and the constraint compiled over them (eos_ids: the model's; compiled once, then cached), so a
    constraint that cannot be compiled is refused before any work."""
    ids = check_token_ids(prompt_ids, vocab_size, context, sampling.max_tokens, field)
    if sampling.stop and tokenizer is None:
        raise InputError("stop strings need the model's tokenizer, and this model has none; use stop_token_ids")
    if sampling.structured_outputs is not None:
        if tokenizer is None:
            raise InputError("structured_outputs needs the model's tokenizer, and this model has none")
        compile_constraint(sampling.structured_outputs, vocab_bytes(tokenizer, vocab_size), eos_ids)
    for t, _ in sampling.logit_bias:
        if t >= vocab_size:
            raise InputError(f"logit_bias token id {t} is outside the vocabulary [0, {vocab_size})")
    for t in sampling.stop_token_ids:
        if t >= vocab_size:
            raise InputError(f"stop_token_ids contains token id {t} outside the vocabulary [0, {vocab_size})")
    return Request(ids, sampling)


def render_messages(messages, tokenizer, model_name: str) -> list[int]:
    """A chat, rendered with the tokenizer's chat template (with the assistant turn opened)."""
    if not isinstance(messages, list) or not messages:
        raise InputError('messages must be a non-empty list of {"role": ..., "content": ...} objects')
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise InputError(f'messages[{i}] must be an object with string "role" and "content"')
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise InputError(
            f"messages need a chat template but the tokenizer of {model_name!r} has none; give a \"prompt\" instead"
        )
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # template errors (e.g. roles out of order) are the record's fault
        raise InputError(f"messages could not be rendered with the chat template: {e}") from None
    return tokenizer.encode(text, add_special_tokens=False)  # the template wrote the special tokens


SAMPLE_STRIDE = 0x9E3779B9  # seeds of a prompt's samples: seed, seed + stride, ... (mod 2**32), all distinct


def samples(request: Request) -> list[Request]:
    """A request's SamplingParams.n samples: sample i draws from its own stream, seeded from the
    request's seed and i, so seeded samples are reproducible and distinct (sample 0 keeps the seed)."""
    n = request.sampling.n
    if n == 1:
        return [request]
    seed = request.seed
    return [Request(request.token_ids, dataclasses.replace(request.sampling, seed=(seed + i * SAMPLE_STRIDE) % 2**32), i)
            for i in range(n)]
