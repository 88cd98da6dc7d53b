"""Structured-output constraints on the device: each row's automaton state rides in the loop
state, every distribution a token is drawn from is masked by the state reached before it, and a
row ends when its constraint is complete.

A call's distinct constraints (jaxspec.structured_outputs.ConstraintTable) stack into one
ConstraintTables (set 0: no constraint, one state that allows every token) that rows index by
their set number. Masking a verify pass's node needs the state after the drafted tokens on its
path (node_states); the same rule masks a draft model's or an EAGLE-3 head's proposals, so both
the target's p and the draft's q are the constrained distributions, and the acceptance rule stays
exact. A point-mass proposal (n-gram, suffix) that the constraint forbids has p = 0 there and is
rejected by the verify pass: its draft is cut at the first disallowed token.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import struct


@struct.dataclass
class ConstraintTables:
    """[sets, ...] stacks of the call's compiled constraints (structured_outputs.ConstraintTable)."""

    classes: jnp.ndarray  # [sets, V] int32 each token's column; [1, 1] when no row is constrained
    next: jnp.ndarray  # [sets, S, C] int16/int32 state after a column's token, -1 where not allowed
    done: jnp.ndarray  # [sets, S] bool: complete, only an EOS may follow

    @property
    def on(self) -> bool:
        """Whether any row of the call is constrained (a static shape: else no work at all)."""
        return self.classes.shape[1] > 1

    @classmethod
    def stack(cls, tables, vocab_size: int) -> "ConstraintTables":
        """Set 0 (unconstrained) then `tables`, padded to common state and column counts."""
        if not tables:
            return cls(np.zeros((1, 1), np.int32), np.zeros((1, 1, 1), np.int16), np.zeros((1, 1), bool))
        states = -(-max(len(t.next) for t in tables) // 8) * 8
        columns = -(-max(t.next.shape[1] for t in tables) // 128) * 128
        dtype = np.int16 if states < 2**15 else np.int32
        classes = np.zeros((1 + len(tables), vocab_size), np.int32)
        nxt = np.full((1 + len(tables), states, columns), -1, dtype)
        done = np.zeros((1 + len(tables), states), bool)
        nxt[0, 0, 0] = 0  # set 0: every token (column 0) keeps state 0
        for i, t in enumerate(tables, 1):
            classes[i] = t.classes
            nxt[i, : len(t.next), : t.next.shape[1]] = t.next
            done[i, : len(t.done)] = t.done
        return cls(classes, nxt, done)


def allowed(tables: ConstraintTables, sets: jnp.ndarray, states: jnp.ndarray) -> jnp.ndarray:
    """sets [b], states [b, ...] -> [b, ..., V] bool: the tokens each state allows. A dead state
    (-1: past a forbidden draft) or a complete one allows everything: nothing drawn there is kept."""
    b, extra = states.shape[0], states.shape[1:]
    flat = states.reshape(b, -1)
    s = jnp.maximum(flat, 0)
    rows = tables.next[sets[:, None], s]  # [b, m, C]
    cls = jnp.broadcast_to(tables.classes[sets][:, None, :], (b, flat.shape[1], tables.classes.shape[1]))
    ok = jnp.take_along_axis(rows, cls, axis=-1) >= 0
    free = (flat < 0) | tables.done[sets[:, None], s]
    return (ok | free[..., None]).reshape((b,) + extra + (-1,))


def masked(logits: jnp.ndarray, tables: ConstraintTables, sets: jnp.ndarray, states: jnp.ndarray) -> jnp.ndarray:
    """logits [b, ..., V] (states [b, ...]) with the tokens the constraints forbid at -inf."""
    return jnp.where(allowed(tables, sets, states), logits, -jnp.inf)


def advance(tables: ConstraintTables, sets: jnp.ndarray, states: jnp.ndarray, tokens: jnp.ndarray) -> jnp.ndarray:
    """The state after each token (states, tokens [b, ...], sets [b]); -1 where it is forbidden
    or the state is already dead."""
    s = jnp.maximum(states, 0)
    sets = sets.reshape(sets.shape + (1,) * (states.ndim - 1))
    nxt = tables.next[sets, s, tables.classes[sets, tokens]].astype(jnp.int32)
    return jnp.where(states < 0, -1, nxt)


def node_states(tables: ConstraintTables, sets: jnp.ndarray, root: jnp.ndarray, tokens: jnp.ndarray,
                parents) -> jnp.ndarray:
    """The state at each node of a proposed tree (tokens [b, t], node 0 the last committed token,
    whose state is root [b]; `parents` static): node i's state has read the tokens on its path."""
    out = [root]
    for i in range(1, tokens.shape[1]):
        out.append(advance(tables, sets, out[int(parents[i])], tokens[:, i]))
    return jnp.stack(out, axis=1)


def step_constraints(tables: ConstraintTables, sets: jnp.ndarray, state: jnp.ndarray, new: jnp.ndarray,
                     count: jnp.ndarray):
    """Feeds each row's first count[b] tokens of new [b, m] from state [b] -> (the first position
    whose token completes the constraint [b], m where none; the state after each position [b, m])."""
    m = new.shape[1]
    first = jnp.full(state.shape, m, jnp.int32)
    after = []
    for j in range(m):
        nxt = advance(tables, sets, state, new[:, j])
        live = j < count
        hit = live & tables.done[sets, jnp.maximum(nxt, 0)] & (nxt >= 0) & (first == m)
        first = jnp.where(hit, j, first)
        state = jnp.where(live, nxt, state)
        after.append(state)
    return first, jnp.stack(after, axis=1)


@struct.dataclass
class RowConstraints:
    """What a drafter needs to propose under the rows' constraints: the tables, each row's set and
    its state after the committed tokens."""

    tables: ConstraintTables
    sets: jnp.ndarray  # [b]
    state: jnp.ndarray  # [b]

    def allowed(self, states: jnp.ndarray) -> jnp.ndarray:
        return allowed(self.tables, self.sets, states)

    def masked(self, logits: jnp.ndarray, states: jnp.ndarray) -> jnp.ndarray:
        return masked(logits, self.tables, self.sets, states)

    def advance(self, states: jnp.ndarray, tokens: jnp.ndarray) -> jnp.ndarray:
        return advance(self.tables, self.sets, states, tokens)
