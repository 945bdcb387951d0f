"""Weight formats: float32, bfloat16 and int8 weights, and the one matmul that serves them all.

Contract (docs/design.md, "Models are pure functions over pytrees"): a weight matrix `[out, in]` is either a float
array (float32, or bfloat16) or an `Int8Weight` (int8 values and one float32 scale per output
row). Trunks and heads never branch on the format: every projection is `matmul(w, h)` and every
embedding lookup is `embedding_rows(table, tokens)`. Which params a format converts is declared
on the params types: the fields marked `param(..., linear=True)` (projections, LM heads,
embedding tables). Norm weights, biases and recurrent-state params stay float32 in every format.

The formats:
- "f32": float32 weights, float32 products (the reference).
- "bf16": bfloat16 weights; activations cast to bfloat16 at the product, accumulated in float32.
  Half the bytes; the GPU default. On XLA CPU the product runs in YNNPACK's bf16 kernel (AMX or
  AVX512-BF16 where the CPU has them) only if its operands reach XLA in row-major layout; see
  `matmul` for how that is kept. A bf16 forward of the default model at 2..9 tokens is then
  faster than float32's and nearly flat in T (bench/RESULTS.md, "T-cost curve (bench/tcost.py)");
  a one-column bf16 product falls back to a float32 matrix-vector one, which is one reason decode
  forwards over bf16 weights are padded to TOKEN_LANES tokens (below).
- "int8": per-output-row symmetric int8 (scale = max|row| / 127), stored rotated: the input axis
  goes through an orthonormal block Walsh-Hadamard transform H (blocks of 64, or the largest
  power of two dividing the input width), so the weight holds W H and the product rotates its
  input too: (W H)(H x) = W x, since H H = I. The rotation spreads the few outlier channels of
  an activation over their block, which is what lets one int8 scale per token serve the whole
  token (QuaRot's observation). Without it per-token activations cost the default model
  perplexity; with it, none (bench/RESULTS.md, "KV formats"). On CPU the product is W8A8:
  activations are rotated, quantized per token (per column of the feature-major `[in, B*T]`
  stream: one scale per token) and multiplied in int8 x int8 -> int32, then scaled back in
  float32. Integer accumulation is exact, and every other step of the product is per element or
  per token, so a token's product does not depend on how many tokens share it. The float work
  around the products does, by an ulp, and an ulp can flip an int8 rounding: so decode forwards
  over int8 (and bf16) weights are padded to TOKEN_LANES tokens (jaxspec.spec.loop), RMSNorm sums
  features the same way at every token count (`layers.feature_sum`), and then on the default
  model a position's logits are bitwise the same in a step as inside a verify (measured at batch
  1 to 64; the attention's float work still varies with the query count at other shapes:
  docs/design.md, "Models are pure functions over pytrees"). (Per-block activation scales, the
  other cure for outliers, need a batched product per block, which is slower here.)
  On XLA CPU a one-column int8 product takes a slow matrix-vector path, so one-column products
  are padded to two. An int8 forward of the default model on XLA is faster than float32's, but
  XLA's int8 dot is far from streaming a quarter of the bytes four times as fast (bench/RESULTS.md,
  "T-cost curve (bench/tcost.py)").
  On GPU the product is W8A16 (jaxspec.pallas.int8_matmul): weights converted to bfloat16 on the
  way in.
- "q4": 4 bits a weight: blocks of Q4_BLOCK inputs along each row, each with a float16 scale d
  and minimum m, w = q d + m for codes q in [0, 15] (llama.cpp's Q4_1 values, not rotated: a
  GGUF's own Q4_1 blocks come back exactly). Inputs are zero-padded to whole blocks (exact: the
  padded inputs are zero). The activations are int8 per token and block, a scale each (llama.cpp's
  Q8_1 for its Q4_1 dot), which copes with outlier channels without a rotation. On CPU the native
  kernel (jaxspec.cpu) runs it; elsewhere the weight is dequantized inside the program (correct,
  not fast).
- "auto": f32 on CPU, bf16 on GPU and TPU (`WeightFormat.resolve`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxspec.choice import Choice
from jaxspec.cpu.packing import PackedWeight, packed_rows
from jaxspec.errors import InvalidRequestError
from jaxspec.models.params import is_shape

INT8_MAX = 127  # symmetric: codes in [-127, 127], so negation never overflows
# XLA CPU vectorizes elementwise work and reductions across the token axis (the minor one in the
# feature-major stream) 8 float32 lanes at a time, and a token past the last full vector takes a
# scalar path whose rounding can differ by an ulp (FMA contraction, transcendentals, summation
# order). Under float32 weights that is a 1e-5 wobble; under int8 activations an ulp can flip a
# rounding and the flip grows through the layers, until a step and a verify of the same position
# disagree on its logits. So decode forwards with int8 or bf16 weights carry a multiple of
# 8 tokens (`loop.padded_tokens`): every token then takes the vector path, in a step as in a
# verify. Reductions over features are the other half: see `layers.feature_sum`.
TOKEN_LANES = 8
Q4_BLOCK = 32  # inputs per q4 scale and minimum
Q4_LEVELS = 15  # the largest q4 code
ROTATION_BLOCK = 64  # the Hadamard block along an int8 weight's input axis (module docstring)


class WeightFormat(Choice):
    AUTO = "auto"
    F32 = "f32"
    BF16 = "bf16"
    INT8 = "int8"
    Q4 = "q4"

    @classmethod
    def label(cls) -> str:
        return "weight format"

    def resolve(self, platform: str | None = None) -> "WeightFormat":
        """The concrete format: AUTO is f32 on CPU and bf16 on accelerators."""
        if self is not WeightFormat.AUTO:
            return self
        platform = platform or jax.default_backend()
        return WeightFormat.F32 if platform == "cpu" else WeightFormat.BF16


@struct.dataclass
class Int8Weight:
    """A weight matrix [O, I] as int8 codes and one float32 scale per output row, in the basis
    rotated along I: row o is hadamard(values[o] * scales[o]) (`dequantize`). An embedding table
    [V, D] is one too: a row per token."""

    values: jax.Array  # int8[O, I]
    scales: jax.Array  # float32[O]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)


@struct.dataclass
class Q4Weight:
    """A weight matrix [O, I] in 4-bit blocks, in the basis rotated along I (module docstring):
    row o's inputs [32 b, 32 b + 32) are codes * scales[o, b] + mins[o, b], codes in [0, 15]."""

    codes: jax.Array  # uint8[O, I_pad / 2]: two codes a byte, input 2i in the low nibble
    scales: jax.Array  # float16[O, I_pad / 32]
    mins: jax.Array  # float16[O, I_pad / 32]
    in_features: int = struct.field(pytree_node=False, default=0)

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.codes.shape[0], self.in_features)


