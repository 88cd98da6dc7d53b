"""Preallocated KV cache with per-row committed lengths.

A forward pass writes its t new keys/values at slots lengths[b] .. lengths[b] + t - 1 and leaves
`lengths` alone: the caller commits by advancing lengths by what it keeps (1 for plain decoding,
the accepted count for speculation). Entries past a row's length are never read as prefix, so
rejected tokens need no erasing: later writes overwrite them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import NamedSharding, PartitionSpec

from jaxspec.model import layout
from jaxspec.model.config import ModelConfig
from jaxspec.model.sharding import CACHE_AXES, spec


@struct.dataclass
class KVCache:
    # Laid out as the weights (model.layout.scan_layers): per layer [b, s, kv_heads, head_dim] arrays, or
    # one [layers, b, s, kv_heads, head_dim] array.
    k: tuple[jnp.ndarray, ...] | jnp.ndarray
    v: tuple[jnp.ndarray, ...] | jnp.ndarray
    lengths: jnp.ndarray  # [b] int32, committed tokens per row

    @property
    def capacity(self) -> int:
        return self.k[0].shape[1] if isinstance(self.k, tuple) else self.k.shape[2]

    @classmethod
    def create(cls, config: ModelConfig, batch: int, capacity: int, dtype, stacked: bool | None = None,
               mesh=None) -> "KVCache":
        """stacked: one array over all layers, as stacked weights want; default: as this
        backend lays out a model of `config` (model.layout.stack_layers). mesh: the tensor-parallel
        mesh of the weights (Weights.mesh), to split the cache by kv heads as they are; None keeps
        it whole."""
        shape = (batch, capacity, config.num_kv_heads, config.head_dim)
        if layout.stack_layers(config) if stacked is None else stacked:
            make = lambda: jnp.zeros((config.num_layers,) + shape, dtype)  # noqa: E731
        else:
            make = lambda: tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers))  # noqa: E731
        cache = cls(k=make(), v=make(), lengths=jnp.zeros((batch,), jnp.int32))
        if mesh is None:
            return cache
        shardings = jax.tree.map(lambda p: NamedSharding(mesh, p), cache_specs(cache))
        return jax.lax.with_sharding_constraint(cache, shardings)

    def insert(self, new: "KVCache", slots: jnp.ndarray) -> "KVCache":
        """This cache with rows `slots` [n] replaced by the n rows of `new` (same capacity); a slot
        past the last row drops its row."""
        if isinstance(self.k, tuple):
            put = lambda a, n: a.at[slots].set(n, mode="drop")  # noqa: E731
            k, v = tuple(map(put, self.k, new.k)), tuple(map(put, self.v, new.v))
        else:  # stacked: [layers, b, ...]
            put = lambda a, n: a.at[:, slots].set(n, mode="drop")  # noqa: E731
            k, v = put(self.k, new.k), put(self.v, new.v)
        return self.replace(k=k, v=v, lengths=self.lengths.at[slots].set(new.lengths, mode="drop"))

    def take(self, rows: jnp.ndarray) -> "KVCache":
        """A cache of rows `rows` [n] of this one."""
        if isinstance(self.k, tuple):
            k, v = tuple(a[rows] for a in self.k), tuple(a[rows] for a in self.v)
        else:  # stacked: [layers, b, ...]
            k, v = self.k[:, rows], self.v[:, rows]
        return self.replace(k=k, v=v, lengths=self.lengths[rows])

    def with_prefix(self, store: "KVCache", rows: jnp.ndarray, lens: jnp.ndarray) -> "KVCache":
        """This empty cache with each row b's first lens[b] slots copied from row rows[b] of
        `store` (zeros past them, as a fresh cache has), and lengths = lens."""
        n = min(store.capacity, self.capacity)
        keep = jnp.arange(n)[None, :, None, None] < lens[:, None, None, None]  # [b, n, 1, 1]
        if isinstance(self.k, tuple):
            put = lambda a, s: a.at[:, :n].set(jnp.where(keep, s[rows, :n], 0).astype(a.dtype))  # noqa: E731
            k, v = tuple(map(put, self.k, store.k)), tuple(map(put, self.v, store.v))
        else:  # stacked: [layers, b, ...]
            put = lambda a, s: a.at[:, :, :n].set(jnp.where(keep[None], s[:, rows, :n], 0).astype(a.dtype))  # noqa: E731
            k, v = put(self.k, store.k), put(self.v, store.v)
        return self.replace(k=k, v=v, lengths=lens)


def cache_specs(cache: KVCache) -> KVCache:
    """The cache split by kv heads (model.sharding.CACHE_AXES), lengths whole."""
    if isinstance(cache.k, tuple):
        per_layer = tuple(spec(CACHE_AXES) for _ in cache.k)
        return KVCache(k=per_layer, v=per_layer, lengths=PartitionSpec())
    return KVCache(k=spec(CACHE_AXES, stacked=True), v=spec(CACHE_AXES, stacked=True), lengths=PartitionSpec())
