"""The static scheduler: padded batches of similar requests, each decoded to its longest row's end
by one compiled graph (jaxspec.decoding.loop.decode)."""

from __future__ import annotations

import time

import jax

from jaxspec.decoding.loop import decode
from jaxspec.graphs import GraphCache
from jaxspec.model.loading import Model
from jaxspec.model.sharding import replicate
from jaxspec.serving.batching import bucket, cache_capacity, make_batch, plan_batches
from jaxspec.serving.requests import Request
from jaxspec.serving.stats import Completion, completion


def run_static(target: Model, requests: list[Request], max_batch_size: int, loop, params, attention: str,
               graphs: GraphCache, on_done=None) -> tuple[list[Completion], float]:
    """Decodes `requests` in batches of up to max_batch_size; on_done(pairs, decode_s, compile_s)
    after each batch with its (request index, Completion) pairs. Returns (completions in request
    order, decode seconds)."""
    results: list[Completion | None] = [None] * len(requests)
    decode_s = 0.0
    for group in plan_batches(requests, max_batch_size):
        reqs = [requests[i] for i in group]
        prompt_len = bucket(max(len(r.token_ids) for r in reqs))
        max_out = bucket(max(r.max_new_tokens for r in reqs))
        # Whole on every device of the target's mesh: every process passes the same batch.
        batch = replicate(make_batch(reqs, bucket(len(reqs), 1), prompt_len, target.config.pad_token_id), target.mesh)
        static = dict(loop=loop, capacity=cache_capacity(prompt_len, max_out, loop.slack), max_out=max_out,
                      greedy_only=all(r.sampling.greedy for r in reqs), attention=attention)
        exe, spent = graphs.executable(decode, static, target.weights, params, batch)
        t0 = time.perf_counter()
        out = jax.device_get(exe(target.weights, params, batch))
        decode_s += time.perf_counter() - t0
        for row, i in enumerate(group):
            results[i] = completion(target.tokenizer, reqs[row], out, row)
        if on_done is not None:
            on_done([(i, results[i]) for i in group], time.perf_counter() - t0, spent)
    return results, decode_s