# A PackedWeight is any format laid out for the native CPU kernels (jaxspec.models.backends).
Weight = jax.Array | Int8Weight | Q4Weight | PackedWeight


def rotation_block(in_features: int) -> int:
    """The Hadamard block for an input width: ROTATION_BLOCK, or the largest power of two that
    divides the width when that is smaller (1: no rotation)."""
    return math.gcd(in_features, ROTATION_BLOCK)  # ROTATION_BLOCK is a power of two


def hadamard(x: Any, axis: int) -> Any:
    """The orthonormal Walsh-Hadamard transform over consecutive blocks of `rotation_block` along
    `axis` (numpy or jax; its own inverse). Butterflies, so XLA fuses it into its neighbours; each
    slice across `axis` (a token, a weight row) is transformed on its own."""
    xp = np if isinstance(x, np.ndarray) else jnp
    width = x.shape[axis]
    block = rotation_block(width)
    if block == 1:
        return x
    y = xp.moveaxis(x, axis, 0)
    rest = y.shape[1:]
    half = 1
    while half < block:  # pairs (i, i + half) within each 2*half group -> (a + b, a - b)
        pairs = y.reshape(width // (2 * half), 2, half, *rest)
        a, b = pairs[:, 0], pairs[:, 1]
        y = xp.stack([a + b, a - b], axis=1).reshape(width, *rest)
        half *= 2
    return xp.moveaxis(y * (1.0 / math.sqrt(block)), 0, axis)


def quantize_rows(w: Any) -> Int8Weight:
    """Per-output-row symmetric int8 of a float matrix [O, I] (numpy on the host, or a jax
    array), rotated along I (`hadamard`). An all-zero row gets scale 1 (its codes are 0)."""
    xp = np if isinstance(w, np.ndarray) else jnp
    w = hadamard(w.astype(xp.float32), axis=1)
    absmax = xp.max(xp.abs(w), axis=1)
    scales = xp.where(absmax > 0, absmax / INT8_MAX, 1.0).astype(xp.float32)
    values = xp.clip(xp.rint(w / scales[:, None]), -INT8_MAX, INT8_MAX).astype(xp.int8)
    return Int8Weight(values=values, scales=scales)


def quantize_q4(w: np.ndarray) -> Q4Weight:
    """4-bit blocks of a float matrix [O, I] on the host: per block of Q4_BLOCK inputs (the row
    zero-padded to whole blocks) the float16 minimum m and scale d = (max - min) / 15, and codes
    rint((w - m) / d) in [0, 15] against the stored (rounded) d, m."""
    matrix = np.asarray(w, np.float32)
    rows, in_features = matrix.shape
    blocks = -(-in_features // Q4_BLOCK)
    padded = np.zeros((rows, blocks * Q4_BLOCK), np.float32)
    padded[:, :in_features] = matrix
    grouped = padded.reshape(rows, blocks, Q4_BLOCK)
    low, high = grouped.min(axis=2), grouped.max(axis=2)
    limit = float(np.finfo(np.float16).max)
    mins = np.clip(low, -limit, limit).astype(np.float16)
    scales = np.clip((high - low) / Q4_LEVELS, 0, limit).astype(np.float16)
    step = scales.astype(np.float32)[:, :, None]
    codes = np.where(step > 0, np.rint((grouped - mins.astype(np.float32)[:, :, None]) / np.where(step > 0, step, 1)), 0)
    codes = np.clip(codes, 0, Q4_LEVELS).astype(np.uint8).reshape(rows, -1)
    return Q4Weight(codes=codes[:, 0::2] | (codes[:, 1::2] << 4), scales=scales, mins=mins, in_features=in_features)


def _q4_rows(w: Q4Weight) -> Any:
    """The float32 rows [..., I] a Q4Weight (or a gather of its rows) stands for."""
    xp = np if isinstance(w.codes, np.ndarray) else jnp
    low, high = w.codes & 0x0F, w.codes >> 4
    codes = xp.stack([low, high], axis=-1).reshape(*w.codes.shape[:-1], -1, Q4_BLOCK)  # [..., NB, 32]
    values = codes.astype(xp.float32) * w.scales.astype(xp.float32)[..., None] + w.mins.astype(xp.float32)[..., None]
    return values.reshape(*w.codes.shape[:-1], -1)[..., : w.in_features]


def take_rows(w: Weight | None, index: np.ndarray) -> Weight | None:
    """The weight's rows `index` int[O'] (a permutation or a repetition), in its own format, on the
    host: an int8 weight's scales go with its rows (each row is quantized on its own, so this is exact)."""
    if w is None:
        return None
    if isinstance(w, Int8Weight | Q4Weight):  # every field is per row
        return jax.tree.map(lambda field: np.asarray(field)[index], w)
    return np.asarray(w)[index]


def dequantize(w: Weight) -> jax.Array:
    """The float32 matrix a weight stands for."""
    if isinstance(w, Q4Weight):
        return _q4_rows(w)
    if isinstance(w, Int8Weight):
        return hadamard(w.values.astype(np.float32) * w.scales[:, None], axis=1)
    return w.astype(np.float32)


def quantize_tokens(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-token symmetric int8 of a feature-major activation [I, N]: codes int8[I, N] and one
    float32 scale per column [N]. Each column is quantized on its own, so a token's codes do not
    depend on the tokens beside it."""
    absmax = jnp.max(jnp.abs(x), axis=0)  # [N]
    scales = jnp.where(absmax > 0, absmax / INT8_MAX, 1.0)
    codes = jnp.clip(jnp.rint(x / scales[None, :]), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return codes, scales


def _w8a8(w: Int8Weight, x: jax.Array) -> jax.Array:
    """int8 x int8 -> int32 over `in`, then the float epilogue: [O, I] x [I, N] -> float32[O, N]."""
    columns = x.shape[1]
    codes, token_scales = quantize_tokens(hadamard(x.astype(jnp.float32), axis=0))
    if columns == 1:  # XLA CPU's one-column int8 product is a slow matrix-vector path (module doc)
        codes = jnp.pad(codes, ((0, 0), (0, 1)))
    exact = jax.lax.dot_general(w.values, codes, (((1,), (0,)), ((), ())),
                                preferred_element_type=jnp.int32)[:, :columns]  # [O, N]
    return exact.astype(jnp.float32) * w.scales[:, None] * token_scales[None, :]


def quantize_blocks(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """int8 of a feature-major activation [I, N] per token and block of Q4_BLOCK features (zero-
    padded to whole blocks): codes int8 [NB, 32, N] and a float32 scale per block and token [NB, N],
    each block quantized as `quantize_tokens` quantizes a token (it is one of its columns here)."""
    blocks, tokens = -(-x.shape[0] // Q4_BLOCK), x.shape[1]
    padded = jnp.pad(x, ((0, blocks * Q4_BLOCK - x.shape[0]), (0, 0))).reshape(blocks, Q4_BLOCK, tokens)
    columns = padded.transpose(1, 0, 2).reshape(Q4_BLOCK, blocks * tokens)  # [32, NB*N]: a (block, token) each
    codes, scales = quantize_tokens(columns)
    return codes.reshape(Q4_BLOCK, blocks, tokens).transpose(1, 0, 2), scales.reshape(blocks, tokens)


def _q4_product(w: Q4Weight, x: jax.Array) -> jax.Array:
    """q4 w [O, I] @ x [I, N] on XLA: the weight dequantized, the activation per token and block
    (the native kernel's arithmetic, summed in XLA's order)."""
    codes, scales = quantize_blocks(x)  # [NB, 32, N], [NB, N]
    rows = _q4_rows(w)  # [O, I]
    blocks = codes.shape[0]
    rows = jnp.pad(rows, ((0, 0), (0, blocks * Q4_BLOCK - rows.shape[1]))).reshape(rows.shape[0], blocks, Q4_BLOCK)
    per_block = jnp.einsum("obi,bin->obn", rows, codes.astype(jnp.float32))  # [O, NB, N]
    return jnp.sum(per_block * scales[None], axis=1)


def matmul(w: Weight, x: jax.Array) -> jax.Array:
    """w [O, I] @ x [I, N] -> float32 [O, N], in the weight's format (module docstring), by the
    backend its layout is for (jaxspec.models.backends)."""
    if isinstance(w, PackedWeight):
        from jaxspec.cpu import kernels

        product = {"f32": kernels.f32_matmul, "int8": kernels.int8_matmul, "q4": kernels.q4_matmul}[w.kind]
        return product(w, x.astype(jnp.float32))  # the int8 kernel rotates x itself
    if isinstance(w, Q4Weight):  # W4A8 as the native kernel computes it; dequantized in the program
        return _q4_product(w, x.astype(jnp.float32))
    if isinstance(w, Int8Weight):
        if jax.default_backend() == "cpu":
            return _w8a8(w, x)
        from jaxspec.pallas.int8_matmul import w8a16_matmul  # GPU/TPU only

        return w8a16_matmul(w.values, w.scales, hadamard(x, axis=0))
    if w.dtype == jnp.bfloat16:
        return _bf16_matmul(w, x.astype(jnp.bfloat16))
    return w @ x


def _bf16_product(w: jax.Array, x: jax.Array) -> jax.Array:
    """bfloat16 w [O, I] @ bfloat16 x [I, N], accumulated in float32 -> float32 [O, N].

    XLA CPU keeps a bf16 dot in bf16 (YNNPACK's kernel; AMX or AVX512-BF16 where the CPU has
    them) only if, when its OperandUpcaster pass runs, both operands have a row-major layout;
    any other dot is rewritten to convert both operands to float32 on every call. The
    feature-major stream is born of a transpose (the embedding rows [B*T, D] turned into
    [D, B*T]), and XLA gives a transpose, and everything elementwise after it (the norms), the
    column-major layout that makes it free: so the products after a norm (fused q/k/v, gate/up,
    the LM head) would run in float32, far slower. A reshape's result is laid out
    row-major: the activation goes through one (a unit axis, [I, 1, N]), and layout assignment
    later pays the (small) transposed copy where one is needed instead of the weight's
    conversion. Same values, same float32 accumulation. The weight, a parameter, is row-major.
    """
    out = jax.lax.dot_general(w, x[:, None, :], (((1,), (0,)), ((), ())),
                              preferred_element_type=jnp.float32)  # [O, 1, N]
    return out.reshape(w.shape[0], x.shape[1])


def _bf16_gradient_product(a: jax.Array, b: jax.Array) -> jax.Array:
    """bfloat16 a [M, K] @ bfloat16 b [K, N] -> float32 [M, N] for the backward pass, whose
    operands are transposes (of the weight, of the activation). Beyond `_bf16_product`'s unit
    axis, both operands pass an optimization barrier: without it XLA folds a transposed left
    operand back into the dot as a contraction over its major axis, a form YNNPACK does not
    take, after the point where it could still convert it to float32; and XLA CPU's own dot has
    no bf16 kernel, so the program fails when run ("Unsupported element type for DotThunk")."""
    a, b3 = jax.lax.optimization_barrier((a, b[:, None, :]))  # [M, K], [K, 1, N]
    out = jax.lax.dot_general(a, b3, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return out.reshape(a.shape[0], b.shape[1])


@jax.custom_vjp
def _bf16_matmul(w: jax.Array, x: jax.Array) -> jax.Array:
    """bfloat16 w [O, I] @ bfloat16 x [I, N] -> float32 [O, N], differentiable with bf16 products.

    Its gradient keeps both backward products in bfloat16 as well, the float32 cotangent cast at
    the product (as mixed-precision training does): left to autodiff, the float32 cotangent would
    promote dW and dx, two thirds of a training step's work, to float32 products.
    """
    return _bf16_product(w, x)


def _bf16_matmul_forward(w: jax.Array, x: jax.Array):
    return _bf16_product(w, x), (w, x)


def _bf16_matmul_backward(saved, dy: jax.Array):  # dy float32 [O, N]
    w, x = saved
    dy = dy.astype(jnp.bfloat16)
    dw = _bf16_gradient_product(dy, x.T)  # [O, I]
    dx = _bf16_gradient_product(w.T, dy)  # [I, N]
    return dw.astype(jnp.bfloat16), dx.astype(jnp.bfloat16)


_bf16_matmul.defvjp(_bf16_matmul_forward, _bf16_matmul_backward)


def embedding_rows(table: Weight, tokens: jax.Array) -> jax.Array:
    """Rows of an embedding table [V, D] for int32 ids [M] -> float32 [M, D]; a quantized table
    gathers its rows in its own format and dequantizes only those."""
    if isinstance(table, PackedWeight):
        fields = packed_rows(table, tokens)  # the rows in the standard layout's fields
        if table.kind == "f32":
            return fields[0]
        rows = Int8Weight(*fields) if table.kind == "int8" else Q4Weight(*fields, in_features=table.in_features)
        return dequantize(rows)
    if isinstance(table, Int8Weight | Q4Weight):
        return dequantize(jax.tree.map(lambda field: jnp.take(field, tokens, axis=0), table))
    return jnp.take(table, tokens, axis=0).astype(jnp.float32)


def concat_rows(*weights: Weight) -> Weight:
    """Weights [O_i, I] of one format stacked into [sum O_i, I] (numpy or jax arrays)."""
    if isinstance(weights[0], Int8Weight | Q4Weight):  # every field is per row
        return jax.tree.map(concat_rows, *weights)
    xp = np if all(isinstance(w, np.ndarray) for w in weights) else jnp
    return xp.concatenate(weights, axis=0)


def split_rows(weight: Weight, boundaries: tuple[int, ...]) -> list[Weight]:
    """`concat_rows` undone: a weight's rows split at `boundaries`."""
    if isinstance(weight, Int8Weight | Q4Weight):  # every field is per row
        fields, treedef = jax.tree.flatten(weight)
        parts = [split_rows(field, boundaries) for field in fields]
        return [jax.tree.unflatten(treedef, part) for part in zip(*parts, strict=True)]
    xp = np if isinstance(weight, np.ndarray) else jnp
    return xp.split(weight, boundaries, axis=0)


# ----------------------------------------------------------------------------------------------
# Converting params trees
# ----------------------------------------------------------------------------------------------


def weight_leaves(params: Any) -> list[Any]:
    """A params tree's leaves with each Int8Weight kept whole (one leaf per param)."""
    return jax.tree.leaves(params, is_leaf=lambda leaf: isinstance(leaf, Int8Weight | Q4Weight | PackedWeight))


def _convert_leaf(leaf: Any, fmt: WeightFormat) -> Any:
    """One linear param (an array, a numpy array, an Int8Weight or a Q4Weight) in `fmt`. The arithmetic runs
    in numpy on the host whatever the leaf is (a device leaf goes back to the device), so a
    checkpoint converted at load and a loaded Model converted later get the same codes. Weights
    packed for the native kernels are unpacked first (`backends.standard`)."""
    if isinstance(leaf, PackedWeight):
        raise InvalidRequestError("convert takes weights in the standard layout: unpack them first "
                                  "(jaxspec.models.backends.standard)")
    if leaf is None or weight_format(leaf) is fmt:
        return leaf
    on_device = not isinstance(jax.tree.leaves(leaf)[0], np.ndarray)
    host = jax.device_get(leaf)
    if fmt is WeightFormat.INT8:
        converted = _by_rows(lambda rows: quantize_rows(dequantize(rows) if isinstance(rows, Q4Weight) else rows), host)
    elif fmt is WeightFormat.Q4:
        converted = _by_rows(lambda rows: quantize_q4(dequantize(rows)), host)
    else:
        converted = dequantize(host)
        if fmt is WeightFormat.BF16:
            converted = converted.astype(jnp.bfloat16)
    return jax.device_put(converted) if on_device else converted


# Rows a host weight is quantized in at once: every quantizer works row by row, and its float32
# temporaries are several times what it quantizes (a 151,936-row embedding's were ~3 GB at once).
QUANTIZE_ROWS = 8192


def _by_rows(quantize: Any, weight: Any) -> Any:
    """`quantize(weight)` of a host weight [O, I], QUANTIZE_ROWS rows at a time (the same codes:
    each row is quantized on its own)."""
    rows = weight.shape[0]
    if rows <= QUANTIZE_ROWS:
        return quantize(weight)
    row_slice = lambda start: jax.tree.map(lambda field: field[start : start + QUANTIZE_ROWS], weight)  # noqa: E731
    return concat_rows(*(quantize(row_slice(start)) for start in range(0, rows, QUANTIZE_ROWS)))


def map_linear(tree: Any, fn: Any) -> Any:
    """`tree` (params dataclasses, tuples of them) with `fn(leaf)` applied to every field marked
    `param(..., linear=True)`; every other field kept as it is."""
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type) and not isinstance(tree, Int8Weight | Q4Weight | PackedWeight):
        updates = {}
        for field in dataclasses.fields(tree):
            value = getattr(tree, field.name)
            if field.metadata.get("linear"):
                updates[field.name] = fn(value)
            elif "axes" not in field.metadata:
                updates[field.name] = map_linear(value, fn)
        return dataclasses.replace(tree, **updates)
    if isinstance(tree, tuple | list):
        return type(tree)(map_linear(item, fn) for item in tree)
    return tree


def convert(params: Any, fmt: WeightFormat | str) -> Any:
    """`params` with every linear weight in `fmt` (f32, bf16 or int8; AUTO resolved for this
    platform). Works on host numpy trees (a loader's) and device trees alike."""
    fmt = WeightFormat.parse(fmt).resolve()
    return map_linear(params, lambda leaf: _convert_leaf(leaf, fmt))


def convert_consuming(loaded: list, fmt: WeightFormat | str) -> Any:
    """`convert(loaded.pop(), fmt)`, each weight dropped as soon as its converted twin exists
    (`map_linear_consuming`): a loader's tree then never stands beside a whole converted copy."""
    fmt = WeightFormat.parse(fmt).resolve()
    return map_linear_consuming(loaded, lambda leaf: _convert_leaf(leaf, fmt))


class LinearField:
    """A linear field's value, marked while `map_linear_consuming` walks a flattened params tree
    (a leaf to jax, whatever the value)."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value


def _unmark(leaf: Any) -> Any:
    return leaf.value if isinstance(leaf, LinearField) else leaf


def map_linear_consuming(loaded: list, fn: Any, *, whole: tuple[type, ...] = ()) -> Any:
    """`map_linear(tree, fn)` for the tree `loaded` holds, the list emptied (it must be the tree's
    only holder): each piece is dropped as soon as `fn`'s result for it exists (waited for, the
    freed memory handed back), so the work peaks near one copy of the tree and one piece, not two
    copies. A node of a type in `whole` (an attention block, whose q/k/v fuse together) goes to
    `fn` whole; every other linear weight alone."""
    from jaxspec.hostmem import release_freed_memory

    marked = map_linear(loaded.pop(), LinearField)  # the marks hold the only references now
    pieces, treedef = jax.tree.flatten(marked, is_leaf=lambda node: isinstance(node, (LinearField, *whole)))
    del marked
    for index, piece in enumerate(pieces):
        if isinstance(piece, (LinearField, *whole)):
            pieces[index] = None
            result = (LinearField(fn(piece.value)) if isinstance(piece, LinearField)
                      else fn(map_linear(piece, _unmark)))
            pieces[index], piece, result = jax.block_until_ready(result), None, None
            release_freed_memory()
    return map_linear(jax.tree.unflatten(treedef, pieces), _unmark)


def weight_format(weight: Weight) -> WeightFormat:
    """The format one weight is in."""
    if isinstance(weight, PackedWeight):
        return WeightFormat(weight.kind)
    if isinstance(weight, Int8Weight):
        return WeightFormat.INT8
    if isinstance(weight, Q4Weight):
        return WeightFormat.Q4
    return WeightFormat.BF16 if weight.dtype == jnp.bfloat16 else WeightFormat.F32


def format_of(params: Any) -> WeightFormat:
    """The format of a params tree's linear weights (f32 for a tree with none)."""
    formats = set()

    def note(leaf: Any) -> Any:
        if leaf is not None:
            formats.add(weight_format(leaf))
        return leaf

    map_linear(params, note)
    if len(formats) > 1:
        raise InvalidRequestError(f"params mix weight formats: {sorted(f.value for f in formats)}")
    return formats.pop() if formats else WeightFormat.F32


def shape_structs(shapes: Any, fmt: WeightFormat) -> Any:
    """A params tree of shape tuples -> the `jax.ShapeDtypeStruct` tree of `fmt`'s arrays (what
    a stored entry of that format holds): linear leaves as `fmt` stores them, the rest float32."""
    fmt = fmt.resolve()

    def linear(shape: tuple[int, ...] | None) -> Any:
        if shape is None:
            return None
        if fmt is WeightFormat.INT8:
            return Int8Weight(values=jax.ShapeDtypeStruct(shape, np.int8),
                              scales=jax.ShapeDtypeStruct(shape[:1], np.float32))
        if fmt is WeightFormat.Q4:
            blocks = -(-shape[1] // Q4_BLOCK)
            return Q4Weight(codes=jax.ShapeDtypeStruct((shape[0], blocks * Q4_BLOCK // 2), np.uint8),
                            scales=jax.ShapeDtypeStruct((shape[0], blocks), np.float16),
                            mins=jax.ShapeDtypeStruct((shape[0], blocks), np.float16), in_features=shape[1])
        return jax.ShapeDtypeStruct(shape, jnp.bfloat16 if fmt is WeightFormat.BF16 else np.float32)

    marked = map_linear(shapes, linear)
    return jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf, np.float32) if is_shape(leaf) else leaf, marked,
                        is_leaf=lambda leaf: is_shape(leaf) or isinstance(leaf, jax.ShapeDtypeStruct))
