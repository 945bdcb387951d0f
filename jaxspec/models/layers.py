"""The building blocks every trunk and draft head is made of, as pure functions.

Contract: one implementation each of RMSNorm, RoPE (every scaling `jaxspec.config.RopeScaling`
names), self-attention over the KV cache (optional q/k/v bias, QK-norm and sigmoid output gate),
the SwiGLU MLP and the logits head. The Llama-family trunk, the Qwen3.5 hybrid's attention layers,
EAGLE-3 and MTP heads all call these, so a fix or a new scaling lands everywhere at once.

Layout (see llama.py for why): weights are `[out, in]` as HF and GGUF store them; activations are
feature-major, `[D, B*T]` through the projections and `[heads, H, B, T]` per head, so every
projection is `W @ h`. Dimension letters are `jaxspec.config.ModelConfig`'s; R is the rotated
width (rotary_dim).

The configs these take are duck-typed: anything with the attributes a function reads (ModelConfig,
Qwen35Config, an EAGLE-3 head's attention config) works, and being frozen they stay static under jit.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxspec.cache import write_kv
from jaxspec.config import RopeScaling, RopeType
from jaxspec.cpu.packing import PackedWeight
from jaxspec.errors import UnsupportedModelError
from jaxspec.pallas.flash_decode import Attention, TreeMask, attend, quantize_for
from jaxspec.models.draft_chain import DraftChain, chain_attention
from jaxspec.models.params import param
from jaxspec.models.quant import Weight, concat_rows, matmul, split_rows
from jaxspec.pallas.kv_quant import Packed



@struct.dataclass
class AttentionParams:
    """Self-attention weights, `[out, in]` as HF stores them (`self_attention`).

    Optional fields are None where the config has none: biases (`attention_bias`, Qwen2) and
    the per-head QK-norm (`qk_norm`, Qwen3 and Qwen3.5). After `fuse_projections` q/k/v live in
    `qkv_proj` (one product instead of three) and q_proj, k_proj, v_proj are None.
    """

    q_proj: Weight | None = param(axes=("heads", "embed"), linear=True)  # [N*H, D_in] ([N*2H, D] with an output gate)
    k_proj: Weight | None = param(axes=("kv_heads", "embed"), linear=True)  # [K*H, D_in]
    v_proj: Weight | None = param(axes=("kv_heads", "embed"), linear=True)  # [K*H, D_in]
    o_proj: Weight = param(axes=("embed", "heads"), linear=True)  # [D, N*H]
    q_bias: jax.Array | None = param(axes=("heads",))  # [N*H]
    k_bias: jax.Array | None = param(axes=("kv_heads",))  # [K*H]
    v_bias: jax.Array | None = param(axes=("kv_heads",))  # [K*H]
    q_norm: jax.Array | None = param(axes=(None,))  # [H]: every head shares it
    k_norm: jax.Array | None = param(axes=(None,))  # [H]
    # [N*H + 2*K*H, D_in]: q_proj, k_proj, v_proj rows stacked (None until fused)
    qkv_proj: Weight | None = param(axes=("qkv", "embed"), linear=True, default=None)
    qkv_rows: tuple[int, int, int] | None = struct.field(pytree_node=False, default=None)  # q, k, v row counts


@struct.dataclass
class MlpParams:
    """The SwiGLU MLP's weights (`swiglu`); after `fuse_projections` gate and up live in
    `gate_up_proj` and gate_proj, up_proj are None."""

    gate_proj: Weight | None = param(axes=("ffn", "embed"), linear=True)  # [F, D]
    up_proj: Weight | None = param(axes=("ffn", "embed"), linear=True)  # [F, D]
    down_proj: Weight = param(axes=("embed", "ffn"), linear=True)  # [D, F]
    gate_up_proj: Weight | None = param(axes=("gate_up", "embed"), linear=True, default=None)  # [2F, D]: gate rows, then up


@struct.dataclass
class LlamaLayer:
    """One pre-norm Llama-family decoder layer (`decoder_layer`); also an MTP head's block."""

    attn_norm: jax.Array = param(axes=("embed",))  # [D]
    attention: AttentionParams
    mlp_norm: jax.Array = param(axes=("embed",))  # [D]
    mlp: MlpParams


