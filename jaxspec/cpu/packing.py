"""Weights laid out for the native CPU kernels, once, at load (the layout work never runs per call).

A `PackedWeight` stands for a linear weight [O, I] in groups of 16 output rows (rows past O are
zero), so that one vector load holds a slice of 16 rows and a broadcast token multiplies into 16
row accumulators at once:
- float32: data [G, I, 16], data[g, i, j] = W[16 g + j, i].
- int8 (`quant.Int8Weight`'s rotated codes and per-row scales): data [G, K, 64] with K = ceil(I / 4),
  data[g, k, 4 j + b] = W8[16 g + j, 4 k + b] (zero past I); scales [16 G]; and corrections
  [16 G] = 128 * sum_i W8[o, i], which the VNNI path subtracts (int8_matmul.cc).
- q4 (`quant.Q4Weight`'s 4-bit codes with per-block float16 scales and minimums): data uint8
  [G, NB, 256] per block of 32 inputs, 4 vectors of 64 bytes; byte 4 j + b of vector v holds row
  16 g + j's input 8 v + b in its low nibble and 8 v + 4 + b in its high one (q4_matmul.cc);
  scales and mins float16 [G, NB, 16].
Packing is exact and the `unpack_*` functions give the weight back bit for bit, so a packed model can be
converted, sharded or saved through the standard layout.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxspec.hostmem import aligned_empty

GROUP_ROWS = 16  # output rows per group (common.h kGroupRows)
WORD = 4  # int8 inputs per packed word (one VNNI multiply-add)


@struct.dataclass
class PackedWeight:
    """A linear weight [O, I] packed for the native CPU kernels (module docstring)."""

    data: jax.Array  # float32[G, I, 16], int8[G, K, 64] or uint8[G, NB, 256] (q4)
    scales: jax.Array | None = None  # float32[16 G] (int8); float16[G, NB, 16] (q4)
    corrections: jax.Array | None = None  # int32[16 G]: 128 * row sums of the codes (int8)
    mins: jax.Array | None = None  # float16[G, NB, 16] (q4)
    out_features: int = struct.field(pytree_node=False, default=0)
    in_features: int = struct.field(pytree_node=False, default=0)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def kind(self) -> str:
        """The weight format it packs: "f32", "int8" or "q4" (the data's dtype says)."""
        return {jnp.dtype(jnp.float32): "f32", jnp.dtype(jnp.int8): "int8", jnp.dtype(jnp.uint8): "q4"}[
            jnp.dtype(self.data.dtype)]


def _groups(out_features: int) -> int:
    return -(-out_features // GROUP_ROWS)


def pack_int8(values, scales) -> PackedWeight:
    """int8 codes [O, I] and float32 row scales [O] (host arrays) -> PackedWeight (numpy leaves)."""
    values = np.asarray(values, np.int8)
    out_features, in_features = values.shape
    groups, words = _groups(out_features), -(-in_features // WORD)
    padded = np.zeros((groups * GROUP_ROWS, words * WORD), np.int8)
    padded[:out_features, :in_features] = values
    data = padded.reshape(groups, GROUP_ROWS, words, WORD).transpose(0, 2, 1, 3).reshape(groups, words, -1)
    padded_scales = np.zeros((groups * GROUP_ROWS,), np.float32)
    padded_scales[:out_features] = np.asarray(scales, np.float32)
    corrections = (128 * padded.astype(np.int32).sum(axis=1)).astype(np.int32)
    return PackedWeight(data=np.ascontiguousarray(data), scales=padded_scales, corrections=corrections,
                        out_features=out_features, in_features=in_features)


def pack_f32(matrix) -> PackedWeight:
    """A float32 matrix [O, I] (host array) -> PackedWeight (numpy leaves), written straight into
    an aligned array (`hostmem.aligned_empty`): a load's largest transient is one copy of its largest
    weight, not three."""
    matrix = np.asarray(matrix, np.float32)
    out_features, in_features = matrix.shape
    groups, full = _groups(out_features), out_features // GROUP_ROWS
    data = aligned_empty((groups, in_features, GROUP_ROWS), np.float32)
    data[:full] = matrix[: full * GROUP_ROWS].reshape(full, GROUP_ROWS, in_features).transpose(0, 2, 1)
    if full < groups:  # the last group's rows past O are zero
        rest = out_features - full * GROUP_ROWS
        data[full, :, :rest] = matrix[full * GROUP_ROWS :].T
        data[full, :, rest:] = 0
    return PackedWeight(data=data, out_features=out_features, in_features=in_features)


def unpack_int8(packed: PackedWeight) -> tuple[np.ndarray, np.ndarray]:
    """`pack_int8` undone, on the host: codes int8 [O, I], scales float32 [O]."""
    data = np.asarray(jax.device_get(packed.data))
    out_features, in_features = packed.shape
    groups, words = data.shape[:2]
    rows = data.reshape(groups, words, GROUP_ROWS, WORD).transpose(0, 2, 1, 3).reshape(groups * GROUP_ROWS, -1)
    scales = np.asarray(jax.device_get(packed.scales))[:out_features]
    return np.ascontiguousarray(rows[:out_features, :in_features]), scales.copy()


def unpack_f32(packed: PackedWeight) -> np.ndarray:
    """`pack_f32` undone, on the host: float32 [O, I]."""
    data = np.asarray(jax.device_get(packed.data))
    return np.ascontiguousarray(data.transpose(0, 2, 1).reshape(-1, packed.in_features)[: packed.out_features])


Q4_BLOCK = 32  # inputs per q4 block (quant.Q4_BLOCK)


def pack_q4(codes, scales, mins, in_features: int) -> PackedWeight:
    """`quant.Q4Weight`'s fields (host arrays: codes uint8 [O, I_pad / 2] two a byte, scales and
    mins float16 [O, NB]) and its input width I -> PackedWeight (numpy leaves)."""
    codes = np.asarray(codes, np.uint8)
    out_features, blocks = np.asarray(scales).shape
    groups = _groups(out_features)
    nibbles = np.zeros((groups * GROUP_ROWS, blocks * Q4_BLOCK), np.uint8)  # one code a byte
    nibbles[:out_features, 0::2], nibbles[:out_features, 1::2] = codes & 0x0F, codes >> 4
    # [G, 16 rows, NB, 4 vectors, 2 halves (low, high nibble), 4 inputs]: input 8 v + 4 h + b
    split = nibbles.reshape(groups, GROUP_ROWS, blocks, 4, 2, WORD)
    packed = split[:, :, :, :, 0] | (split[:, :, :, :, 1] << 4)  # [G, 16, NB, 4, 4]
    data = packed.transpose(0, 2, 3, 1, 4).reshape(groups, blocks, -1)  # byte 4 j + b of vector v
    padded = [np.zeros((groups * GROUP_ROWS, blocks), np.float16) for _ in range(2)]
    padded[0][:out_features], padded[1][:out_features] = scales, mins
    per_group = [p.reshape(groups, GROUP_ROWS, blocks).transpose(0, 2, 1).copy() for p in padded]
    return PackedWeight(data=np.ascontiguousarray(data), scales=per_group[0], mins=per_group[1],
                        out_features=out_features, in_features=in_features)


def unpack_q4(packed: PackedWeight) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`pack_q4` undone, on the host: codes uint8 [O, I_pad / 2], scales and mins float16 [O, NB]."""
    data = np.asarray(jax.device_get(packed.data))
    groups, blocks = data.shape[:2]
    packed_bytes = data.reshape(groups, blocks, 4, GROUP_ROWS, WORD).transpose(0, 3, 1, 2, 4)  # [G, 16, NB, 4, 4]
    nibbles = np.stack([packed_bytes & 0x0F, packed_bytes >> 4], axis=4)  # [G, 16, NB, 4, 2, 4]
    rows = nibbles.reshape(groups * GROUP_ROWS, blocks * Q4_BLOCK)[: packed.out_features]
    codes = rows[:, 0::2] | (rows[:, 1::2] << 4)

    def per_row(field):
        return np.asarray(jax.device_get(field)).transpose(0, 2, 1).reshape(groups * GROUP_ROWS, blocks)[
            : packed.out_features].copy()

    return np.ascontiguousarray(codes), per_row(packed.scales), per_row(packed.mins)


def packed_rows(packed: PackedWeight, tokens: jax.Array) -> tuple[jax.Array, ...]:
    """Rows `tokens` int32[M] of a packed table as the standard layout's fields: (float32 [M, I],)
    for float32; (codes int8 [M, I], scales [M]) for int8; (codes uint8 [M, I_pad / 2], scales,
    mins float16 [M, NB]) for q4."""
    group, lane = tokens // GROUP_ROWS, tokens % GROUP_ROWS
    if packed.kind == "int8":
        groups, words = packed.data.shape[:2]
        codes = packed.data.reshape(groups, words, GROUP_ROWS, WORD)[group, :, lane, :]  # [M, K, 4]
        return codes.reshape(tokens.shape[0], words * WORD)[:, : packed.in_features], packed.scales[tokens]
    if packed.kind == "q4":
        groups, blocks = packed.data.shape[:2]
        data = packed.data.reshape(groups, blocks, 4, GROUP_ROWS, WORD)[group, :, :, lane, :]  # [M, NB, 4, 4]
        nibbles = jnp.stack([data & 0x0F, data >> 4], axis=3).reshape(tokens.shape[0], blocks * Q4_BLOCK)
        codes = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)
        return codes, packed.scales[group, :, lane], packed.mins[group, :, lane]
    return (packed.data[group, :, lane],)  # [M, I]
