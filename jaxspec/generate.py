"""`jaxspec.generate`: the Python entry point."""

from __future__ import annotations

from typing import Sequence

import logging

import jax

from jaxspec.errors import InputError
from jaxspec.loading import Model
from jaxspec.metrics_log import below
from jaxspec.model import ATTENTION_IMPLS
from jaxspec.ngram import Ngram
from jaxspec.trees import MAX_TREE_NODES, chain, resolve_tree
from jaxspec.requests import (
    Request, SamplingSettings, check_max_new_tokens, check_token_ids, encode_prompt, seeds_for,
)
from jaxspec.runner import run
from jaxspec.stats import Completions

log = logging.getLogger("jaxspec")
MAX_DRAFT_TOKENS = 32  # one static graph per K; past this a chain only wastes verify work


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


def resolve_attention(attention) -> str:
    if attention == "auto":
        return "xla" if jax.default_backend() == "cpu" else "pallas"
    if attention not in ATTENTION_IMPLS:
        raise InputError(f"attention must be one of auto, {', '.join(ATTENTION_IMPLS)}; got {attention!r}")
    return attention


def check_draft(target: Model, draft: Model | Ngram, num_draft_tokens) -> None:
    """A draft model must share the target's vocabulary; K must be an int in [1, MAX_DRAFT_TOKENS]."""
    if not isinstance(draft, (Model, Ngram)):
        raise InputError(f'draft must be a model from jaxspec.load, "ngram" or None; got {draft!r}')
    if isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, int) or not (
        1 <= num_draft_tokens <= MAX_DRAFT_TOKENS
    ):
        raise InputError(f"num_draft_tokens must be an integer in [1, {MAX_DRAFT_TOKENS}]; got {num_draft_tokens!r}")
    if isinstance(draft, Ngram):
        if len(draft.drafter(num_draft_tokens).tree) > MAX_TREE_NODES:
            raise InputError(f"ngram_branches x num_draft_tokens must be at most {MAX_TREE_NODES - 1}; got "
                             f"{draft.branches} x {num_draft_tokens}")
        return
    tv, dv = target.config.vocab_size, draft.config.vocab_size
    if tv != dv:
        raise InputError(
            f"draft {draft.name!r} has vocab_size {dv} but target {target.name!r} has {tv}: "
            "draft and target must share one tokenizer"
        )
    if target.tokenizer is not None and draft.tokenizer is not None:
        if target.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
            raise InputError(
                f"draft {draft.name!r} and target {target.name!r} have different tokenizers: "
                "they must share one vocabulary"
            )


def resolve_draft(draft, ngram_min: int = 1, ngram_max: int = 3, ngram_branches: int = 1):
    """A draft model as it is; "ngram" -> the n-gram settings (checked)."""
    if isinstance(draft, str):
        if draft != "ngram":
            raise InputError(f'draft must be a model from jaxspec.load, "ngram" or None; got {draft!r}')
        return Ngram(ngram_min, ngram_max, ngram_branches)
    return draft


def generate(
    prompts: Sequence[str] | Sequence[Sequence[int]],
    target: Model,
    draft: Model | str | Ngram | None = None,
    *,
    max_new_tokens: int = 128,
    num_draft_tokens: int = 4,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | Sequence[int] = 0,
    max_batch_size: int = 32,
    warn_below_acceptance: float = 0.6,
    attention: str = "auto",
    tree=None,
    ngram_min: int = 1,
    ngram_max: int = 3,
    ngram_branches: int = 1,
) -> Completions:
    """Generates a completion for each prompt with the target model, speculatively when a draft
    is given (K = num_draft_tokens drafts verified per target pass), plainly otherwise.
    draft: a draft model sharing the target's vocabulary, or "ngram": prompt lookup, proposing
    the K tokens that followed the most recent earlier occurrence of the row's last
    ngram_max..ngram_min tokens in its prompt and output (no draft model; jaxspec.ngram);
    ngram_branches > 1 verifies that many distinct continuations as a tree.

    Output is lossless: greedy output equals the target's own greedy output token for token,
    and sampled output is distributed exactly as the target's sampling distribution.
    prompts: strings (tokenized with the target's tokenizer) or lists of token ids.
    temperature 0 is greedy; top_k 0 and top_p 1 switch those filters off. seed: one int for all
    prompts (each prompt still draws from its own stream) or one int per prompt.
    tree: a static draft tree instead of a chain: a parents array (node 0 = the last committed
    token, parent -1; see jaxspec.trees) or a name from jaxspec.trees.NAMED_TREES.
    attention: "xla", "pallas" (the fused Pallas kernel for decode/verify steps; GPU, or CPU in
    interpret mode for tests) or "auto" (pallas on GPUs, xla on the CPU).
    Returns Completions (a list, in prompt order) with `.metrics` for the whole call; logs a
    warning when the call's acceptance rate is below `warn_below_acceptance`.
    """
    if not isinstance(max_batch_size, int) or max_batch_size < 1:
        raise InputError(f"max_batch_size must be an integer >= 1; got {max_batch_size!r}")
    draft = resolve_draft(draft, ngram_min, ngram_max, ngram_branches)
    if isinstance(draft, Ngram):
        check_draft(target, draft, num_draft_tokens)
        if tree is not None:
            raise InputError('tree is for a draft model; n-gram lookup builds its own (ngram_branches)')
    elif draft is not None:
        check_draft(target, draft, num_draft_tokens)
        tree = chain(num_draft_tokens) if tree is None else resolve_tree(tree)
    elif tree is not None:
        raise InputError("tree needs a draft model: pass draft=... (or drop tree for plain decoding)")
    requests = build_requests(prompts, target, max_new_tokens, temperature, top_k, top_p, seed)
    # Past one batch, slots are refilled as rows finish rather than waiting for a batch's longest.
    scheduler = "continuous" if len(requests) > max_batch_size else "static"
    outs = run(target, requests, max_batch_size, draft=draft, num_draft=num_draft_tokens, tree=tree,
               attention=resolve_attention(attention), scheduler=scheduler)
    rate = outs.metrics.acceptance_rate
    # Lookup proposals cost no draft passes: a low acceptance rate is no warning sign there.
    if rate is not None and isinstance(draft, Model) and rate < warn_below_acceptance:
        log.warning(
            "acceptance rate %s: the draft %r may cost more than it saves for target %r "
            "(try a smaller num_draft_tokens, a better-matched draft, or plain decoding)",
            below(rate, warn_below_acceptance), draft.name, target.name,
        )
    return outs
