"""`jaxspec.generate`: the Python entry point."""

from __future__ import annotations

import dataclasses
import logging
from typing import Sequence

from jaxspec.checks import check_int
from jaxspec.decoding.method import DEFAULT_NUM_DRAFT, DRAFTERS, NAMED_KINDS, DecodeMethod, named_draft
from jaxspec.decoding.ngram import Ngram
from jaxspec.errors import InputError
from jaxspec.graphs import GraphCache
from jaxspec.model.loading import Model, check_draft_model, check_target, replicated_on
from jaxspec.sampling_params import ALIASES, GREEDY, SamplingParams
from jaxspec.serving.options import RUN_FIELDS, RunOptions
from jaxspec.serving.requests import Request, encode_prompt, make_request, per_prompt, samples
from jaxspec.serving.runner import run
from jaxspec.serving.stats import Completions
from jaxspec.serving.warnings import low_acceptance_message

log = logging.getLogger("jaxspec")


def build_requests(prompts, model: Model, sampling: SamplingParams | Sequence[SamplingParams]) -> list[Request]:
    """Checked Requests, SamplingParams.n per prompt in prompt order: `sampling` for all prompts, or
    one SamplingParams per prompt."""
    if isinstance(prompts, str) or not isinstance(prompts, Sequence) or not prompts:
        raise InputError("prompts must be a non-empty list of strings or of token-id lists")
    c = model.config
    requests = []
    for i, (prompt, params) in enumerate(zip(prompts, per_prompt(sampling, len(prompts), "sampling"))):
        if not isinstance(params, SamplingParams):
            raise InputError(f"sampling must be a jaxspec.SamplingParams or a list of one per prompt; got {params!r}")
        field = f"prompts[{i}]"
        ids = encode_prompt(prompt, model.tokenizer, field)
        requests += samples(make_request(ids, params, c.vocab_size, c.max_position_embeddings, field, model.tokenizer,
                                         c.eos_token_ids))
    return requests


def resolve_draft(draft, settings=None):
    """A draft model as it is; "ngram" / "suffix" -> that kind's settings (`settings`, or the defaults)."""
    return named_draft(draft, settings) if isinstance(draft, str) else draft


# generate's shorthand keywords by the value each one sets (SamplingParams' fields are its own).
METHOD_KEYWORDS = ("num_draft_tokens", "tree", "ngram_min", "ngram_max", "ngram_branches")


def split_shorthand(keywords: dict) -> tuple[dict, dict, dict]:
    """generate's loose keywords -> (sampling fields, method keywords, run options); a seed or
    other sampling keyword may be a list of one per prompt. An unknown keyword is an InputError."""
    sampling_names = {f.name for f in dataclasses.fields(SamplingParams)} | set(ALIASES)
    parts: tuple[dict, dict, dict] = ({}, {}, {})
    for key, value in keywords.items():
        where = 0 if key in sampling_names else 1 if key in METHOD_KEYWORDS else 2 if key in RUN_FIELDS else None
        if where is None:
            known = sorted(sampling_names | set(METHOD_KEYWORDS) | set(RUN_FIELDS))
            raise InputError(f"generate() got an unknown keyword {key!r}; known: {', '.join(known)}")
        parts[where][key] = value
    return parts


