"""numpy references for the native CPU kernels, with their signatures (tests compare against them).

The float32 reference accumulates in float64, so it stands apart from every kernel path; the
int8 reference reproduces the kernel's contract exactly: the rotation and per-token quantization
as `quant.hadamard` and `quant.quantize_tokens` compute them, an exact integer dot, one float32
epilogue. The int8 and q4 weights are in the rotated basis; x is not.
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

    x = hadamard(np.asarray(x, np.float32), axis=0)
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
    mins float16 [O, NB]) @ x float32 [I, N] -> float32 [O, N]: per token int8 codes c and scale
    s_x, then s_x * sum_b (d_b * (q . c)_b + m_b * sum_b c), each block's dot exact, the blocks
    added in order with float32 rounding after each step (float64 holds every product exactly, so
    this rounds where the kernel's fused multiply-adds do)."""
    x_codes, token_scales = quantize_tokens(x)
    blocks = np.asarray(scales).shape[1]
    padded = np.zeros((blocks * 32, x.shape[1]), np.int64)
    padded[:in_features] = x_codes
    nibbles = np.stack([codes & 0x0F, codes >> 4], axis=-1).reshape(codes.shape[0], blocks, 32).astype(np.int64)
    x_blocks = padded.reshape(blocks, 32, -1)  # [NB, 32, N]
    dots = np.einsum("obi,bin->obn", nibbles, x_blocks)  # [O, NB, N], exact
    sums = x_blocks.sum(axis=1)  # [NB, N]
    acc = np.zeros((codes.shape[0], x.shape[1]), np.float32)
    d, m = np.asarray(scales, np.float64), np.asarray(mins, np.float64)
    for b in range(blocks):
        acc = (dots[:, b].astype(np.float64) * d[:, b, None] + acc.astype(np.float64)).astype(np.float32)
        acc = (m[:, b, None] * sums[b][None, :].astype(np.float64) + acc.astype(np.float64)).astype(np.float32)
    return acc * token_scales[None, :]
