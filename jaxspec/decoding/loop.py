"""The one decode driver: a Loop's steps inside one `lax.while_loop`, no host round trip per token.

A Loop (plain.PlainLoop, speculative.SpeculativeLoop) is a frozen, hashable value (a static
argument of jit) with three pure functions over its state pytree:

    state = loop.start(weights, params, batch, capacity, max_out, greedy_only)  # prefill + first token
    room  = loop.fits(state, batch)                                              # [b]: a step has room
    state = loop.step(weights, params, batch, state, greedy_only, attention)     # every running row

and the names of the state fields a caller reads back (`result_fields`: out_tokens,
num_generated, finish, and a speculative loop's rounds and accepted_per_position). `decode`
runs a fresh batch to the end as one graph; `advance` continues a state (slots.begin's or
slots.admit's) until enough rows have finished or no row runs: the schedulers' loop, one graph
for every prompt length of a call. Both are `run_loop`.
"""

from __future__ import annotations

import functools
from typing import Protocol

import jax
import jax.numpy as jnp

from jaxspec.decoding.state import FINISH_LENGTH, RUNNING, Batch


class Loop(Protocol):
    result_fields: tuple[str, ...]

    def start(self, weights, params, batch: Batch, capacity: int, max_out: int, greedy_only: bool,
              attention: str = "xla"): ...

    def fits(self, state, batch: Batch) -> jnp.ndarray: ...

    def step(self, weights, params, batch: Batch, state, greedy_only: bool, attention: str): ...


def run_loop(loop: Loop, weights, params, batch: Batch, state, greedy_only: bool, attention: str,
             need=None, max_steps=None):
    """Steps while a row runs and every running row has room; also, when given, until `need`
    more rows have finished than at entry or after `max_steps` steps ([] int32 each)."""
    done_at_entry = jnp.sum(state.finish != RUNNING)

    def cond(carry):
        s, i = carry
        running = s.finish == RUNNING
        go = jnp.any(running) & jnp.all(jnp.where(running, loop.fits(s, batch), True))
        if need is not None:
            go &= jnp.sum(s.finish != RUNNING) - done_at_entry < need
        if max_steps is not None:
            go &= i < max_steps
        return go

    def body(carry):
        s, i = carry
        return loop.step(weights, params, batch, s, greedy_only, attention), i + 1

    return jax.lax.while_loop(cond, body, (state, jnp.zeros((), jnp.int32)))[0]


def read_back(loop: Loop, state) -> dict:
    """The state's fields a caller reads back (loop.result_fields)."""
    return {f: getattr(state, f) for f in loop.result_fields}


def results(fields: dict, xp=jnp) -> dict:
    """read_back()'s fields, on the device or (xp=numpy) the host, with the rows still running
    marked as stopped by length: their cache is full."""
    return {**fields, "finish": xp.where(fields["finish"] == RUNNING, FINISH_LENGTH, fields["finish"])}


@functools.partial(jax.jit, static_argnames=("loop", "capacity", "max_out", "greedy_only", "attention"))
def decode(weights, params, batch: Batch, *, loop: Loop, capacity: int, max_out: int, greedy_only: bool,
           attention: str = "xla") -> dict:
    """Prefill and the whole loop over a fresh batch as one compiled graph -> results()."""
    state = loop.start(weights, params, batch, capacity, max_out, greedy_only, attention)
    return results(read_back(loop, run_loop(loop, weights, params, batch, state, greedy_only, attention)))


@functools.partial(jax.jit, static_argnames=("loop", "greedy_only", "attention"), donate_argnames=("state",))
def advance(weights, params, batch: Batch, state, need, max_steps, *, loop: Loop, greedy_only: bool, attention: str):
    """Continues a loop (the continuous scheduler's slots) until `need` more rows have finished,
    no row runs, or max_steps steps."""
    return run_loop(loop, weights, params, batch, state, greedy_only, attention, need, max_steps)
