"""The static scheduler: padded batches of similar requests, each decoded to its longest row's end
by one compiled graph (jaxspec.decoding.loop.decode). Every batch of a call is padded to the
same rows and budget on accelerators (batching.batch_shapes), and all of the call's graphs are
compiled up front, in parallel."""

from __future__ import annotations

import time

import jax

from jaxspec.decoding.loop import decode
from jaxspec.graphs import GraphCache
from jaxspec.model.loading import Model
from jaxspec.model.sharding import replicate
from jaxspec.serving.batching import batch_shapes, cache_capacity, make_batch, plan_batches
from jaxspec.serving.requests import Request
from jaxspec.serving.stats import Completion, completion


def _batches(target: Model, requests: list[Request], groups: list[list[int]], loop, params, attention: str):
    """(request indices, padded batch, decode's static arguments) of each group."""
    out = []
    shapes = batch_shapes([[requests[i] for i in g] for g in groups])
    for group, (rows, prompt_len, max_out) in zip(groups, shapes):
        reqs = [requests[i] for i in group]
        # Whole on every device of the target's mesh: every process passes the same batch.
        batch = replicate(make_batch(reqs, rows, prompt_len, target.config.pad_token_id), target.mesh)
        static = dict(loop=loop, capacity=cache_capacity(prompt_len, max_out, loop.slack), max_out=max_out,
                      greedy_only=all(r.sampling.greedy for r in reqs), attention=attention)
        out.append((group, batch, static))
    return out


def run_static(target: Model, requests: list[Request], max_batch_size: int, loop, params, attention: str,
               graphs: GraphCache, on_done=None, groups: list[list[int]] | None = None
               ) -> tuple[list[Completion], float]:
    """Decodes `requests` in batches: `groups` (lists of request indices, each at most
    max_batch_size), by default similar prompt lengths together (plan_batches). on_done(pairs,
    decode_s, compile_s) after each batch with its (request index, Completion) pairs. Returns
    (completions in request order, decode seconds)."""
    groups = groups if groups is not None else plan_batches(requests, max_batch_size)
    batches = _batches(target, requests, groups, loop, params, attention)
    compile_s, executables = graphs.precompile([(decode, static, (target.weights, params, batch))
                                                for _, batch, static in batches])
    results: list[Completion | None] = [None] * len(requests)
    decode_s = 0.0
    for (group, batch, static), exe in zip(batches, executables):
        spent = 0.0
        if exe is None:  # past the cache's size: compiled as its turn comes
            exe, spent = graphs.executable(decode, static, target.weights, params, batch)
        t0 = time.perf_counter()
        out = jax.device_get(exe(target.weights, params, batch))
        decode_s += time.perf_counter() - t0
        for row, i in enumerate(group):
            results[i] = completion(target.tokenizer, requests[i], out, row)
        if on_done is not None:
            on_done([(i, results[i]) for i in group], time.perf_counter() - t0, spent + compile_s)
        compile_s = 0.0  # the up-front compiles are reported once, with the first batch
    return results, decode_s