def _method(draft, keywords: dict) -> tuple[object, DecodeMethod]:
    """(the draft, its DecodeMethod) from generate's draft and method keywords."""
    ngram_keys = {k: keywords.pop(k) for k in ("ngram_min", "ngram_max", "ngram_branches") if k in keywords}
    if ngram_keys and draft in NAMED_KINDS:  # "ngram" or "suffix" with lookup settings
        draft = DRAFTERS[draft].settings(**{k.replace("ngram_branches", "branches"): v for k, v in ngram_keys.items()})
    draft = resolve_draft(draft)
    return draft, DecodeMethod.of(draft, keywords.get("num_draft_tokens", DEFAULT_NUM_DRAFT), keywords.get("tree"))


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
    sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    method: DecodeMethod | None = None,
    options: RunOptions | None = None,
    max_batch_size: int = 32,
    graphs: GraphCache | None = None,
    **shorthand,
) -> Completions:
    """Generates a completion for each prompt with the target model, speculatively when a draft
    is given, plainly otherwise. Output is lossless: greedy output equals the target's own greedy
    output token for token, and sampled output is distributed exactly as the target's sampling.

    prompts: strings (tokenized with the target's tokenizer) or lists of token ids.
    draft: a draft model sharing the target's vocabulary, an EAGLE-3 head, "ngram" (prompt
    lookup: the tokens that followed the most recent earlier occurrence of the row's last tokens;
    jaxspec.ngram.Ngram for its settings) or "suffix" (the same lookup in the call's other
    prompts and finished outputs too; jaxspec.suffix.Suffix).
    sampling: a jaxspec.SamplingParams for every prompt, or a list of one per prompt (vLLM's
    fields and defaults). Without it: greedy, 128 new tokens, seed 0.
    method: a jaxspec.DecodeMethod (kind, K, tree, the drafter's settings); default: the draft's,
    K = 3. options: a RunOptions (attention, deterministic, warn_below_acceptance, prefix_cache).
    graphs: the compiled-graph cache (jaxspec.GraphCache); default: the target's own.

    Shorthand keywords, each setting one field of those values (a sampling keyword over
    `sampling`'s, or the greedy defaults): max_new_tokens (= max_tokens), temperature (0 is
    greedy), top_k (0 = off), top_p (1 = off), min_p (0 = off), seed (an int, or one per prompt:
    a prompt's random stream depends on its seed and token positions only, so two equal prompts
    with one seed sample the same text); num_draft_tokens (K), tree (a parents array or a name
    from jaxspec.trees.NAMED_TREES), ngram_min, ngram_max, ngram_branches; attention ("auto",
    "xla", "pallas"), deterministic (the same tokens alone or in any batch, bit for bit;
    docs/deterministic.md), warn_below_acceptance, prefix_cache (False: every prompt prefilled
    whole, no shared prefixes), adaptive_k (K chosen as the call runs: RunOptions').

    Returns Completions (a list, in prompt order: with n > 1, prompt 0's n samples first, each with
    its `index`) with `.metrics` for the whole call; logs a
    warning when the call's acceptance rate is below options.warn_below_acceptance.
    """
    check_target(target)
    check_int(max_batch_size, "max_batch_size", 1)
    sampling_keys, method_keys, run_keys = split_shorthand(shorthand)
    if method is not None and method_keys:
        raise InputError(f"give the decode method once: method= or {', '.join(method_keys)}, not both")
    if method is None:
        draft, method = _method(draft, method_keys)
    else:
        draft = resolve_draft(draft, method.settings if method.kind in NAMED_KINDS else None)
    options = (options or RunOptions()).updated(run_keys)
    check_pair(target, draft, method)
    requests = build_requests(prompts, target, with_keywords(sampling, sampling_keys, len(prompts)))
    # Past one batch, slots are refilled as rows finish rather than waiting for a batch's longest.
    # (adaptive K chooses at those refills)
    scheduler = "continuous" if len(requests) > max_batch_size or options.adaptive_k else "static"
    outs = run(target, requests, max_batch_size, method, draft, attention=options.attention_impl,
               scheduler=scheduler, graphs=graphs, prefix_cache=options.prefix_cache,
               prefix_cache_tokens=options.prefix_cache_tokens, adaptive_k=options.adaptive_k)
    warn_if_low(outs, method, draft, target, options.warn_below_acceptance)
    return outs


def with_keywords(sampling, keywords: dict, n: int):
    """`sampling` (one SamplingParams, a list of one per prompt, or None: the greedy defaults) with
    the shorthand sampling keywords put over it; a keyword's list gives one value per prompt."""
    if not keywords:
        return sampling if sampling is not None else GREEDY
    bases = per_prompt(sampling if sampling is not None else GREEDY, n, "sampling")
    values = {k: _per_prompt_value(k, v, n) for k, v in keywords.items()}
    return [base.updated({k: v[i] for k, v in values.items()}) for i, base in enumerate(bases)]


def _per_prompt_value(key: str, value, n: int) -> list:
    """A keyword's value for each prompt: a list gives one per prompt, except for a list-valued
    field (stop_token_ids), where a list of lists does."""
    if isinstance(getattr(GREEDY, ALIASES.get(key, key)), tuple):
        listed = isinstance(value, (list, tuple)) and value and all(isinstance(v, (list, tuple)) for v in value)
        return per_prompt(value, n, key) if listed else [value] * n
    return per_prompt(value, n, key)
