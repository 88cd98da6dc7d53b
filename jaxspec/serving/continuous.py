"""Continuous batching: B decode slots kept busy; rows that finish are refilled with new requests.

The engine's shape stays: decoding is a jitted while_loop with no host round trip per token. It
returns to the host once `refill_at` rows have finished since it was entered (or no row runs, or
after `max_steps` steps); the host writes those rows' completions, a jitted prefill-and-insert
(`admit`, JetStream's prefill / insert split) starts new requests in the freed slots of every
cache, and the loop resumes. New requests are prefilled in their own prompt-length bucket, a
fixed number of rows at a time, so a job compiles one loop graph and one admit graph per prompt
bucket, all of them up front and in parallel. Per-request output, statistics and seeds do
not depend on the slot or the neighbours: each row's random stream depends on its seed and token
index only, and a row's statistics count only its own rounds.
"""

from __future__ import annotations

import collections
import contextlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.decoding.loop import advance
from jaxspec.decoding.slots import admit, begin, resume, shrink, take_rows
from jaxspec.decoding.state import RUNNING
from jaxspec.graphs import GraphCache
from jaxspec.model.loading import Model
from jaxspec.model.sharding import replicate
from jaxspec.serving.adaptive_k import TIMED_ROUNDS, AdaptiveK
from jaxspec.serving.batching import bucket, cache_capacity, make_batch, stop_plan
from jaxspec.serving.prefixes import PrefixStore
from jaxspec.serving.prompt_logprobs import with_prompt_logprobs
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
              admit_order: str = "longest", prefixes: PrefixStore | None = None, loops: dict | None = None):
    """Decodes `requests` ((index into the caller's list, Request) pairs) through `slots` slots.
    admit_order "longest": the largest budget first (an offline job knows every budget, and
    starting the long records early leaves short ones to fill the slots at the end; admitting in
    budget-ascending order made the 8B job on an H200 0.74-0.90x static); "arrival": in the
    caller's order, for rows whose budget says nothing of where they end (EOS).
    on_done(pairs, decode_s, compile_s): called at returns to the host with the (index,
    Completion) pairs that finished, and the seconds spent since its last call. Returns
    (completions by index, decode_s). admit_order is checked by runner.run. prefixes: the call's
    shared prompt prefixes (by request index). loops: adaptive K's ({K: loop}, decoding/adaptive.py;
    `loop` is the widest), chosen between at each return (serving/adaptive_k.py)."""
    return _Slots(target, dict(requests), slots, loop, params, attention, greedy_only, graphs, refill_at, max_steps,
                  on_done, admit_order, prefixes, loops).run()


