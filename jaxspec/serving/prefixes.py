"""Shared prompt prefixes, prefilled once per call (as vLLM's automatic prefix caching and SGLang's
radix cache reuse them): requests whose prompts begin with the same whole blocks of tokens (a
system prompt, a few-shot preamble, a chat template's head, the n samples of one prompt) get that
prefix's keys and values from one prefill, copied into their cache rows on the device; their own
prefill runs only the rest.

The plan is a trie over blocks of PREFIX_BLOCK tokens: each prompt shares the deepest block
that another prompt of the call reaches too (a partial match counts to its last whole block), and
always runs at least its last token itself (its logits start the decode). A prefix is kept when
it saves at least MIN_SAVED tokens of prefill (it costs a graph of its own), the MAX_ENTRIES
that save most, as many as fit in `max_tokens` (RunOptions.prefix_cache_tokens: the store's
rows x width, its device memory in tokens of cache). Output is the same with sharing on or off: a prefix's keys and values are
computed as a prefill computes them (bit for bit in deterministic mode, which fixes every sum by
absolute position; in float32 to rounding, as any two batch shapes)."""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.decoding.state import Batch, PrefixUse, prefill_store
from jaxspec.graphs import GraphCache
from jaxspec.model.cache import KVCache
from jaxspec.model.loading import Model
from jaxspec.model.sharding import replicate
from jaxspec.serving.batching import bucket, cache_capacity

PREFIX_BLOCK = 16  # tokens: prefixes are shared in whole blocks
MIN_SAVED = 256  # prefill tokens a prefix must save to be kept
MAX_ENTRIES = 64  # prefixes kept per call, the ones that save most
PREFIX_CACHE_TOKENS = 32768  # the store's default bound, in cache tokens (4 GiB of bf16 keys and values at Llama-3.1-8B's shape)


@dataclasses.dataclass(frozen=True)
class PrefixPlan:
    """entries: each shared prefix's tokens; of: request index -> (entry, prefix length)."""

    entries: tuple[tuple[int, ...], ...]
    of: dict[int, tuple[int, int]]