class RopeConfig(Protocol):
    rope_theta: float
    rotary_dim: int  # R: leading dims of each head that RoPE rotates
    rope_scaling: RopeScaling | None


class AttentionConfig(RopeConfig, Protocol):
    num_heads: int  # N
    num_kv_heads: int  # K
    head_dim: int  # H
    norm_eps: float

    @property
    def group_size(self) -> int: ...  # G = N / K


# ----------------------------------------------------------------------------------------------
# Normalisation
# ----------------------------------------------------------------------------------------------


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, axis: int = 0) -> jax.Array:
    """RMSNorm over `axis` (the feature axis: 0 for [D, B*T], 1 for [heads, H, B, T], -1 for
    [..., Y]): x / sqrt(mean(x^2) + eps) * weight."""
    shape = [1] * x.ndim
    shape[axis] = -1
    variance = feature_sum(jnp.square(x), axis) / x.shape[axis]
    return x * jax.lax.rsqrt(variance + eps) * weight.reshape(shape)


def feature_sum(x: jax.Array, axis: int = 0) -> jax.Array:
    """x summed over `axis` (kept, size 1) by halving: zero-padded to a power of two, then the two
    halves added until one slice is left, every step elementwise across the other axes.

    Why not jnp.sum: XLA:CPU emits a reduction differently with the size of the other axes (the
    tokens of a [D, B*T] stream: once a forward carries 64 tokens or more in a fused trunk, 256
    alone), so a token's sum changed by an ulp with how many tokens shared the forward, and int8
    activation roundings grew that into other tokens (a step and a verify at batch >= 8 parted).
    Elementwise adds give each token the same sum at every width. Zeros add exactly."""
    x = jnp.moveaxis(x, axis, 0)
    width = 1 << max(x.shape[0] - 1, 0).bit_length()
    x = jnp.pad(x, [(0, width - x.shape[0])] + [(0, 0)] * (x.ndim - 1))
    while x.shape[0] > 1:
        half = x.shape[0] // 2
        x = x[:half] + x[half:]
    return jnp.moveaxis(x, 0, axis)


# ----------------------------------------------------------------------------------------------
# RoPE
# ----------------------------------------------------------------------------------------------


