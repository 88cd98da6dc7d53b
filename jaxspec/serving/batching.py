"""Padded batches of a few bucketed shapes, so a long job compiles a handful of graphs."""

from __future__ import annotations

import jax
import numpy as np

from jaxspec.decoding.sampling import SamplingArrays
from jaxspec.decoding.state import Batch, Shared
from jaxspec.decoding.stop_strings import StopPlan
from jaxspec.model.tokenizer import vocab_bytes
from jaxspec.sampling_params import row_values
from jaxspec.serving.requests import Request
from jaxspec.structured_outputs import compile_constraint
from pallas_kernels.tree_attention import BLOCK_K

MIN_BUCKET = 16


def bucket(n: int, minimum: int = MIN_BUCKET) -> int:
    """The power of two >= n (at least `minimum`): prompt lengths, budgets and batch sizes are
    padded to these so a long job compiles a handful of graphs."""
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())


def batch_shapes(groups: list[list[Request]], slack: int) -> list[tuple[int, int, int, int]]:
    """(rows, prompt length, budget, cache capacity) each batch of a call is padded to (slack:
    the loop's cache slots past a row's budget). On accelerators every batch takes the call's
    largest rows, budget and capacity, so all batches share one loop graph and differ only in
    their prefill's prompt bucket: a decode step there reads its weights once whatever the rows
    (B <= 64), the fused attention kernel reads each row's own length whatever the cache's
    capacity, and the loop ends at the rows' own budgets. (The 164-record job's 21 static batches
    had compiled 19 graphs, 3-4 s each on an H200.) On the CPU a padded row costs as much as a
    real one (rows padded to 16 made that job decode 2.9x slower there, 278 against 95 s) and
    XLA's attention reads the whole cache, so each batch keeps its own powers of two."""
    own = [(bucket(len(g), 1), bucket(max(len(r.token_ids) for r in g)), bucket(max(r.max_new_tokens for r in g)))
           for g in groups]
    if jax.default_backend() == "cpu":
        return [(rows, p, m, cache_capacity(p, m, slack)) for rows, p, m in own]
    rows, max_out = max(s[0] for s in own), max(s[2] for s in own)
    capacity = cache_capacity(max(s[1] for s in own), max_out, slack)
    return [(rows, prompt_len, max_out, capacity) for _, prompt_len, _ in own]


def plan_batches(requests: list[Request], max_batch_size: int) -> list[list[int]]:
    """Indices of requests grouped by length, so each batch pads little."""
    order = sorted(range(len(requests)), key=lambda i: len(requests[i].token_ids))
    return [order[i : i + max_batch_size] for i in range(0, len(order), max_batch_size)]


def stop_plan(requests: list[Request], model=None) -> StopPlan:
    """A call's stops (stop_strings.StopPlan): stop-id slots for the request with the most (at
    least 1, a power of two) and the automata of their stop strings over `model`'s tokens."""
    sets = [r.sampling.stop for r in requests if r.sampling.stop]
    constrained = [r.sampling.structured_outputs for r in requests if r.sampling.structured_outputs is not None]
    vocab = vocab_bytes(model.tokenizer, model.config.vocab_size) if sets or constrained else None
    width = bucket(max((len(r.sampling.stop_token_ids) for r in requests), default=1), 1)
    biased = max((len(r.sampling.logit_bias) for r in requests), default=0)
    tables = {c: compile_constraint(c, vocab, model.config.eos_token_ids) for c in dict.fromkeys(constrained)}
    return StopPlan(sets, vocab, width, bucket(biased, 1) if biased else 0, tables,
                    model.config.vocab_size if tables else 1)


def make_batch(requests: list[Request], batch_size: int, prompt_len: int, pad_id: int,
               stops: StopPlan | None = None) -> Batch:
    """The padded device batch of `requests`; stops: the call's (default: these requests' stop ids,
    no stop strings)."""
    stops = stops or stop_plan(requests)
    tokens = np.full((batch_size, prompt_len), pad_id, np.int32)
    stop_ids = np.full((batch_size, stops.id_width), -1, np.int32)
    stop_sets = np.zeros(batch_size, np.int32)
    constraint_sets = np.zeros(batch_size, np.int32)
    lens = np.zeros(batch_size, np.int32)
    max_new = np.ones(batch_size, np.int32)
    seeds = np.zeros(batch_size, np.uint32)
    bias_ids = np.full((batch_size, stops.bias_width), -1, np.int32)
    bias_values = np.zeros((batch_size, stops.bias_width), np.float32)
    for i, r in enumerate(requests):
        tokens[i, : len(r.token_ids)] = r.token_ids
        lens[i] = len(r.token_ids)
        max_new[i] = r.max_new_tokens
        seeds[i] = r.seed
        stop_ids[i, : len(r.sampling.stop_token_ids)] = r.sampling.stop_token_ids
        stop_sets[i] = stops.set_of(r.sampling.stop)
        constraint_sets[i] = stops.constraint_index[r.sampling.structured_outputs]
        for j, (token, bias) in enumerate(r.sampling.logit_bias):
            bias_ids[i, j], bias_values[i, j] = token, bias
    sampling = SamplingArrays(row_values([r.sampling for r in requests], batch_size))
    return Batch(tokens, lens, max_new, sampling, seeds, stop_ids, stop_sets, Shared(stops.tables), bias_ids,
                 bias_values, constraint_sets, Shared(stops.constraint_tables))


def cache_capacity(prompt_len: int, max_out: int, slack: int) -> int:
    """Cache slots for a bucket: a multiple of the attention kernel's block and, past 8 blocks, of
    8 blocks. The kernel splits the prefix into a divisor of its block count, and a count with few
    divisors (129 = 3 x 43 blocks at a prefix of 8192) left it 1.5x slower than the XLA path on an
    H200 (7.7 against 5.2 ms per 8B step)."""
    blocks = -(-(prompt_len + max_out + slack) // BLOCK_K)
    return (blocks if blocks <= 8 else -(-blocks // 8) * 8) * BLOCK_K