def plan_prefixes(prompts: list[list[int]], block: int = PREFIX_BLOCK, min_saved: int = MIN_SAVED,
                  max_entries: int = MAX_ENTRIES, max_tokens: int = PREFIX_CACHE_TOKENS) -> PrefixPlan:
    """The shared prefixes of `prompts` (token id lists, one per request)."""
    children: dict[tuple[int, tuple[int, ...]], int] = {}  # (parent node, block) -> node; the root is 0
    passing, depth = [0], [0]  # per node: prompts through it, its blocks
    paths = []
    for p in prompts:
        node, path = 0, []
        for k in range((len(p) - 1) // block):  # whole blocks that leave the last token to run
            node = children.setdefault((node, tuple(p[k * block:(k + 1) * block])), len(passing))
            if node == len(passing):
                passing.append(0)
                depth.append(k + 1)
            passing[node] += 1
            path.append(node)
        paths.append(path)
    users: dict[int, list[int]] = {}  # node -> the prompts whose deepest shared node it is
    for i, path in enumerate(paths):
        shared = [node for node in path if passing[node] >= 2]  # a path's counts only fall
        if shared:
            users.setdefault(shared[-1], []).append(i)
    saved = {node: (len(who) - 1) * depth[node] * block for node, who in users.items()}
    kept, width = [], 0
    for n in sorted((n for n in users if saved[n] >= min_saved), key=lambda n: -saved[n])[:max_entries]:
        if bucket(len(kept) + 1, 1) * bucket(max(width, depth[n] * block)) <= max_tokens:  # the store's shape
            kept.append(n)
            width = max(width, depth[n] * block)
    entries = tuple(tuple(prompts[users[n][0]][:depth[n] * block]) for n in kept)
    of = {i: (e, len(entries[e])) for e, n in enumerate(kept) for i in users[n]}
    return PrefixPlan(entries, of)


class PrefixStore:
    """A call's shared prefixes on the device (one cache row each) and what was reused from them."""

    def __init__(self, target: Model, plan: PrefixPlan, attention: str, graphs: GraphCache):
        self.target, self.plan = target, plan
        rows, width = bucket(len(plan.entries), 1), bucket(max(len(e) for e in plan.entries))
        tokens = np.full((rows, width), target.config.pad_token_id, np.int32)
        lens = np.zeros(rows, np.int32)
        for e, entry in enumerate(plan.entries):
            tokens[e, : len(entry)] = entry
            lens[e] = len(entry)
        args = (target.weights, *replicate((jnp.asarray(tokens), jnp.asarray(lens)), target.mesh))
        static = dict(config=target.config, capacity=cache_capacity(width, 0, 0), attention=attention)
        exe, self.compile_s = graphs.executable(prefill_store, static, *args)
        t0 = time.perf_counter()
        self.cache: KVCache = jax.block_until_ready(exe(*args))
        self.run_s = time.perf_counter() - t0  # counts as decoding, as the prefills it spares do
        self.computed = int(lens.sum())  # prefill tokens the store ran
        self.reused = 0  # prompt tokens copied from it rather than run
        self.cached: dict[int, int] = {}  # request index -> its cached_tokens (the first user of
        # a prefix counts none: the store ran it for that request)
        self._paid: set[int] = set()  # entries whose first user has come

    def rest_width(self, index: int, prompt_len: int, capacity: int) -> int | None:
        """The padded width of the part of request `index`'s prompt that its prefill runs after
        its prefix; None where it has none, or its rest would not fit the cache after it."""
        n = self.plan.of.get(index, (0, 0))[1]
        return bucket(prompt_len - n) if n and n + bucket(prompt_len - n) <= capacity else None

    def placeholder(self, batch: Batch, width: int) -> Batch:
        """`batch` with rows that share no prefix but the shapes of rests of `width` (to compile for)."""
        rows = batch.tokens.shape[0]
        zeros = replicate((jnp.zeros(rows, jnp.int32),) * 2 + (jnp.zeros((rows, width), jnp.int32),), self.target.mesh)
        return batch.replace(prefix=PrefixUse(*zeros, store=self.cache))

    def attach(self, batch: Batch, indices: list[int], prompts: list[list[int]], capacity: int) -> Batch:
        """`batch` (rows: the requests `indices`, whose prompts are `prompts`, then padding) with
        the prefixes its rows share, or as it is where none does. Counts the reused tokens."""
        rows = batch.tokens.shape[0]
        lens = [self.plan.of.get(i, (0, 0))[1] for i in indices]
        while True:  # the rows' rests share one width: a prefix whose rest would not fit drops out
            width = bucket(max((len(p) - n for p, n in zip(prompts, lens)), default=1))
            fitting = [n if n + width <= capacity else 0 for n in lens]
            if fitting == lens:
                break
            lens = fitting
        if not any(lens):
            return batch
        suffix = np.full((rows, width), self.target.config.pad_token_id, np.int32)
        entry, length = np.zeros(rows, np.int32), np.zeros(rows, np.int32)
        for r, (i, p, n) in enumerate(zip(indices, prompts, lens)):
            suffix[r, : len(p) - n] = p[n:]
            if n:
                e = entry[r] = self.plan.of[i][0]
                length[r] = n
                self.cached[i] = n if e in self._paid else 0
                self._paid.add(e)
        self.reused += sum(lens)
        use = replicate((jnp.asarray(entry), jnp.asarray(length), jnp.asarray(suffix)), self.target.mesh)
        return batch.replace(prefix=PrefixUse(*use, store=self.cache))


def prefix_store(target: Model, prompts: list[list[int]], attention: str, graphs: GraphCache,
                 max_tokens: int = PREFIX_CACHE_TOKENS) -> PrefixStore | None:
    """The call's store of shared prefixes (at most max_tokens of cache), or None where no prefix
    is worth sharing."""
    plan = plan_prefixes(prompts, max_tokens=max_tokens)
    return PrefixStore(target, plan, attention, graphs) if plan.entries else None
