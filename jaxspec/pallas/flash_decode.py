"""Attention of T new queries per row over a KV cache: decode (T = 1) and verify (T = k+1).

Every query of row b attends to that row's cache slots up to its own: query t sits at slot
`lengths[b] + t` (its K/V already written there) and sees slots s <= lengths[b] + t, which is
causal within the T new tokens. Query heads share kv heads in groups of G = N / K (GQA).

A draft tree's verify replaces the causal rule with a `TreeMask`: every slot before the mask's
`start` (the committed context) is visible, and of the M window slots from `start` on, query t
sees those its row's `visible[t]` marks (its ancestors and itself). The tree's tokens sit in
those window slots in any order the caller chose; only the mask says who sees whom.

`flash_decode` is the Pallas kernel: one program per (row, kv head, split of S) holds that kv
head's G*T queries as one tile, walks its split in blocks of `block_s` slots with an online
softmax, stops at the last slot any of its queries can see (a short row reads little of a long
cache), and dequantizes K/V blocks in registers, so a quantized cache is read at its packed
size. The splits are merged outside the kernel (flash-decoding). `flash_decode_reference` is the
same attention in float32 jnp with the same signature; it is the XLA path on CPU.

The kernel reads a tree mask as bits: outside the kernel each query's `visible[t]` is packed into
W = ceil(M / 32) int32 words (bit j of word w is window slot start + 32w + j) and tiled to the
program's query rows; inside, a block of slots picks each slot's word with a static loop over the
W words (selects, no gather) and shifts its bit out. The walk then stops at the window's end,
start + M. Without a mask the kernel is compiled without any of this (the causal rule above).

The switch `Attention` picks between them: AUTO is the reference, except on a GPU where the tuned
table (jaxspec.pallas.tuning) has a measured win for the call's shape class and K/V format: there
it is the kernel, with that row's parameters (`attend`). PALLAS runs the kernel on a GPU and
INTERPRET in the Pallas interpreter (for tests, not speed).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import struct
from jax.experimental import pallas as pl

from jaxspec.choice import Choice
from jaxspec.errors import InvalidRequestError
from jaxspec.pallas import kv_quant, tuning
from jaxspec.pallas.kv_quant import BLOCK, Format, Packed
from jaxspec.pallas.tuning import KernelParams

_MASKED = float(jnp.finfo(jnp.float32).min)
# The kernel's products in full float32 (IEEE on Triton).
_FULL = jax.lax.Precision.HIGHEST


def _reference_precision() -> jax.lax.Precision | None:
    """The reference's product precision, read when it is traced: full float32 on a GPU, where the
    default is TF32 (which parts the reference from the kernel: bench/RESULTS.md, "Pallas kernels
    on a GPU"; and a reference called outside an engine program is not under
    `compilation.full_precision_products`); the default elsewhere, since XLA:CPU's float32
    products are full precision already and an explicit HIGHEST changes its programs (the
    engine's CPU programs stay as they were: tests/test_loop.py). The check is
    `compilation.pins_full_precision`'s, which this module cannot import (jaxspec.compilation
    imports the checkpoint loaders, which import models)."""
    return _FULL if jax.default_backend() == "gpu" else None
_GPU_MIN_ROWS = 16  # Triton's dot needs at least 16 rows
_WORD_BITS = 32  # window slots per packed tree-mask word (int32)
# A program holds one (row, kv head)'s G*T queries as one tile: decode and verify sizes. A
# prefill-sized T goes to the reference (XLA), which tiles large attention itself.
MAX_KERNEL_QUERIES = 128

# The reference attends up to this many queries per kv head (a decode or verify step) in one
# product over the whole cache; above, a block of PREFILL_QUERY_BLOCK queries at a time, over the
# slots the block can reach (_prefill_attention).
DECODE_MAX_QUERIES = MAX_KERNEL_QUERIES
PREFILL_QUERY_BLOCK = 128
# How a decode or verify step's q.k is laid out: "query-major" ([Q, H] x [S, H]^T -> [B, K, Q, S]),
# whose every query gets the same bits whatever the number of queries beside it, or
# "cache-major" ([S, H] x [H, Q] -> [B, K, S, Q], held by an optimization barrier), which is not:
# XLA:CPU's product tiles Q there, so a query's scores can change by an ulp with the number of
# queries beside it (on an AMD EPYC, Zen 2: with Q mod 16), and a decode step and a verify of the
# same position then part. Kept for bench/attention.py, which times both (bench/RESULTS.md,
# "Decode attention layout").
DECODE_SCORES_LAYOUT = "query-major"
# XLA:CPU (jax 0.10.2) emits elementwise loops and reductions of fewer elements than this another
# way (exp and sums round differently): the decode reference keeps its scores at least this big
# (flash_decode_reference), measured as the size where a softmax's rows stop depending on the count.
WHOLE_LOOP_ELEMENTS = 4096
# The native kernel takes every forward of up to this many tokens a row: every decode step and
# verify (a tree's verify is at most spec.tree.MAX_TREE_NODES + 1 = 129 tokens); a longer prompt
# chunk goes to the reference, whose products are faster at prefill sizes.
NATIVE_MAX_TOKENS = 256


class Attention(Choice):
    AUTO = "auto"  # the XLA reference; on a GPU the kernel where the tuned table says it wins (attend)
    REFERENCE = "reference"  # flash_decode_reference (XLA)
    PALLAS = "pallas"  # the Pallas kernel, compiled natively (GPU)
    INTERPRET = "interpret"  # the Pallas kernel in the Pallas interpreter (tests on CPU)
    NATIVE = "native"  # the C++ kernel of jaxspec.cpu (CPU); AUTO on the native product backend


@struct.dataclass
class TreeMask:
    """Tree attention: which slots of a window each of the T new queries of a row sees.

    Slots before `start` are all visible (committed context); window slot `start + m`
    (m < M) is visible to query t iff `visible[b, t, m]`; slots from `start + M` on never are.
    A verify over [pending] + N tree nodes written at `length + i` has start = length and
    visible[t, i] = "node i is t or an ancestor of t".
    """

    start: jax.Array  # int32[B]: the window's first slot
    visible: jax.Array  # bool[B, T, M]


def mask_visible(mask: TreeMask | None, lengths: jax.Array, steps: int, slots: jax.Array, *,
                 window: int | None = None, query_positions: jax.Array | None = None) -> jax.Array:
    """bool[B, T, X]: whether query t of each row sees each of `slots` int32[X] (the causal rule
    `slot <= lengths + t` without a mask).

    window: a sliding-window layer's reach (Gemma's local layers): a context slot s is seen only
    when s > query position - window, the query at `query_positions` int32[B, T] (default its slot,
    lengths + t). A context slot's position is its index (rollback by length keeps slot = position);
    a tree's window slots are the query's ancestors, within the tree's depth of it, and the caller
    keeps the depth under the window, so the rule there is the mask's alone.
    """
    if mask is None:
        query_slot = lengths[:, None] + jnp.arange(steps)[None, :]  # [B, T]
        visible = slots[None, None, :] <= query_slot[:, :, None]
        in_tree = jnp.zeros((1, 1, slots.shape[0]), bool)
    else:
        width = mask.visible.shape[-1]
        offset = slots[None, :] - mask.start[:, None]  # [B, X]: slot's index in the window
        in_window = (offset >= 0) & (offset < width)
        picked = jnp.take_along_axis(mask.visible, jnp.clip(offset, 0, width - 1)[:, None, :].repeat(steps, 1),
                                     axis=2)  # [B, T, X]
        visible = (offset < 0)[:, None, :] | (in_window[:, None, :] & picked)
        in_tree = (offset >= 0)[:, None, :]
    if window is None:
        return visible
    if query_positions is None:
        query_positions = lengths[:, None] + jnp.arange(steps)[None, :]
    near = slots[None, None, :] > query_positions[:, :, None] - window  # [B, T, X]
    return visible & (near | in_tree)


def resolve_attention(attention: Attention | str) -> Attention:
    """AUTO -> REFERENCE on every backend; PALLAS (asked for by name) off a GPU is an error.

    Why not the kernel on a GPU: on an H200 it was exact but slower than XLA's own attention over
    full rows, in every K/V format (bench/RESULTS.md, "Pallas kernels on a GPU"): its blocking was
    never tuned on a GPU. `attend` overrides AUTO per call on a GPU where the tuned table
    (jaxspec.pallas.tuning) has measured the kernel beating XLA for the call's shape class and
    K/V format: a choice that needs the call's shapes, which only `attend` sees."""
    attention = Attention.parse(attention)
    backend = jax.default_backend()
    if attention is Attention.AUTO:
        return Attention.REFERENCE
    if attention is Attention.PALLAS and backend != "gpu":
        kv_quant.check_backend(False, "attention='pallas'")
    if attention is Attention.NATIVE:
        from jaxspec.cpu import kernels

        if backend != "cpu":
            raise InvalidRequestError(f"attention='native' runs on a CPU; this backend is {backend}")
        if not kernels.available():
            raise InvalidRequestError(f"attention='native': the native CPU kernels are unavailable here: "
                                      f"{kernels.unavailable_reason()}")
    return attention


