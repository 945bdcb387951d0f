"""The `Cache` protocol every trunk's cache honours, and the KV cache that implements it.

`Cache` is the contract of rollback by length: a cache is preallocated for `capacity` slots per
row, `length` int32[B] says how many are committed, and a forward writes its T new tokens at each
row's `length` without committing them; the caller commits with `advance(n)` or rolls back with
`set_length(l)`, and nothing is copied or erased. `max_rollback` says how far behind the furthest
committed length `set_length` may go with no forward in between (a drafter proposing k tokens a
round needs max_rollback >= k + 1: a row that has finished keeps drafting, and its draft rolls
back all k + 1 positions it wrote); asked for more, a cache raises `StateRollbackError`
(eagerly; the hybrid cache also from inside a jitted program).

`KVCache` is preallocated per-layer buffers plus per-row lengths. Rows of a batch advance
independently, so every write lands at that row's own offset and every mask comes from that
row's length. Rollback is setting `length` back: the stale entries past it are masked out and
overwritten by the next write, so it can go back to any length (max_rollback = capacity).

K and V are each stored in a `KVFormat`: float32 (the default), bfloat16, or ggml's q8_0 / q5_1
blocks (`jaxspec.pallas.kv_quant`), e.g. `KVFormat.parse(("q8_0", "q5_1"))`. A block format
quantizes each token's head vector on its own as it is written, so per-row offsets and rollback
by length work unchanged. The format is static: it is the buffers' pytree type and dtype, fixed
by `KVCache.create`.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, Self, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxspec.config import ModelConfig
from jaxspec.errors import InvalidRequestError
from jaxspec.pallas import kv_quant
from jaxspec.pallas.kv_quant import Format, Packed

# Logical axis names, stable so shardings can be declared later without touching the models
# (docs/design.md, "Sharding"): batch shards data-parallel, kv heads tensor-parallel. Every leaf of a
# quantized buffer has the same axes, its last one the packed head dim (never sharded).
KV_AXES = ("batch", "kv_heads", "kv_seq", "head_dim")


def kv_axes(buffers: tuple[Packed, ...]) -> tuple:
    """Per-layer K or V buffers (any format) with each leaf replaced by KV_AXES."""
    return jax.tree.map(lambda _: KV_AXES, buffers)


def kv_layout(cfg) -> tuple[tuple[int, int], ...]:
    """(kv heads, head dim) of each K/V buffer a trunk's cache holds, as every trunk config declares
    it: one per layer (Llama), per attention layer (Qwen3.5), or per layer that computes K/V, with
    the global layers' own heads (Gemma)."""
    return tuple(cfg.kv_layout)


class StateRollbackError(RuntimeError):
    """A cache was asked for a length it cannot serve: behind what it can roll back to, or past
    what the last forward wrote (for a recurrent state), or outside [0, capacity]. An internal
    invariant, not bad input: `prepare` sizes every cache for the rollbacks its request makes
    (a hybrid draft's ring for its k), so one reaching a user is a bug."""


@runtime_checkable
class Cache(Protocol):
    """What the loop and the proposers need of a trunk's cache: rollback by length.

    Implementations are pytrees (`flax.struct` dataclasses) whose methods return a new cache.
    """

    length: jax.Array  # int32[B]: tokens committed per row; slots >= length are free

    @property
    def capacity(self) -> int:  # S: slots per row
        ...

    @property
    def max_rollback(self) -> int:
        """How many positions behind its furthest committed length the cache can go back with
        no forward in between (KVCache: any, its capacity; the hybrid: rollback_states - 1)."""
        ...

    def advance(self, accepted: jax.Array) -> Self:
        """Commit `accepted[b]` more of the entries the last forward wrote at each row's offset."""
        ...

    def set_length(self, length: jax.Array) -> Self:
        """Commit or roll back to `length[b]` tokens per row."""
        ...