def _yarn_inv_freq(base_inv_freq: np.ndarray, rotary_dim: int, theta: float, scaling: RopeScaling) -> np.ndarray:
    """YaRN's NTK-by-parts: dims that turn more than beta_fast times over the original context
    keep their frequency (extrapolate), fewer than beta_slow are divided by `factor`
    (interpolate), with a linear ramp over the dims between."""
    def correction_dim(rotations: float) -> float:
        # the dim whose wavelength fits `rotations` times in the original context
        return rotary_dim * math.log(scaling.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(rotary_dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    extrapolated = 1.0 - ramp  # 1: keep the frequency, 0: interpolate it
    return base_inv_freq / scaling.factor * (1.0 - extrapolated) + base_inv_freq * extrapolated


def _llama3_inv_freq(base_inv_freq: np.ndarray, scaling: RopeScaling) -> np.ndarray:
    """Llama 3.1: wavelengths past the original context / low_freq_factor are divided by
    `factor`, those under it / high_freq_factor kept, a smooth ramp between."""
    original = scaling.original_max_position_embeddings
    low_wavelen = original / scaling.low_freq_factor
    high_wavelen = original / scaling.high_freq_factor
    wavelen = 2 * math.pi / base_inv_freq
    inv_freq = np.where(wavelen > low_wavelen, base_inv_freq / scaling.factor, base_inv_freq)
    smooth = (original / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    ramped = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    is_medium = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return np.where(is_medium, ramped, inv_freq)


def rope_inv_freq(rotary_dim: int, theta: float, scaling: RopeScaling | None = None) -> np.ndarray:
    """Inverse frequencies float32[R/2] for the rotated width R, scaled as `scaling` says.

    Computed in float64 on the host (they are constants of the config) and rounded once.
    """
    exponents = np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim
    inv_freq = 1.0 / (theta**exponents)
    kind = None if scaling is None else scaling.rope_type
    if kind is RopeType.LINEAR:
        inv_freq = inv_freq / scaling.factor
    elif kind is RopeType.LLAMA3:
        inv_freq = _llama3_inv_freq(inv_freq, scaling)
    elif kind is RopeType.YARN:
        inv_freq = _yarn_inv_freq(inv_freq, rotary_dim, theta, scaling)
    elif kind is RopeType.PROPORTIONAL:  # rotary_dim is the whole head; the tail pairs stand still
        turning = int(scaling.rotated_fraction * rotary_dim // 2)
        inv_freq = np.concatenate([inv_freq[:turning], np.zeros(rotary_dim // 2 - turning)]) / scaling.factor
    elif kind is RopeType.LONGROPE:
        if len(scaling.short_factor) != rotary_dim // 2:
            raise UnsupportedModelError(f"longrope short_factor has {len(scaling.short_factor)} entries; "
                             f"rotary_dim={rotary_dim} needs {rotary_dim // 2}")
        inv_freq = inv_freq / np.asarray(scaling.short_factor, np.float64)
    # DEFAULT and DYNAMIC (within max_position_embeddings, see RopeType) keep the base frequencies.
    return inv_freq.astype(np.float32)


def rope_tables(cfg: RopeConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin [R/2, B, T] for int32[B, T] positions, times the scaling's attention scale."""
    inv_freq = rope_inv_freq(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling)
    angles = inv_freq[:, None, None] * positions[None].astype(jnp.float32)  # [R/2, B, T]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    scale = 1.0 if cfg.rope_scaling is None else cfg.rope_scaling.attention_scale
    if scale != 1.0:  # yarn / longrope: transformers scales cos and sin (so q.k by scale^2)
        cos, sin = cos * scale, sin * scale
    return cos, sin


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, rotary_dim: int) -> jax.Array:
    """Rotate-half RoPE on the leading `rotary_dim` of the head axis; the rest passes through.

    x: [heads, H, B, T] (feature-major); cos, sin: [R/2, B, T]. Dim i < R/2 pairs with i + R/2.
    """
    half = rotary_dim // 2
    x1, x2, rest = x[:, :half], x[:, half:rotary_dim], x[:, rotary_dim:]
    rotated = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
    return jnp.concatenate(rotated + ([rest] if rest.shape[1] else []), axis=1)


# ----------------------------------------------------------------------------------------------
# Attention, MLP, logits
# ----------------------------------------------------------------------------------------------


def qkv_projections(weights: AttentionParams, h: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q [N*H (or N*2H), B*T], k and v [K*H, B*T] (no bias): one product when fused, else three."""
    if weights.qkv_proj is None:
        return matmul(weights.q_proj, h), matmul(weights.k_proj, h), matmul(weights.v_proj, h)
    q_rows, k_rows, _ = weights.qkv_rows
    return tuple(jnp.split(matmul(weights.qkv_proj, h), [q_rows, q_rows + k_rows]))


def fuse_projections(params: Any) -> Any:
    """`params` (any tree holding AttentionParams / MlpParams) with q/k/v stacked into `qkv_proj`
    and gate/up into `gate_up_proj`, in whatever format the weights are: fewer, larger products,
    which on XLA CPU saves a per-call overhead that dominates products this small."""

    def fuse(node: Any) -> Any:
        if isinstance(node, AttentionParams) and node.qkv_proj is None and None not in (node.k_proj, node.v_proj):
            # (Gemma's KV-shared layers have no k/v, and attention_k_eq_v layers no v: left as they are.)
            parts = (node.q_proj, node.k_proj, node.v_proj)
            return node.replace(qkv_proj=concat_rows(*parts), qkv_rows=tuple(w.shape[0] for w in parts),
                                q_proj=None, k_proj=None, v_proj=None)
        if isinstance(node, MlpParams) and node.gate_up_proj is None:
            return node.replace(gate_up_proj=concat_rows(node.gate_proj, node.up_proj), gate_proj=None, up_proj=None)
        return node

    return jax.tree.map(fuse, params, is_leaf=_is_block)


def unfuse_projections(params: Any) -> Any:
    """The inverse of `fuse_projections`: q/k/v and gate/up as the checkpoint names them."""

    def unfuse(node: Any) -> Any:
        if isinstance(node, AttentionParams) and node.qkv_proj is not None:
            q_rows, k_rows, _ = node.qkv_rows
            q, k, v = split_rows(node.qkv_proj, (q_rows, q_rows + k_rows))
            return node.replace(q_proj=q, k_proj=k, v_proj=v, qkv_proj=None, qkv_rows=None)
        if isinstance(node, MlpParams) and node.gate_up_proj is not None:
            gate, up = split_rows(node.gate_up_proj, (node.gate_up_proj.shape[0] // 2,))
            return node.replace(gate_proj=gate, up_proj=up, gate_up_proj=None)
        return node

    return jax.tree.map(unfuse, params, is_leaf=_is_block)


def _is_block(node: Any) -> bool:
    return isinstance(node, AttentionParams | MlpParams)


def self_attention(
    weights: AttentionParams, cfg: AttentionConfig, h: jax.Array, cos: jax.Array, sin: jax.Array,
    keys: Packed | DraftChain, values: Packed | DraftChain, offsets: jax.Array, batch: int, steps: int,
    *, qk_norm: bool = False, output_gate: bool = False, attention: Attention | str = Attention.AUTO,
    tree_mask: TreeMask | None = None,
) -> tuple[jax.Array, Packed | DraftChain, Packed | DraftChain]:
    """Self-attention of T new tokens per row over that row's cache. h: [D, B*T] (normed).

    weights: q_proj [N*H, D] ([N*2H, D] with `output_gate`: per head H query rows then H gate
    rows, as Qwen3.5 fuses them); k_proj, v_proj [K*H, D]; o_proj [D, N*H]; q_bias, k_bias,
    v_bias when not None; q_norm, k_norm [H] with `qk_norm` (RMSNorm per head before RoPE).
    With `output_gate` the attention output is multiplied by sigmoid(gate) before o_proj.
    keys/values are the layer's buffers [B, K, S, H] in the cache's format; `attention` picks
    the Pallas kernel or the XLA reference (jaxspec.pallas.flash_decode.Attention); `tree_mask`
    replaces the causal rule among the new tokens (a draft tree's ancestor mask). keys/values
    may instead be `DraftChain`s (a draft head's deeper training-time-test step: `offsets` and
    the switches are then unused), and come back with this step's entries in them.
    Returns the output [D, B*T] and the buffers with the T new entries written at `offsets`.
    """
    N, K, G, H = cfg.num_heads, cfg.num_kv_heads, cfg.group_size, cfg.head_dim
    q, k, v = qkv_projections(weights, h)
    if weights.q_bias is not None:
        q, k, v = q + weights.q_bias[:, None], k + weights.k_bias[:, None], v + weights.v_bias[:, None]
    gate = None
    if output_gate:
        query_gate = q.reshape(N, 2, H, batch, steps)
        q, gate = query_gate[:, 0], query_gate[:, 1]  # [N, H, B, T] each
    q = q.reshape(N, H, batch, steps)
    k, v = k.reshape(K, H, batch, steps), v.reshape(K, H, batch, steps)
    if qk_norm:
        q = rms_norm(q, weights.q_norm, cfg.norm_eps, axis=1)
        k = rms_norm(k, weights.k_norm, cfg.norm_eps, axis=1)
    q = apply_rope(q, cos, sin, cfg.rotary_dim)
    k = apply_rope(k, cos, sin, cfg.rotary_dim)

    # Queries as [B, T, K, G, H] (GQA: query head k*G + g reads kv head k).
    q = jnp.transpose(q.reshape(K, G, H, batch, steps), (3, 4, 0, 1, 2))
    if isinstance(keys, DraftChain):
        # A deeper step of the training-time test: this depth's entries join every chain, and each
        # query reads its context and its own chain (jaxspec.models.draft_chain).
        keys = keys.written(jnp.transpose(k, (2, 0, 3, 1)))  # [K, H, B, T] -> [B, K, T, H]
        values = values.written(jnp.transpose(v, (2, 0, 3, 1)))
        out = chain_attention(q, keys, values)  # [B, T, K, G, H]
    else:
        # The new keys/values land at each row's own offset (quantized on the way in for a block
        # format); attention then reads them back from the cache like every other slot, so a T = 1
        # and a T = k+1 forward see the same stored values.
        attention = attention_path(attention, weights)
        quantize = quantize_for(attention)
        keys = write_kv(keys, jnp.transpose(k, (2, 3, 0, 1)), offsets, quantize)  # [B, K, S, H]
        values = write_kv(values, jnp.transpose(v, (2, 3, 0, 1)), offsets, quantize)
        out = attend(q, keys, values, offsets, mask=tree_mask, attention=attention)  # [B, T, K, G, H]
    out = jnp.transpose(out, (2, 3, 4, 0, 1)).reshape(N * H, batch * steps)  # [N*H, B*T]
    if gate is not None:
        out = out * jax.nn.sigmoid(gate.reshape(N * H, batch * steps))  # per head dim
    return matmul(weights.o_proj, out), keys, values


def attention_path(attention: Attention | str, weights: AttentionParams) -> Attention | str:
    """The attention a layer runs: "auto" on the native product backend (its weights packed for
    jaxspec.cpu) is the native kernel, so a native model runs its decode attention natively too;
    anything else as asked."""
    projection = weights.qkv_proj if weights.qkv_proj is not None else weights.q_proj
    if Attention.parse(attention) is Attention.AUTO and isinstance(projection, PackedWeight):
        return Attention.NATIVE
    return attention


def swiglu(weights: MlpParams, x: jax.Array, activation: Callable[[jax.Array], jax.Array] = jax.nn.silu) -> jax.Array:
    """The gated MLP down(act(gate(x)) * up(x)): x [D, B*T] (normed) -> [D, B*T]. SwiGLU with
    the default silu; Gemma's GeGLU passes `gelu_tanh`."""
    if weights.gate_up_proj is not None:
        gate, up = jnp.split(matmul(weights.gate_up_proj, x), 2)  # [F, B*T] each
    else:
        gate, up = matmul(weights.gate_proj, x), matmul(weights.up_proj, x)
    return matmul(weights.down_proj, activation(gate) * up)


def gelu_tanh(x: jax.Array) -> jax.Array:
    """GELU with the tanh approximation (transformers' `gelu_pytorch_tanh`, Gemma's activation)."""
    return jax.nn.gelu(x, approximate=True)


def output_head(embed: Weight, lm_head: Weight | None) -> Weight:
    """A trunk's output projection [V, D]: its own lm_head, or the token embedding [V, D] when
    the embeddings are tied (lm_head None)."""
    return embed if lm_head is None else lm_head


def logits_head(head: Weight, h: jax.Array, batch: int, steps: int,
                logit_indices: jax.Array | None = None) -> jax.Array:
    """Logits float32[B, P, V] from the final-normed stream h [D, B*T].

    head [V, D]: an lm_head, or the embedding when tied (`output_head`); a draft head passes its
    own. logit_indices int32[B, P] picks which of each row's T positions get logits (prefill
    needs one per row); default all T (P = T).
    """
    dim = h.shape[0]
    h = h.reshape(dim, batch, steps)
    if logit_indices is not None:
        h = jnp.take_along_axis(h, logit_indices[None], axis=2)  # [D, B, P]
    positions_out = h.shape[2]
    logits = matmul(head, h.reshape(dim, -1)).reshape(-1, batch, positions_out)  # [V, B, P]
    return logits.transpose(1, 2, 0)


def decoder_layer(
    layer: LlamaLayer, cfg: AttentionConfig, h: jax.Array, cos: jax.Array, sin: jax.Array,
    keys: Packed | DraftChain, values: Packed | DraftChain, offsets: jax.Array, batch: int, steps: int,
    *, qk_norm: bool = False, attention: Attention | str = Attention.AUTO, tree_mask: TreeMask | None = None,
) -> tuple[jax.Array, Packed, Packed]:
    """One pre-norm decoder layer on the residual stream h [D, B*T]: attention, then SwiGLU.

    Returns the new stream and the layer's KV buffers with T entries written.
    """
    attn_out, keys, values = self_attention(layer.attention, cfg, rms_norm(h, layer.attn_norm, cfg.norm_eps), cos,
                                            sin, keys, values, offsets, batch, steps, qk_norm=qk_norm,
                                            attention=attention, tree_mask=tree_mask)
    h = h + attn_out
    return h + swiglu(layer.mlp, rms_norm(h, layer.mlp_norm, cfg.norm_eps)), keys, values