class _Slots:
    """The host's side of the slots: which request each slot holds, what is pending and done, and
    the seconds spent (decoding, compiling) since on_done's last call."""

    def __init__(self, target, reqs: dict, slots, loop, params, attention, greedy_only, graphs, refill_at, max_steps,
                 on_done, admit_order, prefixes, loops):
        self.target, self.reqs, self.slots, self.params, self.graphs = target, reqs, slots, params, graphs
        self.on_done, self.prefixes = on_done, prefixes
        max_out = bucket(max(r.max_new_tokens for r in reqs.values()))
        # Room for the longest row (its own prompt + budget), not the longest prompt plus the largest
        # budget; and for the widest prompt bucket, which a prefill writes whole.
        longest = max(len(r.token_ids) + r.max_new_tokens for r in reqs.values())
        capacity = max(cache_capacity(longest, 0, loop.slack), max(bucket(len(r.token_ids)) for r in reqs.values()))
        self.refill_at = refill_at or default_refill_at(slots)
        self.admit_rows = min(bucket(self.refill_at, 1), bucket(slots, 1))  # rows per prefill-and-insert
        self.max_steps = max_steps or max_out
        self.static = dict(loop=loop, capacity=capacity, max_out=max_out, greedy_only=greedy_only, attention=attention)
        self.advance_static = dict(loop=loop, greedy_only=greedy_only, attention=attention)
        self.fields = tuple(f for f in loop.result_fields if f != "finish")  # finish is fetched at every return
        by_budget = lambda i: (-reqs[i].max_new_tokens, len(reqs[i].token_ids))  # noqa: E731
        self.pending = collections.deque(sorted(reqs, key=by_budget) if admit_order == "longest" else reqs)
        self.holder: list[int | None] = [None] * slots
        self.done: dict[int, object] = {}
        self.decode_s = self.compile_s = 0.0
        self.unreported = [0.0, 0.0]  # decode, compile seconds since on_done's last call
        # Whole on every device of the target's mesh, as the static scheduler's batches.
        self.stops = stop_plan(list(reqs.values()), target)  # one shape for every batch of the slots
        empty = replicate(make_batch([], slots, 1, target.config.pad_token_id, self.stops), target.mesh)
        with self.clock():  # reported with the first records that finish
            self.state, self.batch = self.call(begin, self.static, target.weights, params, empty)
            self.loops = loops or {None: loop}
            self.adaptive = AdaptiveK(tuple(loops), self.state.accepted_per_position.shape[1]) if loops else None
            self.k_ran = None  # the K of the last segment (adaptive K)
            self.counted = np.zeros((2, slots, self.adaptive.drafted.size if loops else 0), np.int64)
            self.compile_s += graphs.precompile(self.graphs_needed())[0]

    def admit_shape(self, index: int) -> tuple[int, int | None]:
        """A request's admit graph: (its prompt bucket, the bucket of the rest after its shared
        prefix, None without one)."""
        r = self.reqs[index]
        rest = self.prefixes.rest_width(index, len(r.token_ids), self.static["capacity"]) if self.prefixes else None
        return bucket(len(r.token_ids)), rest

    def graphs_needed(self) -> list:
        """(fn, static, args) of every graph the slots will run: an admit per admit shape, the
        loop and the gather of finished rows."""
        w, pad = self.target.weights, self.target.config.pad_token_id
        where = jnp.zeros(self.admit_rows, jnp.int32)
        calls = []
        for width, rest in sorted({self.admit_shape(i) for i in self.reqs}, key=str):
            new = replicate(make_batch([], self.admit_rows, width, pad, self.stops), self.target.mesh)
            new = new if rest is None else self.prefixes.placeholder(new, rest)
            calls.append((admit, self.static, (w, self.params, self.state, self.batch, new, where)))
        for loop in self.loops.values():
            static = {**self.advance_static, "loop": loop}
            calls.append((advance, static, (w, self.params, self.batch, self.state, jnp.int32(0), jnp.int32(0))))
            if 0 in self.loops and hasattr(loop.drafter, "catch_up"):
                calls.append((resume, {"loop": loop}, (self.params, self.batch, self.state)))
        rows = jnp.zeros(self.slots, jnp.int32)
        calls.append((take_rows, {}, ({f: getattr(self.state, f) for f in self.fields}, rows)))
        return calls

    def call(self, fn, static, *args):
        exe, spent = self.graphs.executable(fn, static, *args)
        self.compile_s += spent
        return exe(*args)

    @contextlib.contextmanager
    def clock(self):
        """The seconds inside, less those spent compiling, count as decoding."""
        t0, compiled_before = time.perf_counter(), self.compile_s
        yield
        compiled = self.compile_s - compiled_before
        decoding = time.perf_counter() - t0 - compiled
        self.decode_s += decoding
        self.unreported[0] += decoding
        self.unreported[1] += compiled

    def admit(self) -> None:
        """Starts pending requests in the free slots: one prefill-and-insert per admit shape."""
        free = [i for i, h in enumerate(self.holder) if h is None]
        taken = [self.pending.popleft() for _ in range(min(len(free), len(self.pending)))]
        by_shape: dict[tuple[int, int | None], list[tuple[int, int]]] = {}
        for slot, index in zip(free, taken):
            by_shape.setdefault(self.admit_shape(index), []).append((slot, index))
            self.holder[slot] = index
            self.counted[:, slot] = 0  # a new row's counters start at 0
        rows = self.admit_rows
        for (width, rest), group in by_shape.items():
            for part in (group[i : i + rows] for i in range(0, len(group), rows)):
                reqs = [self.reqs[i] for _, i in part]
                new = replicate(make_batch(reqs, rows, width, self.target.config.pad_token_id, self.stops),
                                self.target.mesh)
                if rest is not None:
                    new = self.prefixes.attach(new, [i for _, i in part], [r.token_ids for r in reqs],
                                               self.static["capacity"])
                where = np.full(rows, self.slots, np.int32)  # padding rows land past the end: dropped
                where[: len(part)] = [s for s, _ in part]
                self.state, self.batch = self.call(admit, self.static, self.target.weights, self.params, self.state,
                                                   self.batch, new, jnp.asarray(where))

    def advance(self) -> None:
        """Decodes until refill_at more rows have finished (every row, once nothing is pending);
        under adaptive K at the K chosen now, or a few timed rounds at each K first."""
        need = min(self.refill_at, len(self.pending)) if self.pending else len(self.holder) + 1
        if self.adaptive is None:
            self.run_loop(self.advance_static["loop"], need, self.max_steps)
            return
        if not self.pending:  # draining: back when the running rows fit in half the rows, to shrink
            live = sum(h is not None for h in self.holder)
            need = max(1, live - len(self.holder) // 2)
        k, timing = self.adaptive.next(len(self.holder))
        loop = self.loops[k]
        if k and self.k_ran == 0 and hasattr(loop.drafter, "catch_up"):
            self.state = self.call(resume, {"loop": loop}, self.params, self.batch, self.state)
        self.k_ran = k
        if not timing:
            self.run_loop(loop, need, self.max_steps)
            return
        self.run_loop(loop, len(self.holder) + 1, 1)  # the graph's first run is not timed
        before = np.asarray(jax.device_get(self.state.rounds))
        t0 = time.perf_counter()
        self.run_loop(loop, len(self.holder) + 1, TIMED_ROUNDS)
        after = np.asarray(jax.device_get(self.state.rounds))
        self.adaptive.timed(k, len(self.holder), time.perf_counter() - t0, int((after - before).max()))

    def shrink(self) -> None:
        """Adaptive K, once nothing is pending: when the running rows fit in half the loop's rows
        (or less), the loop goes on over a power of two of rows that holds them (graphs of their
        own, timed afresh), so a draining job stops paying for rows that finished."""
        live = [s for s, h in enumerate(self.holder) if h is not None]
        rows = bucket(len(live), 1)
        if self.pending or not live or rows > len(self.holder) // 2:
            return
        free = [s for s, h in enumerate(self.holder) if h is None]
        keep = live + free[: rows - len(live)]  # finished rows pad the rest
        self.state, self.batch = self.call(shrink, {}, self.state, self.batch, jnp.asarray(keep, jnp.int32))
        self.holder = [self.holder[s] for s in keep]
        self.counted = self.counted[:, keep]

    def run_loop(self, loop, need: int, max_steps: int) -> None:
        self.state = self.call(advance, {**self.advance_static, "loop": loop}, self.target.weights, self.params,
                               self.batch, self.state, jnp.int32(need), jnp.int32(max_steps))

    def count_segment(self) -> None:
        """Adaptive K: the accepted and drafted counts per position of the segment just run (each
        row's counters less what was counted before), to the chooser."""
        now = np.stack(jax.device_get((self.state.accepted_per_position, self.state.drafted_per_position)))
        delta, self.counted = now - self.counted, now
        self.adaptive.record(delta[0].sum(0), delta[1].sum(0))

    def take_ended(self):
        """Gathers the rows that ended on the device (now: the next admit donates the state) and
        frees their slots -> (device arrays, finish codes, request indices), or None."""
        finish = np.asarray(jax.device_get(self.state.finish))  # waits for the advance
        if self.adaptive is not None:
            self.count_segment()
        ended = [s for s, h in enumerate(self.holder) if h is not None and finish[s] != RUNNING]
        if not ended:
            return None
        rows = np.zeros(len(self.holder), np.int32)
        rows[: len(ended)] = ended
        got = self.call(take_rows, {}, {f: getattr(self.state, f) for f in self.fields}, jnp.asarray(rows))
        indices = [self.holder[s] for s in ended]
        for s in ended:
            self.holder[s] = None
        return got, finish[ended], indices

    def harvest(self, got, finish, indices) -> list[tuple[int, object]]:
        """Completions of gathered rows (`got`: device arrays, row j = indices[j])."""
        out = {**jax.device_get(got), "finish": finish}
        for j, index in enumerate(indices):
            cached = self.prefixes.cached.get(index, 0) if self.prefixes else 0
            row = completion(self.target.tokenizer, self.reqs[index], out, j, self.target.config.eos_token_ids, cached)
            self.done[index] = with_prompt_logprobs(self.target, self.reqs[index], row)
        return [(i, self.done[i]) for i in indices]

    def report(self, pairs) -> None:
        if self.on_done is not None and pairs:
            self.on_done(pairs, *self.unreported)
            self.unreported = [0.0, 0.0]

    def run(self) -> tuple[dict, float]:
        ended = None  # the rows that ended at the last return
        while self.pending or any(h is not None for h in self.holder):
            with self.clock():
                if self.adaptive is not None:
                    self.shrink()
                self.admit()
                self.advance()
                # The last return's rows become completions (and on_done writes them) while the
                # device runs the admit and advance just dispatched.
                if ended:
                    self.report(self.harvest(*ended))
                ended = self.take_ended()
        if ended:
            with self.clock():
                pairs = self.harvest(*ended)
            self.report(pairs)
        return self.done, self.decode_s
