"""KV storage formats: float32, bfloat16, and ggml's q8_0 / q5_1 blocks, really packed.

A block format cuts each head vector [H] into H/32 blocks of 32 values along H, so a token's
K (or V) is quantized on its own: writing it never touches its neighbours, and rollback by
length stays a length (docs/design.md, "One cache protocol, rollback by length").

    q8_0: per block one float16 scale d and 32 int8 codes q; x = d * q.
          34 bytes per 32 values (ggml `block_q8_0`).
    q5_1: per block float16 d and m, 32 five-bit codes q; x = d * q + m.
          The low 4 bits of codes j and j + 16 share byte j (16 bytes); the fifth bits of all
          32 codes make one uint32 (bit j is code j's). 24 bytes per 32 values (ggml
          `block_q5_1`: d, m, qh[4], qs[16]).

Quantized tensors are pytrees (`Q8_0`, `Q5_1`) of the packed codes and the per-block constants,
each leaf shaped like the logical tensor with its last axis replaced; the bytes they hold are
the format's bytes. Plain formats are plain arrays.

`quantize` is a Pallas kernel (one grid step per tile of head vectors); `quantize_reference`
is the same operation in float32 jnp with the same signature; `dequantize` is the jnp inverse.
Quantization follows ggml's reference rounding (`quantize_row_q8_0_ref`,
`quantize_row_q5_1_ref`): d is computed in float32 and stored as float16.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.experimental import pallas as pl

from jaxspec.choice import Choice
from jaxspec.errors import InvalidRequestError, UnsupportedModelError

BLOCK = 32  # values per quantization block (ggml's QK8_0 = QK5_1 = 32)


class Format(Choice):
    """How one of K or V is stored."""

    F32 = "f32"
    BF16 = "bf16"
    Q8_0 = "q8_0"
    Q5_1 = "q5_1"

    @classmethod
    def label(cls) -> str:
        return "KV format"

    @property
    def is_block(self) -> bool:
        return self in (Format.Q8_0, Format.Q5_1)

    @property
    def bytes_per_block(self) -> int:  # bytes per 32 values
        return {Format.F32: 128, Format.BF16: 64, Format.Q8_0: 34, Format.Q5_1: 24}[self]

    def check_head_dim(self, head_dim: int) -> None:
        if self.is_block and head_dim % BLOCK:
            raise UnsupportedModelError(
                f"KV format {self.value!r} quantizes blocks of {BLOCK} values along the head, so it "
                f"needs head_dim divisible by {BLOCK}; this model's head_dim is {head_dim}")


@struct.dataclass
class Q8_0:
    """ggml q8_0: x = d * q."""

    codes: jax.Array  # int8[..., H]
    scales: jax.Array  # float16[..., H/32]: d per block

    format = Format.Q8_0

    @property
    def shape(self) -> tuple[int, ...]:  # the logical shape [..., H]
        return self.codes.shape


@struct.dataclass
class Q5_1:
    """ggml q5_1: x = d * q + m with 5-bit q (low nibbles packed in pairs, fifth bits in a word)."""

    nibbles: jax.Array  # uint8[..., H/2]: per block, byte j = (q_j & 15) | (q_{j+16} & 15) << 4
    high_bits: jax.Array  # uint32[..., H/32]: per block, bit j = q_j >> 4
    scales: jax.Array  # float16[..., H/32]: d per block
    mins: jax.Array  # float16[..., H/32]: m per block

    format = Format.Q5_1

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.nibbles.shape[:-1], self.nibbles.shape[-1] * 2)


Packed = jax.Array | Q8_0 | Q5_1  # what a K or V buffer is, per format

_PLAIN_DTYPES = {Format.F32: jnp.float32, Format.BF16: jnp.bfloat16}


def format_of(x: Packed) -> Format:
    """The format a buffer is stored in (static: its pytree type and dtype)."""
    if isinstance(x, (Q8_0, Q5_1)):
        return x.format
    for fmt, dtype in _PLAIN_DTYPES.items():
        if x.dtype == dtype:
            return fmt
    raise UnsupportedModelError(f"KV buffers of dtype {x.dtype} are not a KV format; use f32 or bf16")


def zeros(shape: tuple[int, ...], fmt: Format) -> Packed:
    """An all-zero buffer of logical shape [..., H] in `fmt` (what the cache preallocates)."""
    *lead, head_dim = shape
    fmt.check_head_dim(head_dim)
    if not fmt.is_block:
        return jnp.zeros(shape, _PLAIN_DTYPES[fmt])
    blocks = (*lead, head_dim // BLOCK)
    if fmt is Format.Q8_0:
        return Q8_0(codes=jnp.zeros(shape, jnp.int8), scales=jnp.zeros(blocks, jnp.float16))
    return Q5_1(nibbles=jnp.zeros((*lead, head_dim // 2), jnp.uint8), high_bits=jnp.zeros(blocks, jnp.uint32),
                scales=jnp.zeros(blocks, jnp.float16), mins=jnp.zeros(blocks, jnp.float16))


def nbytes(x: Packed) -> int:
    return sum(leaf.nbytes for leaf in jax.tree.leaves(x))


# --- reference ---------------------------------------------------------------------------------

def _round_half_away(x: jax.Array) -> jax.Array:
    """C's roundf, which ggml uses (jnp.round rounds half to even)."""
    return jnp.where(x < 0, -jnp.floor(0.5 - x), jnp.floor(x + 0.5))


