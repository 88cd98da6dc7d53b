"""Runs validated requests with one decode method under a scheduler: static padded batches, or
slots refilled as rows finish (continuous); returns Completions with the call's metrics."""

from __future__ import annotations

import dataclasses
import time

from jaxspec.decoding.adaptive import adaptive_loops, k_choices
from jaxspec.decoding.method import DecodeMethod
from jaxspec.decoding.penalties import any_penalty
from jaxspec.decoding.suffix import SuffixCorpus
from jaxspec.decoding.trees import chain
from jaxspec.errors import InputError
from jaxspec.graphs import GraphCache
from jaxspec.model.eagle import EagleHead
from jaxspec.model.loading import Model, replicated_on
from jaxspec.serving.continuous import ADMIT_ORDERS, run_slots
from jaxspec.serving.prefixes import PREFIX_CACHE_TOKENS, prefix_store
from jaxspec.serving.requests import Request
from jaxspec.serving.static import run_static
from jaxspec.serving.stats import CallMetrics, Completion, Completions, RequestStats

SCHEDULERS = ("static", "continuous")


def run(
    target: Model, requests: list[Request], max_batch_size: int, method: DecodeMethod = DecodeMethod(),
    draft: Model | None = None, *, attention: str = "xla", scheduler: str = "static", refill_at: int | None = None,
    on_done=None, admit_order: str = "longest", graphs: GraphCache | None = None,
    groups: list[list[int]] | None = None, prefix_cache: bool = True, prefix_cache_tokens: int = PREFIX_CACHE_TOKENS,
    adaptive_k: bool = False,
) -> Completions:
    """Decodes all requests (results in their order) by `method` (its draft model: `draft`).
    scheduler "static": padded batches of up to max_batch_size, each run until its longest row
    ends; "continuous": max_batch_size slots, refilled as rows finish (jaxspec.serving.continuous;
    refill_at: rows freed before a refill; admit_order: run_slots'). on_done(pairs, decode_s,
    compile_s) gets the (request index, Completion) pairs as they finish (continuous) or per batch
    (static; groups: its batches as lists of request indices, by default similar prompt lengths
    together). graphs: the compiled-graph cache to use (default: the target's own). adaptive_k:
    the continuous scheduler chooses K (0 = plain) at each return from method.k halved down to 0
    (serving/adaptive_k.py); a plain method has none to choose."""
    if scheduler not in SCHEDULERS:
        raise InputError(f"scheduler must be one of {', '.join(SCHEDULERS)}; got {scheduler!r}")
    if admit_order not in ADMIT_ORDERS:
        raise InputError(f"admit_order must be one of {', '.join(ADMIT_ORDERS)}; got {admit_order!r}")
    if attention == "deterministic" and method.parents != chain(method.k):
        raise InputError(f"deterministic mode verifies chains only; {method.name} drafts a tree, whose nodes are "
                         "not at their final positions (use a chain: num_draft_tokens without tree, ngram_branches=1)")
    graphs = target.graphs if graphs is None else graphs
    if isinstance(draft, (Model, EagleHead)):
        draft = replicated_on(draft, target.mesh)  # a draft loaded whole runs on every device of the target's
    loop, params = method.loop(target, draft)
    if isinstance(params, SuffixCorpus):  # suffix drafting reads the call's text: prompts, then outputs as they finish
        params.add(_first_fitting([r.token_ids for r in requests], params.size // 2))
        on_done = _adding_outputs(params, requests, on_done)
    asked = [r.sampling.logprobs for r in requests if r.sampling.logprobs is not None]
    if asked:  # the loop records the most alternatives any request asks for (one graph for the call)
        loop = dataclasses.replace(loop, logprobs=max(asked))
    if any(any_penalty(r.sampling) for r in requests):  # the loop counts tokens only where needed
        loop = dataclasses.replace(loop, penalties=True)
    loops = None
    if adaptive_k and method.speculative:
        if scheduler != "continuous":
            raise InputError(f"adaptive K chooses K at the continuous scheduler's returns; scheduler is {scheduler!r}")
        loops = adaptive_loops(loop, k_choices(method.k), method.name)
    start, before = time.perf_counter(), graphs.counts()
    shares = prefix_cache and not getattr(loop, "feature_layers", ())
    store = prefix_store(target, [r.token_ids for r in requests], attention, graphs, prefix_cache_tokens) if shares else None
    if scheduler == "static":
        results, decode_s = run_static(target, requests, max_batch_size, loop, params, attention, graphs, on_done,
                                       groups, store)
    else:
        results, decode_s = _run_continuous(target, requests, max_batch_size, loop, params, attention, graphs,
                                            refill_at, on_done, admit_order, store, loops)
    decode_s += store.run_s if store else 0.0
    after = graphs.counts()
    prompt_tokens = sum(c.stats.prompt_tokens for c in results)
    return Completions(results, CallMetrics(
        requests=len(results),
        new_tokens=sum(c.stats.new_tokens for c in results),
        wall_s=time.perf_counter() - start,
        compile_s=after["compile_s"] - before["compile_s"],
        decode_s=decode_s,
        graphs_compiled=after["misses"] - before["misses"],
        graph_cache_hits=after["hits"] - before["hits"],
        graphs_from_disk=after["disk_hits"] - before["disk_hits"],
        target_steps=sum(c.stats.target_steps for c in results),
        drafted=sum(c.stats.drafted for c in results),
        accepted=sum(c.stats.accepted for c in results),
        prompt_tokens=prompt_tokens,
        prefill_tokens=prompt_tokens - (store.reused - store.computed if store else 0),
        cached_tokens=sum(c.stats.cached_tokens for c in results),
        experts_per_layer=RequestStats.combined([c.stats for c in results]).experts_per_layer if results else None,
    ))


def _first_fitting(documents: list, budget: int) -> list:
    """The first documents whose tokens (and separators) fit in `budget`."""
    out = []
    for d in documents:
        budget -= len(d) + 1
        if budget < 0:
            break
        out.append(d)
    return out


def _adding_outputs(corpus: SuffixCorpus, requests: list[Request], on_done):
    """on_done that first adds each finished request's prompt and output to the suffix corpus."""
    def done(pairs, decode_s, compile_s):
        corpus.add([list(requests[i].token_ids) + list(c.token_ids) for i, c in pairs])
        if on_done is not None:
            on_done(pairs, decode_s, compile_s)
    return done


def _run_continuous(target, requests, slots, loop, params, attention, graphs, refill_at, on_done,
                    admit_order, store, loops) -> tuple[list[Completion], float]:
    """Greedy and sampled requests each through their own slots (one graph each), in that order."""
    results: list[Completion | None] = [None] * len(requests)
    decode_s = 0.0
    for greedy in (True, False):
        group = [(i, r) for i, r in enumerate(requests) if r.sampling.greedy == greedy]
        if group:
            done, d = run_slots(target, group, min(slots, len(group)), loop, params, attention, greedy, graphs,
                                refill_at=refill_at, on_done=on_done, admit_order=admit_order, prefixes=store,
                                loops=loops)
            for i, c in done.items():
                results[i] = c
            decode_s += d
    return results, decode_s