@dataclasses.dataclass(frozen=True)
class KVFormat:
    """How K and how V are stored; hashable, so it can sit in a static spec."""

    keys: Format = Format.F32
    values: Format = Format.F32

    @classmethod
    def parse(cls, spec: "KVFormat | str | tuple[str, str] | list[str] | None") -> "KVFormat":
        """None -> float32; "q8_0" -> both; ("q8_0", "q5_1") -> K in q8_0, V in q5_1."""
        if spec is None:
            return cls()
        if isinstance(spec, KVFormat):
            return spec
        if isinstance(spec, (str, Format)):
            return cls(Format.parse(spec), Format.parse(spec))
        if isinstance(spec, (tuple, list)) and len(spec) == 2:
            return cls(Format.parse(spec[0]), Format.parse(spec[1]))
        raise InvalidRequestError(
            f"kv_format must be a format name or a (keys, values) pair of them, e.g. ('q8_0', 'q5_1'); "
            f"got {spec!r}")

    def check(self, cfg: ModelConfig) -> None:
        """UnsupportedModelError when a block format does not tile one of the model's head dims."""
        for head_dim in sorted({head_dim for _, head_dim in kv_layout(cfg)}):
            self.keys.check_head_dim(head_dim)
            self.values.check_head_dim(head_dim)

    def bytes_per_token(self, cfg: ModelConfig) -> int:
        """KV bytes one token occupies across every KV buffer of the model's cache."""
        per_element = self.keys.bytes_per_block + self.values.bytes_per_block
        return sum(heads * head_dim * per_element // kv_quant.BLOCK for heads, head_dim in kv_layout(cfg))

    def __str__(self) -> str:
        return f"{self.keys.value}/{self.values.value}"


_DTYPE_FORMATS = {jnp.dtype(jnp.float32): Format.F32, jnp.dtype(jnp.bfloat16): Format.BF16}


@struct.dataclass
class KVCache:
    """A `Cache` of per-layer K/V buffers for a trunk whose every layer is attention."""

    # [B, K, S, H]: (batch, kv head) lead so attention's einsums batch over them without
    # transposing the cache, and each head's keys are contiguous along S. A quantized buffer is
    # a pytree whose leaves are [B, K, S, X] (kv_quant.Q8_0 / Q5_1), packed along H.
    keys: tuple[Packed, ...]  # L x [B, K, S, H]
    values: tuple[Packed, ...]  # L x [B, K, S, H]
    length: jax.Array  # int32[B]: tokens committed per row; positions >= length are free

    @classmethod
    def create(cls, cfg: ModelConfig, batch: int, capacity: int, dtype=jnp.float32, *,
               kv_format: "KVFormat | str | tuple[str, str] | None" = None) -> "KVCache":
        """Zeroed buffers for `capacity` slots per row. `kv_format` (default: `dtype`, float32)
        picks the storage of K and V; a block format needs a head dim divisible by 32."""
        if kv_format is None:
            try:
                kv_format = KVFormat(_DTYPE_FORMATS[jnp.dtype(dtype)], _DTYPE_FORMATS[jnp.dtype(dtype)])
            except KeyError:
                raise InvalidRequestError(f"KV cache dtype must be float32 or bfloat16; got {dtype}") from None
        kv_format = KVFormat.parse(kv_format)
        kv_format.check(cfg)
        # One buffer per entry of the config's `kv_layout` (every layer, uniform, for the Llama
        # family; Gemma's per-type shapes, none for its KV-shared layers).
        shapes = [(batch, heads, capacity, head_dim) for heads, head_dim in kv_layout(cfg)]
        return cls(
            keys=tuple(kv_quant.zeros(shape, kv_format.keys) for shape in shapes),
            values=tuple(kv_quant.zeros(shape, kv_format.values) for shape in shapes),
            length=jnp.zeros((batch,), jnp.int32),
        )

    @property
    def kv_format(self) -> KVFormat:
        return KVFormat(kv_quant.format_of(self.keys[0]), kv_quant.format_of(self.values[0]))

    def logical_axes(self) -> "KVCache":
        """This cache with every array replaced by its logical axes (what jaxspec.sharding lays out)."""
        return self.replace(keys=kv_axes(self.keys), values=kv_axes(self.values), length=("batch",))

    @property
    def batch(self) -> int:
        return self.length.shape[0]

    @property
    def capacity(self) -> int:  # S
        return self.keys[0].shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes held by the K/V buffers (the packed bytes for a block format)."""
        return sum(kv_quant.nbytes(buffer) for buffer in self.keys + self.values)

    @property
    def max_rollback(self) -> int:
        """Any committed length can be returned to: the entries are all still there."""
        return self.capacity

    def set_length(self, length: jax.Array) -> "KVCache":
        """Commit or roll back: the first `length[b]` entries of row b are the valid ones.

        A concrete length outside [0, capacity] raises StateRollbackError (under jit the loop's
        own bounds keep lengths in range, and nothing is checked).
        """
        length = jnp.asarray(length, jnp.int32)
        if not isinstance(length, jax.core.Tracer):
            outside = np.flatnonzero((np.asarray(length) < 0) | (np.asarray(length) > self.capacity))
            if outside.size:
                row = int(outside[0])
                raise StateRollbackError(
                    f"row {row}: cannot set a KV cache to length {int(np.asarray(length).reshape(-1)[row])}; "
                    f"it holds lengths 0 .. {self.capacity} (its capacity)")
        return dataclasses.replace(self, length=length)

    def advance(self, accepted: jax.Array) -> "KVCache":
        """Commit `accepted[b]` more of the entries written at each row's offset."""
        return self.set_length(self.length + accepted)

    def commit_path(self, path: jax.Array) -> "KVCache":
        """Gather a draft tree's accepted path into contiguous slots: the entry at slot
        `length + path[b, i]` moves to `length + i`, in every layer (then `advance` commits it).

        A tree verify writes its nodes at `length + v` in verify order, and the accepted path
        skips the siblings it did not take; this is the one place rollback is more than setting
        a length. path: int32[B, P] verify indices, root (0) first, increasing along the path,
        so no source is overwritten before it is read. Entries past a row's accepted length are
        moved too and stay uncommitted.
        """
        return self.move_slots(self.length[:, None] + path, self.length)

    def move_slots(self, sources: jax.Array, destination: jax.Array) -> "KVCache":
        """Copy each row's slots `sources[b]` int32[P] to `destination[b] + 0 .. P - 1` in every
        layer's K and V (every packed leaf of a block format alike); lengths are unchanged."""
        rows = jnp.arange(self.batch)[:, None]  # [B, 1]
        sources = jnp.clip(sources, 0, self.capacity - 1)

        def move(leaf: jax.Array) -> jax.Array:  # [B, K, S, X]
            return write_rows(leaf, leaf[rows, :, sources], destination)  # picked: [B, P, K, X]

        return self.replace(keys=jax.tree.map(move, self.keys), values=jax.tree.map(move, self.values))


def write_rows(buffer: jax.Array, new: jax.Array, offsets: jax.Array) -> jax.Array:
    """Write `new` [B, T, K, H] into `buffer` [B, K, S, H] at per-row `offsets` int32[B].

    Any trailing width works the same (a packed leaf: new [B, T, K, X] into [B, K, S, X]).

    A scatter with mode="drop": a write past the capacity is discarded, never clamped onto
    valid entries (dynamic_update_slice would clamp and silently overwrite the row's tail).
    """
    batch, steps = new.shape[:2]
    slots = jnp.arange(steps)  # [T]: each row writes offset + slots
    if batch * steps == 1:
        # XLA:CPU rewrites a scatter of one window into a dynamic-update-slice, and its fusion
        # then duplicates that into every reader of the buffer, each holding a copy of the whole
        # buffer, every layer, every step. A second window, past the capacity and so dropped,
        # keeps it one scatter done in place (tests/test_cache.py checks the compiled step).
        new = jnp.concatenate([new, new], axis=1)
        slots = jnp.array([0, buffer.shape[2]])  # offset + capacity >= capacity: dropped

    # Per row (vmapped: the scatter's batch dimension is explicit, so a mesh partitions it by rows
    # with no gather of the other rows' updates).
    def write_row(row: jax.Array, update: jax.Array, offset: jax.Array) -> jax.Array:  # [K, S, H] <- [T, K, H]
        return row.at[:, offset + slots].set(update.swapaxes(0, 1).astype(row.dtype), mode="drop")

    return jax.vmap(write_row)(buffer, new, offsets)


def write_kv(buffer: Packed, new: jax.Array, offsets: jax.Array, quantize=kv_quant.quantize_reference) -> Packed:
    """`write_rows` for a buffer in any format: `new` [B, T, K, H] is quantized (by `quantize`,
    the jnp reference or the Pallas kernel) and each packed leaf lands at the rows' offsets."""
    if not isinstance(buffer, (kv_quant.Q8_0, kv_quant.Q5_1)):
        return write_rows(buffer, new, offsets)
    packed = quantize(new, kv_quant.format_of(buffer))
    return jax.tree.map(lambda leaf, update: write_rows(leaf, update, offsets), buffer, packed)
