"""`jaxspec.generate`: the Python entry point."""

from __future__ import annotations

import logging
from typing import Sequence

import jax

from jaxspec.checks import check_int
from jaxspec.decoding.method import DEFAULT_NUM_DRAFT, DecodeMethod
from jaxspec.decoding.ngram import Ngram
from jaxspec.errors import InputError
from jaxspec.graphs import GraphCache
from jaxspec.model.forward import ATTENTION_IMPLS
from jaxspec.model.loading import Model, check_draft_model, replicated_on
from jaxspec.serving.requests import (
    Request,
    SamplingSettings,
    check_max_new_tokens,
    check_token_ids,
    encode_prompt,
    seeds_for,
)
from jaxspec.serving.runner import run
from jaxspec.serving.stats import Completions
from jaxspec.serving.warnings import DEFAULT_WARN_BELOW, low_acceptance_message

log = logging.getLogger("jaxspec")


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


def resolve_attention(attention, deterministic: bool = False) -> str:
    """"auto" -> the fused Pallas kernel on GPUs, XLA's attention on the CPU; else checked.
    deterministic: "deterministic" (its own kernels; docs/deterministic.md), which "auto" allows."""
    if not isinstance(deterministic, bool):
        raise InputError(f"deterministic must be True or False; got {deterministic!r}")
    if deterministic:
        if attention not in ("auto", "deterministic"):
            raise InputError(f"deterministic mode runs its own attention kernel: leave attention 'auto'; "
                             f"got {attention!r}")
        return "deterministic"
    if attention == "auto":
        return "xla" if jax.default_backend() == "cpu" else "pallas"
    if attention not in ATTENTION_IMPLS:
        raise InputError(f"attention must be one of auto, {', '.join(ATTENTION_IMPLS)}; got {attention!r}")
    return attention


def resolve_draft(draft, ngram_min: int = 1, ngram_max: int = 3, ngram_branches: int = 1):
    """A draft model as it is; "ngram" -> the n-gram settings (checked)."""
    if isinstance(draft, str):
        if draft != "ngram":
            raise InputError(f'draft must be a model from jaxspec.load, "ngram" or None; got {draft!r}')
        return Ngram(ngram_min, ngram_max, ngram_branches)
    return draft


def check_pair(target: Model, draft, method: DecodeMethod) -> None:
    """A draft model fits its target: one vocabulary, and a device placement it can share."""
    if method.kind == "draft":
        check_draft_model(target, draft)
        replicated_on(draft, target.mesh)  # refuses a draft split other than its target, before any work
    if method.kind == "eagle":
        draft.check_target(target.config, target.name)


def warn_if_low(outs: Completions, method: DecodeMethod, draft, target: Model, threshold: float) -> None:
    """Logs the low-acceptance warning for a draft model (lookup proposals cost no draft passes: a
    low rate is no warning sign there)."""
    rate = outs.metrics.acceptance_rate
    if rate is not None and method.watches_acceptance and rate < threshold:
        log.warning(low_acceptance_message(rate, threshold, draft.name, target.name))


def generate(
    prompts: Sequence[str] | Sequence[Sequence[int]],
    target: Model,
    draft: Model | str | Ngram | None = None,
    *,
    max_new_tokens: int = 128,
    num_draft_tokens: int = DEFAULT_NUM_DRAFT,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | Sequence[int] = 0,
    max_batch_size: int = 32,
    warn_below_acceptance: float = DEFAULT_WARN_BELOW,
    attention: str = "auto",
    deterministic: bool = False,
    tree=None,
    ngram_min: int = 1,
    ngram_max: int = 3,
    ngram_branches: int = 1,
    graphs: GraphCache | None = None,
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
    prompts or one int per prompt; a prompt's random stream depends on its seed and token
    positions only, never on its batch neighbours (so two equal prompts with one seed sample the
    same text: give a seed per prompt for independent samples).
    tree: a static draft tree instead of a chain: a parents array (node 0 = the last committed
    token, parent -1; see jaxspec.trees) or a name from jaxspec.trees.NAMED_TREES.
    attention: "xla", "pallas" (the fused Pallas kernel for decode/verify steps; GPU, or CPU in
    interpret mode for tests) or "auto" (pallas on GPUs, xla on the CPU).
    deterministic: every row's result depends on that row alone, bit for bit, in any dtype: the
    same prompt gives the same tokens alone or in any batch, plainly or speculatively, under
    either scheduler (docs/deterministic.md). Chains only: a tree is refused.
    graphs: the compiled-graph cache (jaxspec.GraphCache); default: the target's own.
    Returns Completions (a list, in prompt order) with `.metrics` for the whole call; logs a
    warning when the call's acceptance rate is below `warn_below_acceptance`.
    """
    check_int(max_batch_size, "max_batch_size", 1)
    draft = resolve_draft(draft, ngram_min, ngram_max, ngram_branches)
    method = DecodeMethod.of(draft, num_draft_tokens, tree)
    check_pair(target, draft, method)
    requests = build_requests(prompts, target, max_new_tokens, temperature, top_k, top_p, seed)
    # Past one batch, slots are refilled as rows finish rather than waiting for a batch's longest.
    scheduler = "continuous" if len(requests) > max_batch_size else "static"
    outs = run(target, requests, max_batch_size, method, draft, attention=resolve_attention(attention, deterministic),
               scheduler=scheduler, graphs=graphs)
    warn_if_low(outs, method, draft, target, warn_below_acceptance)
    return outs
