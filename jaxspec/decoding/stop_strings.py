"""Stop strings on the device: a token-level automaton per set of stop strings, stepped inside the
decode loop, so a row ends in the round that completes a stop, even inside an accepted chunk.

On the host, the stops' bytes become an Aho-Corasick automaton (state = the longest stop prefix the
text ends with), and feeding each token's bytes from each state gives a table
`[state, token] -> next state`, or -(1 + i) where stop i is completed inside that token. The
output's bytes are matched from its first generated token on, as vLLM matches the output text.
A call's distinct stop sets stack into one array [sets, states, vocab] (set 0: no stops, all zeros)
that every row indexes with its set number; the loop carries each row's state.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np

from jaxspec.decoding.constraints import ConstraintTables


def byte_automaton(stops: tuple[bytes, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Aho-Corasick over bytes -> (delta [states, 256] int32, done [states] int32: the stop that a
    state completes, the lowest index of those that end there, or -1)."""
    goto = [dict()]
    done = [-1]
    for i, s in enumerate(stops):
        node = 0
        for b in s:
            if b not in goto[node]:
                goto.append(dict())
                done.append(-1)
                goto[node][b] = len(goto) - 1
            node = goto[node][b]
        if done[node] < 0:
            done[node] = i
    delta = np.zeros((len(goto), 256), np.int32)
    fail = [0] * len(goto)
    queue = []
    for b, child in goto[0].items():
        delta[0, b] = child
        queue.append(child)
    while queue:  # breadth first: a node's failure state is complete before its children's
        node = queue.pop(0)
        if done[node] < 0 and done[fail[node]] >= 0:
            done[node] = done[fail[node]]  # a shorter stop ends here too
        delta[node] = delta[fail[node]]
        for b, child in goto[node].items():
            fail[child] = delta[fail[node], b] if node else 0
            delta[node, b] = child
            queue.append(child)
    return delta, np.asarray(done, np.int32)


@functools.lru_cache(maxsize=64)
def token_table(stops: tuple[str, ...], vocab: tuple[bytes, ...]) -> np.ndarray:
    """[states, len(vocab)] int32: the state after a token's bytes from each state, or -(1 + i)
    where stop i completes inside it (the first completed, byte by byte)."""
    delta, done = byte_automaton(tuple(s.encode("utf-8") for s in stops))
    lengths = np.array([len(t) for t in vocab])
    width = max(1, lengths.max(initial=0))
    data = np.zeros((len(vocab), width), np.uint8)
    for i, t in enumerate(vocab):
        data[i, : len(t)] = np.frombuffer(t, np.uint8)
    states = np.broadcast_to(np.arange(len(delta))[:, None], (len(delta), len(vocab))).copy()
    matched = np.full(states.shape, -1, np.int32)
    for j in range(width):  # every start state and token at once, one byte position at a time
        live = (j < lengths)[None, :] & (matched < 0)
        states = np.where(live, delta[states, data[None, :, j]], states)
        matched = np.where(live & (done[states] >= 0), done[states], matched)
    return np.where(matched >= 0, -1 - matched, states).astype(np.int32)


class StopPlan:
    """A call's stops, one shape for every batch of the call (so its batches share graphs): the
    stop-id slots per row (id_width) and its distinct stop-string sets' tables, stacked, with each
    set's number. With no stop strings the table is one zero ([1, 1, 1]: any gather reads 0).
    bias_width: the call's logit-bias slots per row (0 when no request has a logit_bias), carried
    here as the other per-token rule of the call's shape; and its structured-output constraints'
    automata (constraints.ConstraintTables), each constraint's number in constraint_index."""

    def __init__(self, stop_sets=(), vocab: tuple[bytes, ...] | None = None, id_width: int = 1, bias_width: int = 0,
                 constraints: dict | None = None, vocab_size: int = 1):
        self.id_width, self.bias_width = id_width, bias_width
        # the call's structured-output constraints: {StructuredOutputsParams: ConstraintTable}, stacked
        self.constraint_index = {None: 0, **{c: i for i, c in enumerate(constraints or {}, 1)}}
        self.constraint_tables = ConstraintTables.stack(list((constraints or {}).values()), vocab_size)
        self.index = {(): 0}
        for s in stop_sets:
            self.index.setdefault(tuple(s), len(self.index))
        tables = [np.zeros((1, len(vocab) if vocab else 1), np.int32)]
        tables += [token_table(s, vocab) for s in list(self.index)[1:]]
        states = 1 << (max(len(t) for t in tables) - 1).bit_length()  # a power of two: few shapes
        dtype = np.int16 if states < 2**15 else np.int32
        self.tables = np.zeros((len(tables), states, tables[-1].shape[1]), dtype)
        for i, t in enumerate(tables):
            self.tables[i, : len(t)] = t

    def set_of(self, stops: tuple[str, ...]) -> int:
        return self.index[stops]


def step_stops(tables: jnp.ndarray, sets: jnp.ndarray, state: jnp.ndarray, new: jnp.ndarray, count: jnp.ndarray):
    """Feeds each row's first count[b] tokens of new [b, m] through its table from state [b] ->
    (the first position where a stop completes [b], m where none; the state after each position
    [b, m], 0 after a completed stop)."""
    first = jnp.full(state.shape, new.shape[1], jnp.int32)
    after = []
    for j in range(new.shape[1]):  # m = a round's emitted tokens: a few gathers
        nxt = tables[sets, state, new[:, j]].astype(jnp.int32)
        hit = (nxt < 0) & (j < count) & (first == new.shape[1])
        first = jnp.where(hit, j, first)
        state = jnp.where(j < count, jnp.maximum(nxt, 0), state)
        after.append(state)
    return first, jnp.stack(after, axis=1)
