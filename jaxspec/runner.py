"""Runs validated requests: groups them into padded batches of a few bucketed shapes, compiles
each shape once (cached), and turns device results into Completions.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from jaxspec.decode import FINISH_REASONS, Batch, decode
from jaxspec.errors import InputError
from jaxspec.draft_model import ModelDrafter
from jaxspec.loading import Model, replicated_on
from jaxspec.ngram import Ngram
from jaxspec.requests import Request
from jaxspec.sampling import SamplingParams
from jaxspec.sharding import replicate
from jaxspec.speculative import speculative_decode
from jaxspec.stats import CallMetrics, Completion, Completions, RequestStats
from jaxspec.trees import Tree, chain
from pallas_kernels.tree_attention import BLOCK_K

MIN_BUCKET = 16
_compiled: dict = {}  # (graph key) -> compiled executable


def bucket(n: int, minimum: int = MIN_BUCKET) -> int:
    """The power of two >= n (at least `minimum`): prompt lengths, budgets and batch sizes are
    padded to these so a long job compiles a handful of graphs."""
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())


def plan_batches(requests: list[Request], max_batch_size: int) -> list[list[int]]:
    """Indices of requests grouped by length, so each batch pads little."""
    order = sorted(range(len(requests)), key=lambda i: len(requests[i].token_ids))
    return [order[i : i + max_batch_size] for i in range(0, len(order), max_batch_size)]


def make_batch(requests: list[Request], batch_size: int, prompt_len: int, pad_id: int) -> Batch:
    tokens = np.full((batch_size, prompt_len), pad_id, np.int32)
    lens = np.zeros(batch_size, np.int32)
    max_new = np.ones(batch_size, np.int32)
    temp = np.zeros(batch_size, np.float32)
    top_k = np.zeros(batch_size, np.int32)
    top_p = np.ones(batch_size, np.float32)
    seeds = np.zeros(batch_size, np.uint32)
    for i, r in enumerate(requests):
        tokens[i, : len(r.token_ids)] = r.token_ids
        lens[i] = len(r.token_ids)
        max_new[i] = r.max_new_tokens
        temp[i], top_k[i], top_p[i] = r.sampling.temperature, r.sampling.top_k, r.sampling.top_p
        seeds[i] = r.seed
    return Batch(tokens, lens, max_new, SamplingParams(temp, top_k, top_p), seeds)


def _executable(key: tuple, lower):
    """(compiled graph for `key`, seconds spent compiling it now: 0 when cached)."""
    if key in _compiled:
        return _compiled[key], 0.0
    start = time.perf_counter()
    _compiled[key] = lower().compile()
    return _compiled[key], time.perf_counter() - start


def cache_capacity(prompt_len: int, max_out: int, slack: int) -> int:
    """Cache slots for a bucket: a multiple of the attention kernel's block and, past 8 blocks, of
    8 blocks. The kernel splits the prefix into a divisor of its block count, and a count with few
    divisors (129 = 3 x 43 blocks at a prefix of 8192) left it 1.5x slower than the XLA path on an
    H200 (7.7 against 5.2 ms per 8B step)."""
    blocks = -(-(prompt_len + max_out + slack) // BLOCK_K)
    return (blocks if blocks <= 8 else -(-blocks // 8) * 8) * BLOCK_K


def _plain(model: Model, batch: Batch, max_out: int, greedy_only: bool, attention: str):
    capacity = cache_capacity(batch.tokens.shape[1], max_out, 0)
    key = ("plain", model.config, jax.tree.structure(model.weights), model.mesh, model.dtype, batch.tokens.shape, capacity,
           max_out, greedy_only, attention)
    return _executable(key, lambda: decode.lower(
        model.weights, batch, config=model.config, capacity=capacity, max_out=max_out,
        greedy_only=greedy_only, attention=attention,
    )), lambda exe: exe(model.weights, batch)


def drafter_for(draft: Model | Ngram, num_draft: int, tree: Tree | None):
    """(static drafter, its arrays) for a draft model (a chain of num_draft, or `tree`) or n-gram lookup."""
    if isinstance(draft, Ngram):
        return draft.drafter(num_draft), None
    return ModelDrafter(draft.config, tree if tree is not None else chain(num_draft)), draft.weights


def _speculative(target: Model, drafter, params, batch: Batch, max_out: int, greedy_only: bool, attention: str):
    # Slack for the tree's nodes written past the committed length.
    capacity = cache_capacity(batch.tokens.shape[1], max_out, len(drafter.tree) + 1)
    key = ("spec", target.config, drafter, jax.tree.structure((target.weights, params)), target.mesh, target.dtype,
           tuple(a.dtype for a in jax.tree.leaves(params)), batch.tokens.shape, capacity, max_out, greedy_only, attention)
    return _executable(key, lambda: speculative_decode.lower(
        target.weights, params, batch, target_config=target.config, drafter=drafter,
        capacity=capacity, max_out=max_out, greedy_only=greedy_only, attention=attention,
    )), lambda exe: exe(target.weights, params, batch)


def _stats(request: Request, out, row: int, speculative: bool) -> RequestStats:
    n = int(out.num_generated[row])
    if not speculative:
        return RequestStats(prompt_tokens=len(request.token_ids), new_tokens=n, target_steps=n)
    rounds = int(out.rounds[row])
    per_position = tuple(int(a) for a in out.accepted_per_position[row])
    depth = len(per_position)  # chain: K; tree: its depth (one path position per level)
    return RequestStats(
        prompt_tokens=len(request.token_ids),
        new_tokens=n,
        target_steps=rounds + 1,  # the prefill produced the first token
        drafted=rounds * depth,
        accepted=sum(per_position),
        accepted_per_position=per_position,
        drafted_per_position=(rounds,) * depth,
    )


def completion(target: Model, request: Request, out, row: int, speculative: bool) -> Completion:
    """Row `row` of a decode loop's output (tokens, num_generated, finish; rounds and
    accepted_per_position when speculative), on the host, as the request's Completion."""
    ids = out.tokens[row, : int(out.num_generated[row])].tolist()
    text = target.tokenizer.decode(ids, skip_special_tokens=True) if target.tokenizer else None
    return Completion(text, ids, FINISH_REASONS[int(out.finish[row])], _stats(request, out, row, speculative))


