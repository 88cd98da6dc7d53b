"""The continuous scheduler's graphs besides `loop.advance`: empty slots, prefill-and-insert of new
requests into freed slots (JetStream's prefill / insert split), and the gather of finished rows."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxspec.decoding.state import Batch, Shared
from jaxspec.model.cache import KVCache


def insert_rows(big, new, slots: jnp.ndarray):
    """`big` (a loop state or Batch over all slots) with rows `slots` [n] replaced by `new`'s n
    rows; caches row by row in their own layout, scalars kept; a slot index past the end drops."""
    def put(b, n):
        if isinstance(b, KVCache):
            return b.insert(n, slots)
        if isinstance(b, Shared):  # one for all rows (the call's, the same in `new`)
            return b
        return b if b.ndim == 0 else b.at[slots].set(n, mode="drop")
    return jax.tree.map(put, big, new, is_leaf=lambda x: isinstance(x, (KVCache, Shared)))


def take_slots(big, rows: jnp.ndarray):
    """`big` (a loop state or Batch over all slots) cut to rows `rows` [n], in that order."""
    def take(b):
        if isinstance(b, KVCache):
            return b.take(rows)
        return b if isinstance(b, Shared) or b.ndim == 0 else b[rows]
    return jax.tree.map(take, big, is_leaf=lambda x: isinstance(x, (KVCache, Shared)))


def _slot_batch(batch: Batch) -> Batch:
    """The loop reads no prompt tokens or prefixes (prefill did): slots keep a [b, 1] stand-in."""
    return batch.replace(tokens=jnp.zeros((batch.tokens.shape[0], 1), jnp.int32), prefix=None)


@functools.partial(jax.jit, static_argnames=("loop", "capacity", "max_out", "greedy_only", "attention"))
def begin(weights, params, batch, *, loop, capacity, max_out, greedy_only, attention="xla"):
    """Prefills `batch` (on the continuous scheduler's first call, every slot empty: padding rows)."""
    return loop.start(weights, params, batch, capacity, max_out, greedy_only, attention), _slot_batch(batch)


@functools.partial(jax.jit, static_argnames=("loop", "capacity", "max_out", "greedy_only", "attention"),
                   donate_argnames=("state", "slots_batch"))
def admit(weights, params, state, slots_batch, new_batch, slots, *, loop, capacity, max_out, greedy_only,
          attention="xla"):
    """Prefills new_batch's rows and puts them into `slots` (past the end: padding, dropped)."""
    new = loop.start(weights, params, new_batch, capacity, max_out, greedy_only, attention)
    return insert_rows(state, new, slots), insert_rows(slots_batch, _slot_batch(new_batch), slots)


@jax.jit
def take_rows(fields: dict, rows: jnp.ndarray) -> dict:
    """Rows `rows` of each field, as new arrays (rows has a fixed length: one graph per job)."""
    return {f: a[rows] for f, a in fields.items()}


@functools.partial(jax.jit, static_argnames=("loop",), donate_argnames=("state",))
def resume(params, slots_batch, state, *, loop):
    """loop.resume: a drafter that fell behind during paused rounds (adaptive K at 0) catches up."""
    return loop.resume(params, slots_batch, state)


@jax.jit  # (nothing to donate: the cut arrays are new ones)
def shrink(state, slots_batch, rows: jnp.ndarray):
    """The slots' state and batch cut to rows `rows`: a draining job's loop runs fewer rows."""
    return take_slots(state, rows), take_slots(slots_batch, rows)
