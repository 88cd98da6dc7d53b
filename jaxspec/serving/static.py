"""The static scheduler: padded batches of similar requests, each decoded to its longest row's end.

On accelerators every batch of a call is padded to the same rows, budget and cache capacity
(batching.batch_shapes), so its batches differ only in their prompt bucket: each runs as two
graphs, its bucket's prefill (slots.begin) and the call's one loop (loop.advance), and a call
compiles one loop whatever its prompt lengths. On the CPU each batch keeps shapes of its own, so
few loops would be shared: each batch runs as one graph (loop.decode). (The 164-record HumanEval
job at batch 16 compiled 37 graphs in 31.2 s split, 20 in 27.8 s whole, decoding at the same
205-213 tokens/s.) All of a call's graphs are compiled up front, in parallel."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.decoding.loop import advance, decode, read_back, results
from jaxspec.decoding.slots import begin
from jaxspec.graphs import GraphCache
from jaxspec.model.loading import Model
from jaxspec.model.sharding import replicate
from jaxspec.serving.batching import batch_shapes, make_batch, plan_batches, stop_plan
from jaxspec.serving.prefixes import PrefixStore
from jaxspec.serving.requests import Request
from jaxspec.serving.prompt_logprobs import with_prompt_logprobs
from jaxspec.serving.stats import Completion, completion


def _batches(target: Model, requests: list[Request], groups: list[list[int]], loop, attention: str,
             prefixes: PrefixStore | None):
    """(request indices, padded batch, begin's static arguments) of each group; its rows' shared
    prefixes attached from `prefixes`."""
    out = []
    shapes = batch_shapes([[requests[i] for i in g] for g in groups], loop.slack)
    stops = stop_plan(requests, target)  # one shape for the call: its batches share a loop graph
    for group, (rows, prompt_len, max_out, capacity) in zip(groups, shapes):
        reqs = [requests[i] for i in group]
        # Whole on every device of the target's mesh: every process passes the same batch.
        batch = replicate(make_batch(reqs, rows, prompt_len, target.config.pad_token_id, stops), target.mesh)
        if prefixes is not None:
            batch = prefixes.attach(batch, group, [r.token_ids for r in reqs], capacity)
        out.append((group, batch, dict(loop=loop, capacity=capacity, max_out=max_out,
                                       greedy_only=all(r.sampling.greedy for r in reqs), attention=attention)))
    return out


def _to_the_end(batch, start: dict) -> tuple:
    """advance's `need` and `max_steps`: more rows than the batch has, and its budget (a step
    commits at least one token per running row)."""
    return jnp.int32(batch.prompt_lens.shape[0] + 1), jnp.int32(start["max_out"])


def _loop_static(start: dict, attention: str) -> dict:
    return dict(loop=start["loop"], greedy_only=start["greedy_only"], attention=attention)


def _precompile(target: Model, batches, params, attention: str, graphs: GraphCache, shared: bool):
    """-> (seconds, per batch: its graphs' executables, None where past the cache's size). Shared
    loops are compiled from their prefills' output shapes and shardings, after them."""
    w = target.weights
    if not shared:
        spent, exes = graphs.precompile([(decode, {**start, "attention": attention}, (w, params, batch))
                                         for _, batch, start in batches])
        return spent, [(exe,) for exe in exes]
    spent, starts = graphs.precompile([(begin, start, (w, params, batch)) for _, batch, start in batches])
    calls = [(advance, _loop_static(start, attention),
              (w, params, exe.out_info[1], exe.out_info[0], *_to_the_end(batch, start)))
             for exe, (_, batch, start) in zip(starts, batches) if exe is not None]
    more, loops = graphs.precompile(calls)
    loops = iter(loops)
    return spent + more, [(exe, next(loops) if exe is not None else None) for exe in starts]


def _call(graphs: GraphCache, exe, fn, static: dict, *args) -> tuple[object, float]:
    """(fn's result, seconds spent compiling it now: a graph past the cache's size compiles as its turn comes)."""
    spent = 0.0
    if exe is None:
        exe, spent = graphs.executable(fn, static, *args)
    return exe(*args), spent


def _decode(target: Model, batch, start: dict, params, attention: str, graphs: GraphCache, exes, shared: bool):
    """One batch to its end -> (its results on the host, seconds spent compiling)."""
    w = target.weights
    if not shared:
        out, spent = _call(graphs, exes[0], decode, {**start, "attention": attention}, w, params, batch)
        return jax.device_get(out), spent
    (state, slot_batch), spent = _call(graphs, exes[0], begin, start, w, params, batch)
    state, more = _call(graphs, exes[1], advance, _loop_static(start, attention), w, params, slot_batch, state,
                        *_to_the_end(batch, start))
    return results(jax.device_get(read_back(start["loop"], state)), np), spent + more


def run_static(target: Model, requests: list[Request], max_batch_size: int, loop, params, attention: str,
               graphs: GraphCache, on_done=None, groups: list[list[int]] | None = None,
               prefixes: PrefixStore | None = None) -> tuple[list[Completion], float]:
    """Decodes `requests` in batches: `groups` (lists of request indices, each at most
    max_batch_size), by default similar prompt lengths together (plan_batches). on_done(pairs,
    decode_s, compile_s) after each batch with its (request index, Completion) pairs. Returns
    (completions in request order, decode seconds). prefixes: the call's shared prompt prefixes."""
    groups = groups if groups is not None else plan_batches(requests, max_batch_size)
    batches = _batches(target, requests, groups, loop, attention, prefixes)
    shared = jax.default_backend() != "cpu"  # one loop for the call (see the module docstring)
    compile_s, executables = _precompile(target, batches, params, attention, graphs, shared)
    done: list[Completion | None] = [None] * len(requests)
    decode_s = 0.0
    for (group, batch, start), exes in zip(batches, executables):
        t0 = time.perf_counter()
        out, spent = _decode(target, batch, start, params, attention, graphs, exes, shared)
        took = time.perf_counter() - t0 - spent
        decode_s += took
        for row, i in enumerate(group):
            cached = prefixes.cached.get(i, 0) if prefixes else 0
            done[i] = with_prompt_logprobs(target, requests[i], completion(target.tokenizer, requests[i], out, row,
                                                                           target.config.eos_token_ids, cached))
        if on_done is not None:
            on_done([(i, done[i]) for i in group], took, spent + compile_s)
        compile_s = 0.0  # the up-front compiles are reported once, with the first batch
    return done, decode_s
