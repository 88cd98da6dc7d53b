"""Preallocated KV cache with per-row committed lengths.

A forward pass writes its t new keys/values at slots lengths[b] .. lengths[b] + t - 1 and leaves
`lengths` alone: the caller commits by advancing lengths by what it keeps (1 for plain decoding,
the accepted count for speculation). Entries past a row's length are never read as prefix, so
rejected tokens need no erasing: later writes overwrite them.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import struct

from jaxspec.config import ModelConfig


@struct.dataclass
class KVCache:
    k: tuple[jnp.ndarray, ...]  # per layer [b, s, kv_heads, head_dim] (separate arrays, as the weights)
    v: tuple[jnp.ndarray, ...]  # per layer [b, s, kv_heads, head_dim]
    lengths: jnp.ndarray  # [b] int32, committed tokens per row

    @property
    def capacity(self) -> int:
        return self.k[0].shape[1]

    @classmethod
    def create(cls, config: ModelConfig, batch: int, capacity: int, dtype) -> "KVCache":
        shape = (batch, capacity, config.num_kv_heads, config.head_dim)
        layers = range(config.num_layers)
        return cls(
            k=tuple(jnp.zeros(shape, dtype) for _ in layers),
            v=tuple(jnp.zeros(shape, dtype) for _ in layers),
            lengths=jnp.zeros((batch,), jnp.int32),
        )