def quantize_reference(x: jax.Array, fmt: Format | str, *, block_rows: int = 0,
                       interpret: bool = False) -> Packed:
    """Quantize x [..., H] into `fmt`, in plain jnp (block_rows/interpret: kernel-only, ignored)."""
    del block_rows, interpret
    fmt = Format.parse(fmt)
    fmt.check_head_dim(x.shape[-1])
    return _quantize_reference(x, fmt)


@functools.partial(jax.jit, static_argnames="fmt")
def _quantize_reference(x: jax.Array, fmt: Format) -> Packed:
    if not fmt.is_block:
        return x.astype(_PLAIN_DTYPES[fmt])
    *lead, head_dim = x.shape
    blocks = x.astype(jnp.float32).reshape(*lead, head_dim // BLOCK, BLOCK)
    if fmt is Format.Q8_0:
        d = jnp.max(jnp.abs(blocks), axis=-1) / 127.0  # [..., H/32]
        inverse = jnp.where(d > 0, 1.0 / jnp.where(d > 0, d, 1.0), 0.0)
        codes = _round_half_away(blocks * inverse[..., None]).astype(jnp.int8)
        return Q8_0(codes=codes.reshape(x.shape), scales=d.astype(jnp.float16))
    low, high = jnp.min(blocks, axis=-1), jnp.max(blocks, axis=-1)
    d = (high - low) / 31.0
    inverse = jnp.where(d > 0, 1.0 / jnp.where(d > 0, d, 1.0), 0.0)
    codes = jnp.minimum(jnp.floor((blocks - low[..., None]) * inverse[..., None] + 0.5), 31).astype(jnp.uint32)
    first, second = codes[..., :16], codes[..., 16:]  # values j and j + 16 share byte j
    nibbles = (first & 15) | ((second & 15) << 4)
    high_bits = jnp.sum((codes >> 4) << jnp.arange(BLOCK, dtype=jnp.uint32), axis=-1, dtype=jnp.uint32)
    return Q5_1(nibbles=nibbles.astype(jnp.uint8).reshape(*lead, head_dim // 2), high_bits=high_bits,
                scales=d.astype(jnp.float16), mins=low.astype(jnp.float16))


def dequantize(x: Packed) -> jax.Array:
    """float32 [..., H] from any format (plain float32 passes through untouched)."""
    if not isinstance(x, (Q8_0, Q5_1)):
        return x if x.dtype == jnp.float32 else x.astype(jnp.float32)
    return _dequantize_blocks(x)


@jax.jit
def _dequantize_blocks(x: Q8_0 | Q5_1) -> jax.Array:
    *lead, head_dim = x.shape
    blocks = (*lead, head_dim // BLOCK)
    if isinstance(x, Q8_0):
        values = x.codes.astype(jnp.float32).reshape(*blocks, BLOCK) * x.scales.astype(jnp.float32)[..., None]
        return values.reshape(x.shape)
    nibbles = x.nibbles.reshape(*blocks, 16)
    low4 = jnp.concatenate([nibbles & 15, nibbles >> 4], axis=-1).astype(jnp.uint32)  # [..., H/32, 32]
    fifth = (x.high_bits[..., None] >> jnp.arange(BLOCK, dtype=jnp.uint32)) & 1
    codes = (low4 | (fifth << 4)).astype(jnp.float32)
    values = codes * x.scales.astype(jnp.float32)[..., None] + x.mins.astype(jnp.float32)[..., None]
    return values.reshape(x.shape)


# --- kernel ------------------------------------------------------------------------------------

def check_backend(interpret: bool, what: str, switch: str = "attention") -> None:
    """Native Pallas here means Triton on a GPU; anything else must run in the interpreter.
    `switch` names the option that picks the reference instead (for the error message)."""
    backend = jax.default_backend()
    if not interpret and backend != "gpu":
        raise InvalidRequestError(
            f"{what}: the Pallas kernel compiles for GPU (Triton) only and the JAX backend is "
            f"{backend!r}; pass interpret=True to run it in the Pallas interpreter (tests), or use "
            f"the XLA reference ({switch}='reference' or 'auto')")


def unpack_block_codes(packed: jax.Array, high_bits: jax.Array) -> jax.Array:
    """q5_1 codes as uint32 [R, H/32, 2, 16] (natural order) from nibbles [R, H/2], bits [R, H/32].

    Written with broadcasts, shifts and reshapes only (no slicing of loaded values), so it lowers
    in Triton as well as in the interpreter. Element (b, half, j) is value b*32 + half*16 + j.
    """
    rows, half_dim = packed.shape
    blocks = half_dim // 16
    nibbles = packed.astype(jnp.uint32).reshape(rows, blocks, 1, 16)
    half = jax.lax.broadcasted_iota(jnp.uint32, (1, 1, 2, 16), 2)
    within = jax.lax.broadcasted_iota(jnp.uint32, (1, 1, 2, 16), 3)
    low4 = (nibbles >> (half * 4)) & 15
    fifth = (high_bits.reshape(rows, blocks, 1, 1) >> (half * 16 + within)) & 1
    return low4 | (fifth << 4)


def quantize_kernel(
    # inputs
    x_ref,  # [R, H] float: R head vectors
    # outputs: the leaves of the format, in pytree order, each [R, X]
    *out_refs,
    fmt: Format,
):
    rows, head_dim = x_ref.shape
    num_blocks = head_dim // BLOCK
    x = x_ref[...].astype(jnp.float32).reshape(rows, num_blocks, BLOCK)
    if fmt is Format.Q8_0:
        codes_ref, scales_ref = out_refs
        d = jnp.max(jnp.abs(x), axis=-1) / 127.0  # [R, H/32]
        inverse = jnp.where(d > 0, 1.0 / jnp.where(d > 0, d, 1.0), 0.0)
        codes = _round_half_away(x * inverse[:, :, None])
        codes_ref[...] = codes.astype(jnp.int8).reshape(rows, head_dim)
        scales_ref[...] = d.astype(jnp.float16)
        return
    nibbles_ref, high_bits_ref, scales_ref, mins_ref = out_refs
    low, high = jnp.min(x, axis=-1), jnp.max(x, axis=-1)  # [R, H/32]
    d = (high - low) / 31.0
    inverse = jnp.where(d > 0, 1.0 / jnp.where(d > 0, d, 1.0), 0.0)
    codes = jnp.minimum(jnp.floor((x - low[:, :, None]) * inverse[:, :, None] + 0.5), 31).astype(jnp.uint32)
    # Pack with reductions over broadcast shifts rather than slices (Triton cannot slice values).
    paired = codes.reshape(rows, num_blocks, 2, 16)
    half = jax.lax.broadcasted_iota(jnp.uint32, (1, 1, 2, 16), 2)
    nibbles = jnp.sum((paired & 15) << (half * 4), axis=2, dtype=jnp.uint32)  # [R, H/32, 16]
    bit = jax.lax.broadcasted_iota(jnp.uint32, (1, 1, BLOCK), 2)
    high_bits = jnp.sum((codes >> 4) << bit, axis=-1, dtype=jnp.uint32)  # [R, H/32]
    nibbles_ref[...] = nibbles.reshape(rows, head_dim // 2).astype(jnp.uint8)
    high_bits_ref[...] = high_bits
    scales_ref[...] = d.astype(jnp.float16)
    mins_ref[...] = low.astype(jnp.float16)


@functools.partial(jax.jit, static_argnames=("fmt", "block_rows", "interpret"))
def _quantize_pallas(x: jax.Array, fmt: Format, block_rows: int, interpret: bool) -> Packed:
    *lead, head_dim = x.shape
    rows = int(np.prod(lead, dtype=np.int64))
    flat = x.reshape(rows, head_dim)
    block_rows = min(block_rows, pl.next_power_of_2(rows)) if not interpret else min(block_rows, rows)
    padded = pl.cdiv(rows, block_rows) * block_rows
    if padded != rows:
        flat = jnp.pad(flat, ((0, padded - rows), (0, 0)))
    template = jax.eval_shape(lambda: zeros((padded, head_dim), fmt))
    leaves, treedef = jax.tree.flatten(template)
    compiler_params = None
    if not interpret:  # Triton, not Mosaic GPU (which cannot reduce over one axis of several)
        from jax.experimental.pallas import triton as plgpu
        compiler_params = plgpu.CompilerParams(num_warps=4)
    out = pl.pallas_call(
        functools.partial(quantize_kernel, fmt=fmt),
        grid=(padded // block_rows,),
        in_specs=[pl.BlockSpec((block_rows, head_dim), lambda i: (i, 0))],
        out_specs=[pl.BlockSpec((block_rows, leaf.shape[1]), lambda i: (i, 0)) for leaf in leaves],
        out_shape=leaves,
        compiler_params=compiler_params,
        interpret=interpret,
        name=f"quantize_{fmt.value}",
    )(flat)
    out = [leaf[:rows].reshape(*lead, leaf.shape[1]) for leaf in out]
    return jax.tree.unflatten(treedef, out)


def quantize(x: jax.Array, fmt: Format | str, *, block_rows: int = 64, interpret: bool = False) -> Packed:
    """Quantize x [..., H] into `fmt` with the Pallas kernel (plain formats are a cast).

    block_rows: head vectors per grid step (a power of two on GPU).
    interpret: run in the Pallas interpreter (CPU tests); native needs a GPU.
    """
    fmt = Format.parse(fmt)
    fmt.check_head_dim(x.shape[-1])
    if not fmt.is_block:
        return x.astype(_PLAIN_DTYPES[fmt])
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise InvalidRequestError(f"quantize needs floating-point values; got {x.dtype=}")
    if block_rows < 1:
        raise InvalidRequestError(f"{block_rows=} must be >= 1")
    check_backend(interpret, f"quantize to {fmt.value}")
    return _quantize_pallas(x, fmt, block_rows, interpret)
