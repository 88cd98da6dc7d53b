"""Continuous batching: B decode slots kept busy; rows that finish are refilled with new requests.

The engine's shape stays: decoding is a jitted while_loop with no host round trip per token. It
returns to the host once `refill_at` rows have finished since it was entered (or no row runs, or
after `max_steps` steps); the host writes those rows' completions, a jitted prefill-and-insert
(`admit`, JetStream's prefill / insert split) starts new requests in the freed slots of every
cache, and the loop resumes. New requests are prefilled in their own prompt-length bucket, so a
job compiles one loop graph and a few admit graphs. Per-request output, statistics and seeds do
not depend on the slot or the neighbours: each row's random stream depends on its seed and token
index only, and a row's statistics count only its own rounds.
"""

from __future__ import annotations

import collections
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.decoding.loop import advance
from jaxspec.decoding.slots import admit, begin, take_rows
from jaxspec.decoding.state import RUNNING
from jaxspec.errors import InputError
from jaxspec.graphs import GraphCache
from jaxspec.model.loading import Model
from jaxspec.model.sharding import replicate
from jaxspec.serving.batching import bucket, cache_capacity, make_batch
from jaxspec.serving.stats import completion


def default_refill_at(slots: int) -> int:
    """Slots to free before refilling. CPU: one (embedded model, 16 slots, lognormal job:
    refilling at 1 / 4 free slots gave 1.94 / 1.76 records/s). GPUs: an eighth of the slots. At
    the 8B shape on an H200 a return to the host (sync, prefill, insert) costs about two decode
    steps; with lengths hidden, 32 slots ran 1.90x / 2.06x static at refill 2 / 4 and 64 slots
    2.40x / 2.37x at 4 / 8 (README, Continuous batching)."""
    return 1 if jax.default_backend() == "cpu" else max(1, slots // 8)


ADMIT_ORDERS = ("longest", "arrival")


def run_slots(target: Model, requests, slots: int, loop, params, attention: str, greedy_only: bool, graphs: GraphCache,
              *, refill_at: int | None = None, max_steps: int | None = None, on_done=None,
              admit_order: str = "longest"):
    """Decodes `requests` (indices into the caller's list, Request) through `slots` slots.
    admit_order "longest": the largest budget first (an offline job knows every budget, and
    starting the long records early leaves short ones to fill the slots at the end; admitting in
    budget-ascending order made the 8B job on an H200 0.74-0.90x static); "arrival": in the
    caller's order, for rows whose budget says nothing of where they end (EOS).
    on_done(pairs, decode_s, compile_s): called at returns to the host with the (index,
    Completion) pairs that finished, and the seconds spent since its last call. Returns
    (completions by index, decode_s)."""
    if admit_order not in ADMIT_ORDERS:
        raise InputError(f"admit_order must be one of {', '.join(ADMIT_ORDERS)}; got {admit_order!r}")
    pad = target.config.pad_token_id
    reqs = dict(requests)
    max_out = bucket(max(r.max_new_tokens for r in reqs.values()))
    # Room for the longest row (its own prompt + budget), not the longest prompt plus the largest
    # budget; and for the widest prompt bucket, which a prefill writes whole.
    longest = max(len(r.token_ids) + r.max_new_tokens for r in reqs.values())
    capacity = max(cache_capacity(longest, 0, loop.slack), max(bucket(len(r.token_ids)) for r in reqs.values()))
    refill_at = refill_at or default_refill_at(slots)
    max_steps = max_steps or max_out
    static = dict(loop=loop, capacity=capacity, max_out=max_out, greedy_only=greedy_only)
    timing = {"decode": 0.0, "compile": 0.0}

    def call(fn, static, *args):
        exe, spent = graphs.executable(fn, static, *args)
        timing["compile"] += spent
        return exe(*args)

    # Whole on every device of the target's mesh, as the static scheduler's batches.
    state, batch = call(begin, static, target.weights, params, replicate(make_batch([], slots, 1, pad), target.mesh))
    by_budget = lambda i: (-reqs[i].max_new_tokens, len(reqs[i].token_ids))  # noqa: E731
    pending = collections.deque(sorted(reqs, key=by_budget) if admit_order == "longest" else reqs)
    holder: list[int | None] = [None] * slots
    done: dict[int, object] = {}
    fields = tuple(f for f in loop.result_fields if f != "finish")  # finish is fetched at every return

    def harvest(got, finish, indices):
        """Completions of the rows gathered at the last return (`got`: device arrays, row j = indices[j])."""
        out = {**jax.device_get(got), "finish": finish}
        for j, index in enumerate(indices):
            done[index] = completion(target.tokenizer, reqs[index], out, j)
        return [(i, done[i]) for i in indices]

    unreported = {"decode": 0.0, "compile": 0.0}  # seconds since on_done's last call

    def account(t0, compiled_before):
        compiled = timing["compile"] - compiled_before
        spent = time.perf_counter() - t0 - compiled
        timing["decode"] += spent
        unreported["decode"] += spent
        unreported["compile"] += compiled

    def emit(pairs):
        if on_done is not None and pairs:
            on_done(pairs, unreported["decode"], unreported["compile"])
            unreported.update(decode=0.0, compile=0.0)

    ended_rows = None  # (device arrays, finish, indices) of the rows that ended at the last return
    while pending or any(h is not None for h in holder):
        t0, compiled_before = time.perf_counter(), timing["compile"]
        free = [i for i, h in enumerate(holder) if h is None]
        taken = [pending.popleft() for _ in range(min(len(free), len(pending)))]
        by_bucket: dict[int, list[tuple[int, int]]] = {}
        for slot, index in zip(free, taken):
            by_bucket.setdefault(bucket(len(reqs[index].token_ids)), []).append((slot, index))
            holder[slot] = index
        for width, group in by_bucket.items():
            rows = bucket(len(group), 1)
            new = replicate(make_batch([reqs[i] for _, i in group], rows, width, pad), target.mesh)
            where = np.full(rows, slots, np.int32)  # padding rows land past the end: dropped
            where[: len(group)] = [s for s, _ in group]
            state, batch = call(admit, static, target.weights, params, state, batch, new, jnp.asarray(where))
        need = jnp.int32(min(refill_at, len(pending)) if pending else slots + 1)
        state = call(advance, dict(loop=loop, greedy_only=greedy_only, attention=attention),
                     target.weights, params, batch, state, need, jnp.int32(max_steps))
        # The last return's rows are fetched and turned into completions (and on_done writes
        # them) while the device runs the admit and advance just dispatched.
        if ended_rows:
            emit(harvest(*ended_rows))
        finish = np.asarray(jax.device_get(state.finish))  # waits for the advance
        ended = [s for s, h in enumerate(holder) if h is not None and finish[s] != RUNNING]
        ended_rows = None
        if ended:  # gathered on the device now: the next admit donates the state
            rows = np.zeros(slots, np.int32)
            rows[: len(ended)] = ended
            got = call(take_rows, {}, {f: getattr(state, f) for f in fields}, jnp.asarray(rows))
            ended_rows = (got, finish[ended], [holder[s] for s in ended])
            for s in ended:
                holder[s] = None
        account(t0, compiled_before)
    if ended_rows:
        t0 = time.perf_counter()
        pairs = harvest(*ended_rows)
        account(t0, timing["compile"])
        emit(pairs)
    return done, timing["decode"]