def _logical_shape(x: Packed) -> tuple[int, ...]:
    return tuple(x.shape)


def _check_inputs(q, keys, values, lengths) -> tuple[int, int, int, int, int, int]:
    if q.ndim != 5:
        raise InvalidRequestError(f"q must be [B, T, K, G, H]; got {q.shape=}")
    batch, steps, num_kv_heads, group, head_dim = q.shape
    key_shape, value_shape = _logical_shape(keys), _logical_shape(values)
    if len(key_shape) != 4 or key_shape != value_shape:
        raise InvalidRequestError(f"keys and values must both be [B, K, S, H]; got {key_shape} and {value_shape}")
    if (key_shape[0], key_shape[1], key_shape[3]) != (batch, num_kv_heads, head_dim):
        raise InvalidRequestError(f"{q.shape=} and the cache's [B, K, S, H] = {key_shape} disagree on B, K or H")
    if lengths.shape != (batch,):
        raise InvalidRequestError(f"lengths must be int32[B={batch}]; got {lengths.shape=}")
    return batch, steps, num_kv_heads, group, key_shape[2], head_dim


def _grouped(q: jax.Array) -> jax.Array:
    """[B, T, K, G, H] -> [B, K, G*T, H]: one (row, kv head)'s queries as one tile, rows (g, t)."""
    batch, steps, num_kv_heads, group, head_dim = q.shape
    return q.transpose(0, 2, 3, 1, 4).reshape(batch, num_kv_heads, group * steps, head_dim)


