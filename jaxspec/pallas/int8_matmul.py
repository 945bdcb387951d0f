"""W8A16 matmul: int8 weights with per-output-channel scales, times bf16 activations.

A weight is stored as `values` int8[O, I] and `scales` float32[O], symmetric per output channel:
w ~= values * scales[:, None]. Activations are feature-major, x [I, N] (N = batch * tokens), so
a projection is `w @ x` -> float32[O, N]. The contract every path holds: the int8 values become
bf16 exactly (|q| <= 127 has 7 significant bits), x is rounded to bf16, the products are summed in
float32, and the per-channel scale is applied once, to the sum.

`w8a16_matmul_kernel` is the Pallas kernel (Triton on GPU): one program per (O block, N block)
walks I in blocks, converting each int8 weight tile to bf16 in registers, so the weights are
read from memory at one byte each. `w8a16_matmul_reference` is the same product as one XLA dot
with the same signature; on GPU XLA fuses the int8 -> bf16 convert into that dot.

The switch `Implementation` picks between them: AUTO is the kernel on GPU for the shapes it is
built for (`kernel_supports`) and the reference otherwise (interpret mode is for tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxspec.choice import Choice
from jaxspec.errors import InvalidRequestError, UnsupportedModelError
from jaxspec.pallas.kv_quant import check_backend

_TRITON_MIN_BLOCK = 16  # Triton's dot needs every tile dimension >= 16
# Decode and verify multiply by a few dozen tokens at most; with N <= block_n every weight tile is
# read once. Larger N (prefill) is a compute-bound GEMM that XLA tiles itself: "auto" sends it there.
MAX_KERNEL_TOKENS = 64
# Default tiles, sized for an H200 (decode streams weights, so the aim is few, full reads):
# - block_o 64: Hopper's wgmma tile is 64 rows; the 49152-row lm_head gets 768 programs
#   (about six waves over 132 SMs); the 576- and 1536-row projections get 9 and 24.
# - block_i 128: a 64x128 int8 tile is 8 KB (one 128-byte line per row) and its 128x64 bf16
#   activation tile 16 KB; three pipeline stages hold ~72 KB of the SM's 228 KB shared memory.
#   I = 576 rounds it down to 64, the largest power of two dividing 576.
# - block_n 64: every decode/verify batch (N <= MAX_KERNEL_TOKENS) is one N block.
BLOCK_O, BLOCK_I, BLOCK_N = 64, 128, 64


class Implementation(Choice):
    AUTO = "auto"  # the kernel on GPU for supported shapes, the XLA reference otherwise
    REFERENCE = "reference"  # w8a16_matmul_reference (XLA)
    PALLAS = "pallas"  # the Pallas kernel, compiled natively (GPU)
    INTERPRET = "interpret"  # the Pallas kernel in the Pallas interpreter (tests on CPU)

    @classmethod
    def label(cls) -> str:
        return "matmul implementation"


def _check_inputs(values, scales, x) -> tuple[int, int, int]:
    """(O, I, N) of a valid int8 weight, its scales and the activations; else a named error."""
    if values.ndim != 2 or values.dtype != jnp.int8:
        raise UnsupportedModelError(
            f"W8A16 weights must be int8[O, I]; got {values.dtype}{list(values.shape)}")
    out_features, in_features = values.shape
    if scales.shape != (out_features,) or not jnp.issubdtype(scales.dtype, jnp.floating):
        raise InvalidRequestError(
            f"scales must be float[O={out_features}] (one per output channel); got {scales.dtype}{list(scales.shape)}")
    if x.ndim != 2 or x.shape[0] != in_features or not jnp.issubdtype(x.dtype, jnp.floating):
        raise InvalidRequestError(
            f"x must be float[I={in_features}, N] (feature-major activations); got {x.dtype}{list(x.shape)}")
    return out_features, in_features, x.shape[1]


# --- reference ---------------------------------------------------------------------------------

def w8a16_matmul_reference(values: jax.Array, scales: jax.Array, x: jax.Array, *, block_o: int = 0,
                           block_i: int = 0, block_n: int = 0, interpret: bool = False) -> jax.Array:
    """(values @ x) * scales[:, None] as one XLA dot: bf16 operands, float32 accumulation.

    values: int8[O, I]; scales: float[O]; x: float[I, N] (float32 or bf16; rounded to bf16).
    Returns float32 [O, N]. block_o, block_i, block_n, interpret: kernel tiling, ignored here.
    """
    del block_o, block_i, block_n, interpret
    _check_inputs(values, scales, x)
    return _reference(values, scales, x)


@jax.jit
def _reference(values, scales, x):
    products = jax.lax.dot_general(values.astype(jnp.bfloat16), x.astype(jnp.bfloat16),
                                   (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)  # [O, N]
    return products * scales.astype(jnp.float32)[:, None]


# --- kernel ------------------------------------------------------------------------------------

def w8a16_matmul_kernel(
    # inputs
    values_ref,  # int8[bO, I]: this program's rows of the weight, all of I
    scales_ref,  # float32[bO]: their scales
    x_ref,  # bf16[I, bN]: this program's columns of the activations, all of I
    # outputs
    out_ref,  # float32[bO, bN]
    *,
    block_i: int,
):
    block_o, in_features = values_ref.shape
    block_n = x_ref.shape[1]

    def accumulate(step, acc):
        window = pl.ds(pl.multiple_of(step * block_i, block_i), block_i)
        weights = values_ref[:, window].astype(jnp.bfloat16)  # [bO, bI]: exact, |q| <= 127
        activations = x_ref[window, :]  # [bI, bN]
        return acc + jax.lax.dot_general(weights, activations, (((1,), (0,)), ((), ())),
                                         preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, in_features // block_i, accumulate, jnp.zeros((block_o, block_n), jnp.float32))
    out_ref[...] = acc * scales_ref[...][:, None]  # one scale per output row, applied to the sum


def _weight_tile(size: int, limit: int) -> tuple[int, int]:
    """(block, padded size) for O or I, which the weight has: a weight is never padded (copied)
    while its dimension is a multiple of 16; the block shrinks to the largest power of two
    <= limit dividing it instead. Other sizes are padded to a multiple of the block."""
    if size % _TRITON_MIN_BLOCK == 0:
        block = limit
        while size % block:
            block //= 2
        return block, size
    block = min(limit, max(_TRITON_MIN_BLOCK, pl.next_power_of_2(size)))
    return block, pl.cdiv(size, block) * block


def _token_tile(size: int, limit: int) -> tuple[int, int]:
    """(block, padded size) for N: the activations are small, so N is padded to a power-of-two
    block (>= 16, <= limit) that holds all of it when it can, and each weight tile is read once."""
    block = min(limit, max(_TRITON_MIN_BLOCK, pl.next_power_of_2(size)))
    return block, pl.cdiv(size, block) * block


def _check_blocks(**blocks: int) -> None:
    for name, block in blocks.items():
        if block < _TRITON_MIN_BLOCK or block & (block - 1):
            raise InvalidRequestError(f"{name}={block} must be a power of two >= {_TRITON_MIN_BLOCK}")


def kernel_supports(out_features: int, in_features: int, tokens: int) -> bool:
    """Whether "auto" takes the kernel: decode/verify-sized N, and a weight it need not pad."""
    return (out_features % _TRITON_MIN_BLOCK == 0 and in_features % _TRITON_MIN_BLOCK == 0
            and tokens <= MAX_KERNEL_TOKENS)


@functools.partial(jax.jit, static_argnames=("block_o", "block_i", "block_n", "interpret"))
def _w8a16_matmul_pallas(values, scales, x, *, block_o, block_i, block_n, interpret):
    out_features, in_features, tokens = values.shape[0], values.shape[1], x.shape[1]
    block_o, padded_out = _weight_tile(out_features, block_o)
    block_i, padded_in = _weight_tile(in_features, block_i)
    block_n, padded_tokens = _token_tile(tokens, block_n)
    # Zero rows and columns add nothing to any sum; the padded outputs are sliced off.
    values = jnp.pad(values, ((0, padded_out - out_features), (0, padded_in - in_features)))
    scales = jnp.pad(scales.astype(jnp.float32), (0, padded_out - out_features))
    x = jnp.pad(x.astype(jnp.bfloat16), ((0, padded_in - in_features), (0, padded_tokens - tokens)))

    compiler_params = None
    if not interpret:
        from jax.experimental.pallas import triton as plgpu
        compiler_params = plgpu.CompilerParams(num_warps=4, num_stages=3)
    out = pl.pallas_call(
        functools.partial(w8a16_matmul_kernel, block_i=block_i),
        grid=(padded_out // block_o, padded_tokens // block_n),
        in_specs=[pl.BlockSpec((block_o, padded_in), lambda o, n: (o, 0)),
                  pl.BlockSpec((block_o,), lambda o, n: (o,)),
                  pl.BlockSpec((padded_in, block_n), lambda o, n: (0, n))],
        out_specs=pl.BlockSpec((block_o, block_n), lambda o, n: (o, n)),
        out_shape=jax.ShapeDtypeStruct((padded_out, padded_tokens), jnp.float32),
        compiler_params=compiler_params,
        interpret=interpret,
        name="w8a16_matmul",
    )(values, scales, x)
    return out[:out_features, :tokens]


def w8a16_matmul_pallas(values: jax.Array, scales: jax.Array, x: jax.Array, *, block_o: int = BLOCK_O,
                        block_i: int = BLOCK_I, block_n: int = BLOCK_N, interpret: bool = False) -> jax.Array:
    """(values @ x) * scales[:, None] as a Pallas kernel: bf16 tiles, float32 accumulation.

    values: int8[O, I]; scales: float[O]; x: float[I, N] (float32 or bf16; rounded to bf16).
    Returns float32 [O, N]. block_o, block_i, block_n: tile limits, powers of two >= 16.
    O and I: the block is the largest power of two <= its limit that divides the dimension, so a
    weight whose O and I are multiples of 16 is used in place; any other weight is zero-padded
    to a multiple of the block, a copy per call (under "auto", `w8a16_matmul` sends such a
    weight to the reference instead). N: padded up to a multiple of a power-of-two block
    (16 <= block <= block_n, holding all of N when N <= block_n) and sliced back; x is small.
    interpret: run in the Pallas interpreter (CPU tests); native needs a GPU.
    """
    _check_inputs(values, scales, x)
    _check_blocks(block_o=block_o, block_i=block_i, block_n=block_n)
    check_backend(interpret, "w8a16_matmul_pallas", switch="implementation")
    return _w8a16_matmul_pallas(values, scales, x, block_o=block_o, block_i=block_i, block_n=block_n,
                                interpret=interpret)


def resolve_implementation(implementation: Implementation | str, out_features: int, in_features: int,
                           tokens: int) -> Implementation:
    """REFERENCE, PALLAS or INTERPRET for this shape. AUTO -> PALLAS on GPU when `kernel_supports`
    the shape, else REFERENCE; an explicit PALLAS off a GPU is an error."""
    implementation = Implementation.parse(implementation)
    on_gpu = jax.default_backend() == "gpu"
    if implementation is Implementation.AUTO:
        supported = on_gpu and kernel_supports(out_features, in_features, tokens)
        return Implementation.PALLAS if supported else Implementation.REFERENCE
    if implementation is Implementation.PALLAS:
        check_backend(False, "implementation='pallas'", switch="implementation")
    return implementation


def w8a16_matmul(values: jax.Array, scales: jax.Array, x: jax.Array, *,
                 implementation: Implementation | str = Implementation.AUTO) -> jax.Array:
    """The one dispatch: `w8a16_matmul_pallas` or `w8a16_matmul_reference` per the switch.

    values: int8[O, I]; scales: float[O]; x: float[I, N]. Returns float32 [O, N]."""
    out_features, in_features, tokens = _check_inputs(values, scales, x)
    path = resolve_implementation(implementation, out_features, in_features, tokens)
    if path is Implementation.REFERENCE:
        return w8a16_matmul_reference(values, scales, x)
    return w8a16_matmul_pallas(values, scales, x, interpret=path is Implementation.INTERPRET)
