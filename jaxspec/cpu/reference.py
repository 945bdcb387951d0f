"""numpy references for the native CPU kernels, with their signatures (tests compare against them).

The float32 reference accumulates in float64, so it stands apart from every kernel path; the
int8 reference reproduces the kernel's contract exactly: the rotation and per-token quantization
as `quant.hadamard` and `quant.quantize_tokens` compute them, an exact integer dot, one float32
epilogue. The int8 weights are in the rotated basis (x is not); the q4 reference quantizes x per
block of 32 and rounds each step where the kernel does.
"""

from __future__ import annotations

import numpy as np

INT8_MAX = 127


def f32_matmul(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """float32 W [O, I] @ x [I, N], accumulated in float64 -> float32 [O, N]."""
    return (np.asarray(w, np.float64) @ np.asarray(x, np.float64)).astype(np.float32)


def quantize_tokens(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x float32 [I, N] -> codes int8 [I, N], scales float32 [N] of the rotated x
    (`quant.hadamard` along I): scale = max|x| / 127 per token (1 for an all-zero token), code =
    clip(rint(x / scale), -127, 127)."""
    from jaxspec.models.quant import hadamard

    return _quantize_columns(hadamard(np.asarray(x, np.float32), axis=0))


def _quantize_columns(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each column of x float32 [I, N] quantized on its own: codes int8 [I, N], scales float32 [N]."""
    absmax = np.max(np.abs(x), axis=0)
    scales = np.where(absmax > 0, absmax / np.float32(INT8_MAX), np.float32(1)).astype(np.float32)
    codes = np.clip(np.rint(x / scales[None, :]), -INT8_MAX, INT8_MAX).astype(np.int8)
    return codes, scales


def int8_matmul(values: np.ndarray, scales: np.ndarray, x: np.ndarray) -> np.ndarray:
    """int8 W [O, I] (rotated) with per-row scales @ x float32 [I, N] -> float32 [O, N]: exact
    int64 dot of the codes, then (dot * scale_w) * scale_x in float32."""
    codes, token_scales = quantize_tokens(x)
    dots = np.asarray(values, np.int64) @ codes.astype(np.int64)  # [O, N], exact
    return (dots.astype(np.float32) * np.asarray(scales, np.float32)[:, None]) * token_scales[None, :]


def q4_matmul(codes: np.ndarray, scales: np.ndarray, mins: np.ndarray, in_features: int, x: np.ndarray) -> np.ndarray:
    """q4 W [O, I] (`quant.Q4Weight`'s fields: codes uint8 [O, I_pad / 2] two a byte, scales and
    mins float16 [O, NB]) @ x float32 [I, N] -> float32 [O, N]. x is quantized per token and block
    of 32 (scale s = max|x| / 127, codes c), then, block by block in order,
    acc = fma(q . c, d * s, acc) and acc = fma(m, s * sum(c), acc), each product of two floats and
    each step rounded to float32 where the kernel's are (a float64 holds every product exactly)."""
    blocks = np.asarray(scales).shape[1]
    padded = np.zeros((blocks * 32, x.shape[1]), np.float32)
    padded[:in_features] = x
    tokens = x.shape[1]
    columns = padded.reshape(blocks, 32, tokens).transpose(1, 0, 2).reshape(32, blocks * tokens)
    column_codes, column_scales = _quantize_columns(columns)  # a (block, token) a column
    x_codes = column_codes.reshape(32, blocks, tokens).transpose(1, 0, 2).astype(np.int64)  # [NB, 32, N]
    token_scales = column_scales.reshape(blocks, tokens)  # [NB, N]
    nibbles = np.stack([codes & 0x0F, codes >> 4], axis=-1).reshape(codes.shape[0], blocks, 32).astype(np.int64)
    dots = np.einsum("obi,bin->obn", nibbles, x_codes)  # [O, NB, N], exact
    offsets = (token_scales * x_codes.sum(axis=1).astype(np.float32)).astype(np.float32)  # [NB, N]
    d, m = np.asarray(scales, np.float32), np.asarray(mins, np.float32)
    acc = np.zeros((codes.shape[0], x.shape[1]), np.float32)
    for b in range(blocks):
        step = (d[:, b, None] * token_scales[b][None, :]).astype(np.float32)  # [O, N]
        acc = (dots[:, b].astype(np.float64) * step + acc).astype(np.float32)
        acc = (m[:, b, None].astype(np.float64) * offsets[b][None, :] + acc).astype(np.float32)
    return acc


def attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray, start: np.ndarray, visible: np.ndarray,
              scale: float) -> np.ndarray:
    """Softmax attention in float64 over the slots each query sees: q [B, T, K, G, H], keys and
    values [B, K, S, H], start int[B], visible bool[B, T, M]; query t of row b sees slots
    [0, start[b]) and start[b] + m where visible[b, t, m]. -> float32 [B, T, K, G, H] (zeros for a
    query that sees nothing)."""
    q, keys, values = (np.asarray(a, np.float64) for a in (q, keys, values))
    batch, steps, _, _, _ = q.shape
    capacity, window = keys.shape[2], visible.shape[2]
    out = np.zeros(q.shape, np.float64)
    for b in range(batch):
        first = min(max(int(start[b]), 0), capacity)
        for t in range(steps):
            window_slots = [first + m for m in range(window) if first + m < capacity and visible[b, t, m]]
            slots = np.array(list(range(first)) + window_slots, np.int64)
            if not slots.size:
                continue
            scores = np.einsum("kgh,ksh->kgs", q[b, t] * scale, keys[b][:, slots])  # [K, G, n]
            probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
            probs /= probs.sum(axis=-1, keepdims=True)
            out[b, t] = np.einsum("kgs,ksh->kgh", probs, values[b][:, slots])
    return out.astype(np.float32)