def _ungrouped(out: jax.Array, steps: int) -> jax.Array:
    """[B, K, G*T, H] -> [B, T, K, G, H]."""
    batch, num_kv_heads, rows, head_dim = out.shape
    return out.reshape(batch, num_kv_heads, rows // steps, steps, head_dim).transpose(0, 3, 1, 2, 4)


# --- reference ---------------------------------------------------------------------------------

def flash_decode_reference(q: jax.Array, keys: Packed, values: Packed, lengths: jax.Array, *,
                           mask: TreeMask | None = None, window: int | None = None,
                           query_positions: jax.Array | None = None, scale: float | None = None,
                           block_s: int = 0, split_size: int = 0, num_warps: int = 0, num_stages: int = 0,
                           interpret: bool = False) -> jax.Array:
    """Masked softmax attention in float32 jnp: the whole cache, dequantized, in two einsums
    (for decode and verify sizes; a prefill a block of queries at a time, over the slots each
    block can reach: _prefill_attention).

    q: [B, T, K, G, H]; keys, values: [B, K, S, H] in any KV format; lengths: int32[B];
    mask: a `TreeMask` in place of the causal rule; window, query_positions: a sliding window
    (`mask_visible`); scale: the factor on q.k (default 1/sqrt(H); Gemma sets its own).
    Returns float32 [B, T, K, G, H].
    block_s, split_size, num_warps, num_stages, interpret: the kernel's, ignored here.
    """
    del block_s, split_size, num_warps, num_stages, interpret
    batch, steps, num_kv_heads, group, capacity, head_dim = _check_inputs(q, keys, values, lengths)
    if mask is not None:
        _check_mask(mask, batch, steps)
    keys, values = kv_quant.dequantize(keys), kv_quant.dequantize(values)  # [B, K, S, H]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    precision = _reference_precision()
    visible = mask_visible(mask, lengths, steps, jnp.arange(capacity), window=window,
                           query_positions=query_positions)  # [B, T, S]
    if group * steps > DECODE_MAX_QUERIES:
        return _prefill_attention(q, keys, values, visible, scale, precision)
    queries = _grouped(q.astype(jnp.float32)) * scale  # [B, K, Q, H], Q = G*T, rows (g, t)
    visible = jnp.tile(visible, (1, group, 1))  # [B, Q, S]
    # A step and a verify must give a query the same bits (greedy speculation is exact only so,
    # and under int8 weights an ulp here flips an activation's rounding). XLA:CPU emits an
    # elementwise loop or a reduction of fewer than WHOLE_LOOP_ELEMENTS elements another way
    # than a larger one, and its exp and sums then round differently: a step's [B, K, G, S]
    # scores parted from a verify's by an ulp wherever the step's held fewer. And it runs a
    # one-row product as a matrix-vector product, summed in its own order. So the queries are
    # padded with zero rows (all slots visible) until the scores hold at least that many
    # elements and two rows; the barrier on the output keeps XLA from moving the slice that
    # drops them up through the products. Past that, a row's bits do not depend on the count.
    rows = queries.shape[2]
    padded_rows = max(rows, 2, -(-WHOLE_LOOP_ELEMENTS // (batch * num_kv_heads * capacity)))
    if padded_rows > rows:
        queries = jnp.pad(queries, ((0, 0), (0, 0), (0, padded_rows - rows), (0, 0)))
        visible = jnp.pad(visible, ((0, 0), (0, padded_rows - rows), (0, 0)), constant_values=True)
    if DECODE_SCORES_LAYOUT == "cache-major":
        scores = jnp.swapaxes(jax.lax.optimization_barrier(
            jnp.einsum("BKSH,BKQH->BKSQ", keys, queries, precision=precision)), -1, -2)
    else:
        scores = jnp.einsum("BKQH,BKSH->BKQS", queries, keys, precision=precision)  # [B, K, Q, S]
    scores = jnp.where(visible[:, None], scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("BKQS,BKSH->BKQH", probs, values, precision=precision)  # [B, K, Q, H]
    if padded_rows > rows:
        out = jax.lax.optimization_barrier(out)[:, :, :rows]
    return _ungrouped(out, steps)


def _prefill_attention(q: jax.Array, keys: jax.Array, values: jax.Array, visible: jax.Array, scale: float,
                       precision) -> jax.Array:
    """The reference for a prefill-sized T, query-major, a block of PREFILL_QUERY_BLOCK queries at
    a time, each over the slots it can reach only.

    Query t of a row sits at slot lengths + t <= S - T + t (its T entries fit in the cache) and
    no rule (causal, tree, window) shows it a later slot, so block [t0, t1) reads slots
    [0, S - T + t1) and the rest, all masked, are never computed: a forward over a fresh cache
    of its own length (a training feature pass) does half the causal products, and each block's
    scores [B, K, G, 128, S'] stay small where a 1,024-token window's whole [B, K, G*T, S] does not
    (what that does to a whole forward's time: bench/RESULTS.md, "Prefill attention in query
    blocks"). Every query's masked slots weigh exactly 0 either way, so only the products'
    summation order can differ.
    q: [B, T, K, G, H]; keys, values: [B, K, S, H] float32; visible: bool[B, T, S].
    Returns float32 [B, T, K, G, H]."""
    steps, capacity = q.shape[1], keys.shape[2]
    queries = jnp.transpose(q.astype(jnp.float32), (0, 2, 3, 1, 4)) * scale  # [B, K, G, T, H]
    blocks = []
    for first in range(0, steps, PREFILL_QUERY_BLOCK):
        last = min(steps, first + PREFILL_QUERY_BLOCK)
        reach = capacity - steps + last  # slots this block's queries can see
        scores = jnp.einsum("BKGQH,BKSH->BKGQS", queries[:, :, :, first:last], keys[:, :, :reach],
                            precision=precision)
        scores = jnp.where(visible[:, None, None, first:last, :reach], scores, _MASKED)
        probs = jax.nn.softmax(scores, axis=-1)
        blocks.append(jnp.einsum("BKGQS,BKSH->BKGQH", probs, values[:, :, :reach], precision=precision))
    return jnp.transpose(jnp.concatenate(blocks, axis=3), (0, 3, 1, 2, 4))


# --- kernel ------------------------------------------------------------------------------------

def _load_block(refs, fmt: Format, slots) -> jax.Array:
    """float32 [block_s, H] of one format's leaf refs (each [split, X]) at `slots`."""
    if not fmt.is_block:
        return refs[0][slots, :].astype(jnp.float32)
    if fmt is Format.Q8_0:
        codes_ref, scales_ref = refs
        codes = codes_ref[slots, :].astype(jnp.float32)  # [bs, H]
        rows, head_dim = codes.shape
        scales = scales_ref[slots, :].astype(jnp.float32)  # [bs, H/32]
        blocks = codes.reshape(rows, head_dim // BLOCK, BLOCK) * scales[:, :, None]
        return blocks.reshape(rows, head_dim)
    nibbles_ref, high_bits_ref, scales_ref, mins_ref = refs
    codes = kv_quant.unpack_block_codes(nibbles_ref[slots, :], high_bits_ref[slots, :]).astype(jnp.float32)
    rows, num_blocks = codes.shape[:2]
    scales = scales_ref[slots, :].astype(jnp.float32).reshape(rows, num_blocks, 1, 1)
    mins = mins_ref[slots, :].astype(jnp.float32).reshape(rows, num_blocks, 1, 1)
    return (codes * scales + mins).reshape(rows, num_blocks * BLOCK)


def _dot(a: jax.Array, b: jax.Array, contract_b: int) -> jax.Array:
    """a [M, C] against b, contracting b's axis `contract_b`, in full float32 (IEEE on Triton)."""
    return jax.lax.dot_general(a, b, (((1,), (contract_b,)), ((), ())),
                               precision=_FULL, preferred_element_type=jnp.float32)


def flash_decode_kernel(
    # inputs
    lengths_ref,  # int32[]: this row's length; query t sits at slot length + t (the causal rule)
    q_ref,  # [R, H]: the G*T queries of one (row, kv head), rows (g, t), padded to R
    # ... with a tree mask (window=M): start_ref int32[] (the window's first slot) and
    #     words_ref int32[R, W] (bit j of word w: query row r sees window slot 32w + j)
    # ... then the key leaves and the value leaves, each [split, X] (this program's split of S)
    # outputs: o [R, H] unnormalised, m [R] running max, l [R] softmax denominator
    *refs,
    key_format: Format,
    value_format: Format,
    num_key_leaves: int,
    steps: int,
    window: int | None,
    capacity: int,
    block_s: int,
    scale: float,
):
    if window is not None:
        start_ref, words_ref, *refs = refs
    key_refs = refs[:num_key_leaves]
    value_refs = refs[num_key_leaves:-3]
    o_ref, m_ref, l_ref = refs[-3:]
    split = key_refs[0].shape[0]
    rows, head_dim = q_ref.shape
    split_start = pl.program_id(2) * split
    q = q_ref[...].astype(jnp.float32) * scale  # [R, H]

    if window is None:
        length = lengths_ref[()]
        query_slot = length + jax.lax.rem(jax.lax.broadcasted_iota(jnp.int32, (rows,), 0), steps)  # [R]
        # Nothing at or past slot length + T is visible to any query: those blocks are never read.
        end = jnp.minimum(length + steps, capacity)

        def visible_of(slot):  # [bs] -> bool[R, bs]
            return slot[None, :] <= query_slot[:, None]
    else:
        window_start = start_ref[()]
        # W columns [R], read once: a slot's word is then picked by selects, which Triton takes
        # where a gather by a traced index would not lower.
        word_columns = [words_ref[:, word] for word in range(words_ref.shape[1])]
        # Nothing at or past the window's end is visible (the rows' lengths play no part).
        end = jnp.minimum(window_start + window, capacity)

        def visible_of(slot):  # [bs] -> bool[R, bs]
            offset = slot - window_start  # [bs]: the slot's index in the window (< 0: context)
            word_of_slot = offset // _WORD_BITS
            words = jnp.zeros((rows, slot.shape[0]), jnp.int32)  # [R, bs]
            for word, column in enumerate(word_columns):
                words = jnp.where(word_of_slot[None, :] == word, column[:, None], words)
            bit = jax.lax.shift_right_logical(words, (offset % _WORD_BITS)[None, :]) & 1  # [R, bs]
            in_window = (offset >= 0) & (offset < window)
            return (offset < 0)[None, :] | (in_window[None, :] & (bit == 1))

    num_blocks = jnp.clip(pl.cdiv(end - split_start, block_s), 0, split // block_s)

    def body(index, carry):
        o, m, l = carry
        start = index * block_s
        slots = pl.ds(pl.multiple_of(start, block_s), block_s)
        keys = _load_block(key_refs, key_format, slots)  # [bs, H]
        scores = _dot(q, keys, 1)  # [R, bs]
        visible = visible_of(split_start + start + jax.lax.broadcasted_iota(jnp.int32, (block_s,), 0))
        scores = jnp.where(visible, scores, _MASKED)
        m_next = jnp.maximum(m, jnp.max(scores, axis=1))
        correction = jnp.exp(m - m_next)
        p = jnp.where(visible, jnp.exp(scores - m_next[:, None]), 0.0)  # [R, bs]
        values = _load_block(value_refs, value_format, slots)  # [bs, H]
        o = correction[:, None] * o + _dot(p, values, 0)
        return o, m_next, correction * l + jnp.sum(p, axis=1)

    init = (jnp.zeros((rows, head_dim), jnp.float32), jnp.full((rows,), _MASKED, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    o, m, l = jax.lax.fori_loop(0, num_blocks, body, init)
    o_ref[...] = o
    m_ref[...] = m
    l_ref[...] = l


def _largest_dividing(size: int, limit: int) -> int:
    """The largest power of two <= limit that divides size (size itself when size <= limit)."""
    if size <= limit:
        return size
    block = 1 << (limit.bit_length() - 1)
    while size % block:
        block //= 2
    return block


def kernel_supports(head_dim: int, capacity: int) -> bool:
    """Whether the native (Triton) kernel takes this shape: power-of-two tiles of >= 16."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0 and capacity % 16 == 0


def _check_mask(mask: TreeMask, batch: int, steps: int) -> None:
    if mask.start.shape != (batch,) or not jnp.issubdtype(mask.start.dtype, jnp.integer):
        raise InvalidRequestError(f"the tree mask's start must be int32[B={batch}]; got "
                                  f"{mask.start.dtype}{list(mask.start.shape)}")
    visible = mask.visible
    if visible.ndim != 3 or visible.shape[:2] != (batch, steps) or not visible.shape[2] or visible.dtype != jnp.bool_:
        raise InvalidRequestError(f"the tree mask's visible must be bool[B={batch}, T={steps}, M >= 1]; got "
                                  f"{visible.dtype}{list(visible.shape)}")


def _window_words(visible: jax.Array, rows: int) -> jax.Array:
    """bool[B, T, M] -> int32[B, R, W]: each kernel query row's window slots as bit words.

    Bit j of word w is window slot 32w + j. Row r of a tile is query t = r % T (rows are (g, t);
    padded rows repeat the pattern, as their causal query slots do)."""
    batch, steps, window = visible.shape
    num_words = pl.cdiv(window, _WORD_BITS)
    bits = jnp.pad(visible, ((0, 0), (0, 0), (0, num_words * _WORD_BITS - window)))
    bits = bits.reshape(batch, steps, num_words, _WORD_BITS).astype(jnp.uint32)
    # Distinct bits never carry, so the sum is their OR.
    words = jnp.sum(bits << jnp.arange(_WORD_BITS, dtype=jnp.uint32), axis=-1, dtype=jnp.uint32)  # [B, T, W]
    words = jax.lax.bitcast_convert_type(words, jnp.int32)
    return jnp.take(words, jnp.arange(rows) % steps, axis=1)  # [B, R, W]


@functools.partial(jax.jit, static_argnames=("block_s", "split_size", "num_warps", "num_stages", "interpret"))
def _flash_decode_pallas(q, keys, values, lengths, mask=None, *, scale=None, block_s, split_size,
                         num_warps=KernelParams.num_warps, num_stages=KernelParams.num_stages, interpret):
    batch, steps, num_kv_heads, group, capacity, head_dim = _check_inputs(q, keys, values, lengths)
    if mask is not None:
        _check_mask(mask, batch, steps)
    split = _largest_dividing(capacity, split_size)
    block_s = _largest_dividing(split, block_s)
    num_splits = capacity // split
    if not interpret and (block_s < 16 or not kernel_supports(head_dim, capacity)):
        raise InvalidRequestError(
            f"the GPU kernel needs power-of-two tiles of at least 16: head_dim={head_dim}, "
            f"capacity={capacity} (multiple of 16), block_s={block_s}")
    if not interpret and group * steps > MAX_KERNEL_QUERIES:
        raise InvalidRequestError(
            f"the GPU kernel is for decode and verify: G*T = {group}*{steps} queries per kv head must be "
            f"<= {MAX_KERNEL_QUERIES}; use flash_decode_reference for prefill")

    queries = _grouped(q)  # [B, K, G*T, H]
    rows = queries.shape[2]
    padded_rows = rows if interpret else max(_GPU_MIN_ROWS, pl.next_power_of_2(rows))
    if padded_rows != rows:
        queries = jnp.pad(queries, ((0, 0), (0, 0), (0, padded_rows - rows), (0, 0)))

    row_spec = pl.BlockSpec((None,), lambda b, k, j: (b,))
    mask_inputs, mask_specs = [], []
    if mask is not None:
        words = _window_words(mask.visible, padded_rows)  # [B, R, W]
        mask_inputs = [mask.start.astype(jnp.int32), words]
        mask_specs = [row_spec, pl.BlockSpec((None, padded_rows, words.shape[2]), lambda b, k, j: (b, 0, 0))]
    key_leaves, value_leaves = jax.tree.leaves(keys), jax.tree.leaves(values)
    kv_specs = [pl.BlockSpec((None, None, split, leaf.shape[3]), lambda b, k, j: (b, k, j, 0))
                for leaf in key_leaves + value_leaves]
    kernel = functools.partial(
        flash_decode_kernel, key_format=kv_quant.format_of(keys), value_format=kv_quant.format_of(values),
        num_key_leaves=len(key_leaves), steps=steps, window=None if mask is None else mask.visible.shape[2],
        capacity=capacity, block_s=block_s, scale=1.0 / math.sqrt(head_dim) if scale is None else scale)
    compiler_params = None
    if not interpret:
        from jax.experimental.pallas import triton as plgpu
        compiler_params = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    o, m, l = pl.pallas_call(
        kernel,
        grid=(batch, num_kv_heads, num_splits),
        in_specs=[row_spec, pl.BlockSpec((None, None, padded_rows, head_dim), lambda b, k, j: (b, k, 0, 0)),
                  *mask_specs, *kv_specs],
        out_specs=[pl.BlockSpec((None, None, None, padded_rows, head_dim), lambda b, k, j: (b, k, j, 0, 0)),
                   pl.BlockSpec((None, None, None, padded_rows), lambda b, k, j: (b, k, j, 0)),
                   pl.BlockSpec((None, None, None, padded_rows), lambda b, k, j: (b, k, j, 0))],
        out_shape=[jax.ShapeDtypeStruct((batch, num_kv_heads, num_splits, padded_rows, head_dim), jnp.float32),
                   jax.ShapeDtypeStruct((batch, num_kv_heads, num_splits, padded_rows), jnp.float32),
                   jax.ShapeDtypeStruct((batch, num_kv_heads, num_splits, padded_rows), jnp.float32)],
        compiler_params=compiler_params,
        interpret=interpret,
        name="flash_decode",
    )(lengths.astype(jnp.int32), queries, *mask_inputs, *key_leaves, *value_leaves)

    # Merge the splits: rescale each to the overall max (a split no query could see has l = 0).
    m_all = jnp.max(m, axis=2, keepdims=True)  # [B, K, 1, R]
    weight = jnp.exp(m - m_all)
    denominator = jnp.sum(l * weight, axis=2)  # [B, K, R]
    out = jnp.sum(o * weight[..., None], axis=2) / denominator[..., None]  # [B, K, R, H]
    return _ungrouped(out[:, :, :rows], steps)


def flash_decode(q: jax.Array, keys: Packed, values: Packed, lengths: jax.Array, *, mask: TreeMask | None = None,
                 scale: float | None = None, block_s: int = KernelParams.block_s,
                 split_size: int = KernelParams.split_size, num_warps: int = KernelParams.num_warps,
                 num_stages: int = KernelParams.num_stages, interpret: bool = False) -> jax.Array:
    """Attention of T queries per row over the cache, as a Pallas kernel.

    q: [B, T, K, G, H] (query head k*G + g; RoPE applied, unscaled); keys, values: [B, K, S, H]
    in any KV format (plain arrays or `Q8_0` / `Q5_1`), the T new entries already written at
    `lengths[b] + t`; lengths: int32[B]; mask: a `TreeMask` in place of the causal rule (then
    `lengths` plays no part; every query must see some slot, as a tree node sees itself, or its
    output is NaN); scale: the factor on q.k (default 1/sqrt(H)). Returns float32 [B, T, K, G, H].
    block_s: slots per inner step; split_size: slots per program (S is split across programs);
    both are rounded down to powers of two dividing S. num_warps, num_stages: Triton's compile
    options (ignored when interpreted). interpret: run in the Pallas interpreter.
    The defaults are `KernelParams()`'s; the tuned table's rows give a GPU kind's own.
    """
    if min(block_s, split_size, num_warps, num_stages) < 1:
        raise InvalidRequestError(f"{block_s=}, {split_size=}, {num_warps=} and {num_stages=} must be >= 1")
    kv_quant.check_backend(interpret, "flash_decode")
    return _flash_decode_pallas(q, keys, values, lengths, mask, scale=scale, block_s=block_s,
                                split_size=split_size, num_warps=num_warps, num_stages=num_stages,
                                interpret=interpret)


def attend(q: jax.Array, keys: Packed, values: Packed, lengths: jax.Array, *, mask: TreeMask | None = None,
           window: int | None = None, query_positions: jax.Array | None = None, scale: float | None = None,
           attention: Attention | str = Attention.AUTO) -> jax.Array:
    """The one dispatch: `flash_decode`, the native CPU kernel or `flash_decode_reference` per the
    switch.

    Any path takes the reference for prefill-sized T (G*T > MAX_KERNEL_QUERIES for the Pallas
    kernel, T > NATIVE_MAX_TOKENS for the native one), and for a sliding window (`mask_visible`),
    which the kernels do not take yet (Gemma's local layers run on the reference; its global
    layers, with their own `scale`, on a kernel when asked for). The native kernel reads float32
    buffers: a block-quantized cache takes the reference too. AUTO on a GPU is the kernel where
    the tuned table has a win for this GPU kind, shape class and K/V format (`_tuned_params`)."""
    path = resolve_attention(attention)
    params = KernelParams()
    if Attention.parse(attention) is Attention.AUTO and window is None:
        tuned = _tuned_params(q, keys, values)
        if tuned is not None:
            path, params = Attention.PALLAS, tuned
    if path is Attention.NATIVE:
        if window is None and q.shape[1] <= NATIVE_MAX_TOKENS and not isinstance(keys, kv_quant.Q8_0 | kv_quant.Q5_1) \
                and not isinstance(values, kv_quant.Q8_0 | kv_quant.Q5_1):
            return _native_attention(q, keys, values, lengths, mask, scale)
        path = Attention.REFERENCE
    if q.shape[1] * q.shape[3] > MAX_KERNEL_QUERIES:
        path = Attention.REFERENCE
    if window is not None:
        return flash_decode_reference(q, keys, values, lengths, mask=mask, window=window,
                                      query_positions=query_positions, scale=scale)
    if path is Attention.PALLAS:
        return flash_decode(q, keys, values, lengths, mask=mask, scale=scale, **dataclasses.asdict(params))
    if path is Attention.INTERPRET:
        return flash_decode(q, keys, values, lengths, mask=mask, scale=scale, block_s=16, split_size=64,
                            interpret=True)
    return flash_decode_reference(q, keys, values, lengths, mask=mask, scale=scale)


def _tuned_params(q: jax.Array, keys: Packed, values: Packed) -> KernelParams | None:
    """On a GPU, the tuned table's parameters for this call where the kernel takes its shape and
    has measured a win over XLA (jaxspec.pallas.tuning); else None."""
    _, steps, _, group, head_dim = q.shape
    capacity = _logical_shape(keys)[2]
    if jax.default_backend() != "gpu" or group * steps > MAX_KERNEL_QUERIES or not kernel_supports(head_dim, capacity):
        return None
    return tuning.auto_params(steps, kv_quant.format_of(keys), kv_quant.format_of(values))


def _native_attention(q: jax.Array, keys: jax.Array, values: jax.Array, lengths: jax.Array, mask: TreeMask | None,
                      scale: float | None) -> jax.Array:
    """The native kernel (jaxspec.cpu.kernels.attention) under `mask_visible`'s rule: a tree's
    mask as it is; the causal rule as a window at the row's length where token t sees m <= t."""
    from jaxspec.cpu import kernels

    batch, steps, _, _, head_dim = q.shape
    if mask is None:
        causal = jnp.arange(steps)[None, :] <= jnp.arange(steps)[:, None]  # [T, T]: m <= t
        mask = TreeMask(start=lengths, visible=jnp.broadcast_to(causal, (batch, steps, steps)))
    else:
        _check_mask(mask, batch, steps)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    return kernels.attention(q.astype(jnp.float32), keys.astype(jnp.float32), values.astype(jnp.float32), mask.start,
                             mask.visible, scale=scale)


def quantize_for(attention: Attention | str):
    """The quantize-on-write op on the same path as `attend` (the kernel when "pallas" or
    "interpret" is asked for, jnp otherwise)."""
    path = resolve_attention(attention)
    if path is Attention.PALLAS:
        return kv_quant.quantize
    if path is Attention.INTERPRET:
        return functools.partial(kv_quant.quantize, interpret=True)
    return kv_quant.quantize_reference
