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
    k: jnp.ndarray  # [layers, b, s, kv_heads, head_dim]
    v: jnp.ndarray  # [layers, b, s, kv_heads, head_dim]
    lengths: jnp.ndarray  # [b] int32, committed tokens per row

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    @classmethod
    def create(cls, config: ModelConfig, batch: int, capacity: int, dtype) -> "KVCache":
        shape = (config.num_layers, batch, capacity, config.num_kv_heads, config.head_dim)
        return cls(
            k=jnp.zeros(shape, dtype),
            v=jnp.zeros(shape, dtype),
            lengths=jnp.zeros((batch,), jnp.int32),
        )