SCHEDULERS = ("static", "continuous")


def run(
    target: Model, requests: list[Request], max_batch_size: int,
    draft: Model | Ngram | None = None, num_draft: int = 0, tree: Tree | None = None, attention: str = "xla",
    scheduler: str = "static", refill_at: int | None = None, on_done=None, admit_order: str = "longest",
) -> Completions:
    """Decodes all requests (results in their order); speculatively when a draft is given: a
    draft model over `tree` or else a chain of num_draft tokens, or n-gram lookup of num_draft
    tokens per branch.
    scheduler "static": padded batches of up to max_batch_size, each run until its longest row
    ends; "continuous": max_batch_size slots, refilled as rows finish (jaxspec.continuous;
    refill_at: rows freed before a refill). on_done(pairs, decode_s, compile_s) gets the
    (request index, Completion) pairs as they finish (continuous) or per batch (static);
    admit_order: jaxspec.continuous.run_slots'."""
    if scheduler not in SCHEDULERS:
        raise InputError(f"scheduler must be one of {', '.join(SCHEDULERS)}; got {scheduler!r}")
    if isinstance(draft, Model):
        draft = replicated_on(draft, target.mesh)  # a draft loaded whole runs on every device of the target's
    if scheduler == "continuous":
        return _run_continuous(target, requests, max_batch_size, draft, num_draft, tree, attention, refill_at, on_done,
                               admit_order)
    if draft is not None:
        drafter, params = drafter_for(draft, num_draft, tree)
    start = time.perf_counter()
    results: list[Completion | None] = [None] * len(requests)
    compile_s = decode_s = 0.0
    graphs = 0
    for group in plan_batches(requests, max_batch_size):
        reqs = [requests[i] for i in group]
        prompt_len = bucket(max(len(r.token_ids) for r in reqs))
        max_out = bucket(max(r.max_new_tokens for r in reqs))
        # Whole on every device of the target's mesh: every process passes the same batch.
        batch = replicate(make_batch(reqs, bucket(len(reqs), 1), prompt_len, target.config.pad_token_id), target.mesh)
        greedy_only = all(r.sampling.greedy for r in reqs)
        if draft is None:
            (exe, spent), call = _plain(target, batch, max_out, greedy_only, attention)
        else:
            (exe, spent), call = _speculative(target, drafter, params, batch, max_out, greedy_only, attention)
        compile_s += spent
        graphs += spent > 0
        t0 = time.perf_counter()
        out = jax.device_get(call(exe))
        decode_s += time.perf_counter() - t0
        for row, i in enumerate(group):
            results[i] = completion(target, reqs[row], out, row, draft is not None)
        if on_done is not None:
            on_done([(i, results[i]) for i in group], time.perf_counter() - t0, spent)
    return Completions(results, _metrics(results, time.perf_counter() - start, compile_s, decode_s, graphs))


def _metrics(results: list[Completion], wall_s: float, compile_s: float, decode_s: float, graphs: int) -> CallMetrics:
    return CallMetrics(
        requests=len(results),
        new_tokens=sum(c.stats.new_tokens for c in results),
        wall_s=wall_s,
        compile_s=compile_s,
        decode_s=decode_s,
        graphs_compiled=graphs,
        target_steps=sum(c.stats.target_steps for c in results),
        drafted=sum(c.stats.drafted for c in results),
        accepted=sum(c.stats.accepted for c in results),
    )


def _run_continuous(target, requests, slots, draft, num_draft, tree, attention, refill_at, on_done,
                    admit_order) -> Completions:
    """Greedy and sampled requests each through their own slots (one graph each), in that order."""
    from jaxspec.continuous import PlainLoop, SpeculativeLoop, run_slots

    start = time.perf_counter()
    if draft is None:
        loop, params = PlainLoop(target.config), None
    else:
        drafter, params = drafter_for(draft, num_draft, tree)
        loop = SpeculativeLoop(target.config, drafter)
    results: list[Completion | None] = [None] * len(requests)
    compile_s = decode_s = 0.0
    graphs = 0
    for greedy in (True, False):
        group = [(i, r) for i, r in enumerate(requests) if r.sampling.greedy == greedy]
        if not group:
            continue
        done, d, c, g = run_slots(target, group, min(slots, len(group)), loop, params, attention, greedy,
                                  refill_at=refill_at, on_done=on_done, admit_order=admit_order)
        for i, completion in done.items():
            results[i] = completion
        decode_s, compile_s, graphs = decode_s + d, compile_s + c, graphs + g
    return Completions(results, _metrics(results, time.perf_counter() - start, compile_s, decode_s, graphs))
