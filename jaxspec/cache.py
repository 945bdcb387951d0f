"""The KV cache: preallocated per-layer buffers plus per-row lengths (DESIGN.md contract 2).

Rows of a batch advance independently, so every write lands at that row's own offset and every
mask comes from that row's length. Rollback is setting `length` back: the stale entries past it
are masked out and overwritten by the next write, so nothing is copied or erased.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec.config import ModelConfig

# Logical axis names, stable so shardings can be declared later without touching the models
# (DESIGN.md contract 8): batch shards data-parallel, kv heads tensor-parallel.
KV_AXES = ("batch", "kv_heads", "kv_seq", "head_dim")


@struct.dataclass
class KVCache:
    # [B, K, S, H]: (batch, kv head) lead so attention's einsums batch over them without
    # transposing the cache, and each head's keys are contiguous along S.
    keys: tuple[jax.Array, ...]  # L x [B, K, S, H]
    values: tuple[jax.Array, ...]  # L x [B, K, S, H]
    length: jax.Array  # int32[B]: tokens committed per row; positions >= length are free

    @classmethod
    def create(cls, cfg: ModelConfig, batch: int, capacity: int, dtype=jnp.float32) -> "KVCache":
        shape = (batch, cfg.num_kv_heads, capacity, cfg.head_dim)
        return cls(
            keys=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)),
            values=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)),
            length=jnp.zeros((batch,), jnp.int32),
        )

    @property
    def batch(self) -> int:
        return self.length.shape[0]

    @property
    def capacity(self) -> int:  # S
        return self.keys[0].shape[2]

    def set_length(self, length: jax.Array) -> "KVCache":
        """Commit or roll back: the first `length[b]` entries of row b are the valid ones."""
        return dataclasses.replace(self, length=length.astype(jnp.int32))

    def advance(self, accepted: jax.Array) -> "KVCache":
        """Commit `accepted[b]` more of the entries written at each row's offset."""
        return self.set_length(self.length + accepted)


def write_rows(buffer: jax.Array, new: jax.Array, offsets: jax.Array) -> jax.Array:
    """Write `new` [B, T, K, H] into `buffer` [B, K, S, H] at per-row `offsets` int32[B].

    A scatter with mode="drop": a write past the capacity is discarded, never clamped onto
    valid entries (dynamic_update_slice would clamp and silently overwrite the row's tail).
    """
    batch, steps = new.shape[:2]
    rows = jnp.arange(batch)[:, None]  # [B, 1]
    cols = offsets[:, None] + jnp.arange(steps)[None, :]  # [B, T]
    return buffer.at[rows, :, cols].set(new.astype(buffer.dtype), mode="drop")
