"""The Gemma 3 and Gemma 4 text trunks (dense): local sliding-window and global attention layers.

The text models of transformers' `models/gemma3` and `models/gemma4` (the references, tests-only).
A stack of decoder layers between a scaled embedding and a tied, optionally soft-capped, logits
head; every feature below is switched on by the config alone, so one forward serves both:

  * layer types: `sliding_attention` layers see the last `sliding_window` positions, a mask over
    the same preallocated cache (`flash_decode.mask_visible`), so rollback stays by length;
    `full_attention` layers see everything. Each type has its own RoPE (theta, scaling; Gemma 4's
    global layers "proportional": a quarter of the frequency pairs turn, across the whole head),
    and in Gemma 4 its own head width and kv head count (`global_head_dim`,
    `num_global_key_value_heads`, HF's `per_layer_config`);
  * QK-norm (RMSNorm per head before RoPE); Gemma 4 also RMS-normalises V (no weight) and scales
    q.k by 1 (its QK-norm sets the scale), Gemma 3 by query_pre_attn_scalar^-1/2;
  * sandwich norms: RMSNorm before and after attention and before and after the MLP;
  * the embedding times sqrt(D), GeGLU (gelu_tanh) MLPs, final logit soft-capping;
  * Gemma 4: per-layer inputs (`hidden_size_per_layer_input` P: a second embedding [V, L*P] plus a
    projection of the embedded stream, one P-vector per layer gating a residual branch),
    a per-layer output scalar, `attention_k_eq_v` (global layers' values are their raw keys),
    and KV sharing (`num_kv_shared_layers`): the last layers compute no K/V and attend over the
    K/V of the last earlier layer of their type. Those layers own no cache buffer: the cache holds
    one buffer per layer that computes K/V (`GemmaConfig.kv_layout`), and a sharing layer reads
    its source's buffer after the source has written this forward's tokens into it.

Refused by name: MoE blocks, the double-wide MLP, attention logit soft-capping (Gemma 2),
bidirectional attention. Multimodal configs (`gemma3`, `gemma4`) run their text trunk.

Layout follows llama.py (weights `[out, in]`, activations feature-major `[D, B*T]`). Norm weights
are stored as the multiplier: Gemma 3's RMSNorm is zero-centred (x * (1 + w)) and its HF tensor
map adds the 1 once on load (llama.cpp's GGUF already stores 1 + w); Gemma 4's is x * w as stored.
Letters: `jaxspec.config.ModelConfig`'s, plus P the per-layer input width.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxspec.cache import KVCache, write_kv
from jaxspec.config import (RopeScaling, _rope_settings, check_sane, check_sizes_and_numerics, count, eos_ids, flag,
                            gguf_eos_ids, gguf_vocab_size, real, from_json_dict, rope_scaling_from_dict, to_json_dict)
from jaxspec.errors import CheckpointError, InvalidRequestError, UnsupportedModelError
from jaxspec.models.family import Family, TensorSource
from jaxspec.models.layers import (AttentionParams, MlpParams, apply_rope, attention_path, gelu_tanh, logits_head,
                                   output_head, qkv_projections, rms_norm, rope_tables, swiglu)
from jaxspec.models.params import LeafFn, param
from jaxspec.models.quant import embedding_rows, matmul
from jaxspec.pallas.flash_decode import Attention, TreeMask, attend, quantize_for


class LayerType(enum.Enum):
    SLIDING = "sliding_attention"  # local: the last `window` positions
    FULL = "full_attention"  # global


@dataclasses.dataclass(frozen=True, kw_only=True)
class GemmaAttention:
    """The attention of one layer type: shape, RoPE, reach. Duck-types `layers.RopeConfig`."""

    num_heads: int  # N
    num_kv_heads: int  # K
    head_dim: int  # H
    rotary_dim: int  # the width `apply_rope` rotates (proportional RoPE: all of H)
    rope_theta: float
    rope_scaling: RopeScaling | None = None
    window: int | None = None  # sliding layers: a key is seen when query position - key position < window
    values_from_keys: bool = False  # attention_k_eq_v: V is the raw K projection (Gemma 4 global layers)

    def __post_init__(self):
        if isinstance(self.rope_scaling, Mapping):  # a JSON round trip
            object.__setattr__(self, "rope_scaling", rope_scaling_from_dict(self.rope_scaling))
        for name in ("num_heads", "num_kv_heads", "head_dim", "rotary_dim"):
            if count(getattr(self, name)) < 1:
                raise UnsupportedModelError(f"{name}={getattr(self, name)} must be >= 1")
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise UnsupportedModelError(f"rotary_dim={self.rotary_dim} must be even and <= head_dim={self.head_dim}")
        check_sane("rope_theta", self.rope_theta)
        if self.window is not None and self.window < 1:
            raise UnsupportedModelError(f"sliding_window={self.window} must be >= 1")

    @property
    def group_size(self) -> int:  # G
        return self.num_heads // self.num_kv_heads


@dataclasses.dataclass(frozen=True, kw_only=True)
class GemmaConfig:
    """Shape and numerics of a Gemma 3 or Gemma 4 text trunk."""

    generation: int  # 3 or 4: which of the two families' fixed choices apply (module docstring)
    vocab_size: int  # V
    dim: int  # D
    num_layers: int  # L
    layer_types: tuple[LayerType, ...]
    ffn_dim: int  # F
    sliding: GemmaAttention
    full: GemmaAttention
    query_scale: float  # the factor on q.k
    final_logit_softcap: float | None = None  # logits -> cap * tanh(logits / cap)
    per_layer_dim: int = 0  # P (Gemma 4 hidden_size_per_layer_input; 0: none)
    per_layer_vocab: int = 0  # rows of the per-layer embedding (vocab_size_per_layer_input)
    num_kv_shared_layers: int = 0  # the last this many layers reuse earlier layers' K/V
    norm_eps: float = 1e-6
    max_position_embeddings: int = 8192
    tie_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        try:
            layer_types = tuple(LayerType(t) for t in self.layer_types)
        except ValueError as err:
            raise UnsupportedModelError(f"layer_types: {err} (only {[t.value for t in LayerType]})") from None
        if len(layer_types) < self.num_layers:
            raise UnsupportedModelError(
                f"layer_types has {len(layer_types)} entries but num_layers is {self.num_layers}")
        # A longer tuple is cut (a layer-skip draft is the target's config with fewer layers).
        object.__setattr__(self, "layer_types", layer_types[: self.num_layers])
        for name in ("sliding", "full"):
            value = getattr(self, name)
            if isinstance(value, Mapping):
                object.__setattr__(self, name, GemmaAttention(**value))
        check_sizes_and_numerics(self, ("vocab_size", "dim", "num_layers", "ffn_dim", "max_position_embeddings"))
        checks = [
            (self.generation in (3, 4), f"generation={self.generation} must be 3 or 4"),
            (self.sliding.window is not None, "the sliding layers need a sliding_window"),
            (self.full.window is None, "full-attention layers have no window"),
            (0 <= self.num_kv_shared_layers < self.num_layers,
             f"num_kv_shared_layers={self.num_kv_shared_layers} must be < num_layers={self.num_layers}"),
            (self.per_layer_dim >= 0 and (self.per_layer_dim == 0 or self.per_layer_vocab >= 1),
             f"per-layer inputs of width {self.per_layer_dim} need vocab_size_per_layer_input >= 1"),
            (self.final_logit_softcap is None or self.final_logit_softcap > 0,
             f"final_logit_softcapping={self.final_logit_softcap} must be > 0"),
            (math.isfinite(self.query_scale) and self.query_scale > 0,
             f"the query scale {self.query_scale} must be a finite number > 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise UnsupportedModelError(message)
        self.kv_sources  # noqa: B018 -- raises when a sharing layer has no earlier layer of its type

    # Duck-typed for the code that reads any trunk's config (check_sizes_and_numerics; sharding's
    # axis counts, which a split must divide in every layer type): the RoPE theta of the global
    # layers, the widest head, the kv heads every layer type's count is a multiple of.
    @property
    def rope_theta(self) -> float:
        return self.full.rope_theta

    @property
    def head_dim(self) -> int:
        return max(self.sliding.head_dim, self.full.head_dim)

    @property
    def num_heads(self) -> int:
        return self.full.num_heads

    @property
    def num_kv_heads(self) -> int:
        return math.gcd(self.sliding.num_kv_heads, self.full.num_kv_heads)

    def truncated(self, num_layers: int) -> GemmaConfig:
        """The config of the first `num_layers` layers (a layer-skip draft): layers the cut keeps
        past the first shared one still share; a cut before it leaves none sharing."""
        shared = max(0, num_layers - self.first_shared_layer)
        return dataclasses.replace(self, num_layers=num_layers, num_kv_shared_layers=shared)

    def attention_for(self, kind: LayerType) -> GemmaAttention:
        return self.full if kind is LayerType.FULL else self.sliding

    def attention_of(self, index: int) -> GemmaAttention:
        return self.attention_for(self.layer_types[index])

    @property
    def first_shared_layer(self) -> int:
        return self.num_layers - self.num_kv_shared_layers

    def kv_source_of(self, kind: LayerType) -> int:
        """The last layer before the shared ones of type `kind`: whose K/V a sharing layer of that
        type reads (HF's "store" layer; also what a Gemma 4 assistant's layers of `kind` read)."""
        candidates = [i for i in range(self.first_shared_layer) if self.layer_types[i] is kind]
        if not candidates:
            raise UnsupportedModelError(
                f"no layer before the {self.num_kv_shared_layers} KV-shared ones is {kind.value}, "
                "so a shared layer of that type has no K/V to read")
        return candidates[-1]

    @property
    def kv_sources(self) -> tuple[int, ...]:
        """Per layer, the layer whose K/V it attends over (itself unless it shares): also the index
        of the cache buffer it reads, the cache holding one per layer before the shared ones."""
        return tuple(i if i < self.first_shared_layer else self.kv_source_of(self.layer_types[i])
                     for i in range(self.num_layers))

    @property
    def kv_layout(self) -> tuple[tuple[int, int], ...]:
        """(kv heads, head dim) of each cache buffer (`cache.kv_layout`)."""
        return tuple((self.attention_of(i).num_kv_heads, self.attention_of(i).head_dim)
                     for i in range(self.first_shared_layer))


# ----------------------------------------------------------------------------------------------
# Params
# ----------------------------------------------------------------------------------------------


@struct.dataclass
class GemmaLayer:
    """One Gemma decoder layer: sandwich-normed attention and GeGLU MLP, optional Gemma 4 parts."""

    attn_norm: jax.Array = param(axes=("embed",))  # [D]
    # q_proj [N*H, D], q_norm [H], o_proj [D, N*H]; k_proj [K*H, D] and k_norm [H] unless the layer
    # shares K/V; v_proj [K*H, D] unless it shares or its values are its keys.
    attention: AttentionParams
    post_attn_norm: jax.Array = param(axes=("embed",))  # [D]
    mlp_norm: jax.Array = param(axes=("embed",))  # [D]
    mlp: MlpParams
    post_mlp_norm: jax.Array = param(axes=("embed",))  # [D]
    per_layer_gate: jax.Array | None = param(axes=(None, "embed"), linear=True)  # [P, D]
    per_layer_proj: jax.Array | None = param(axes=("embed", None), linear=True)  # [D, P]
    per_layer_norm: jax.Array | None = param(axes=("embed",))  # [D]
    scalar: jax.Array | None = param(axes=(None,))  # [1]: Gemma 4's layer_scalar


@struct.dataclass
class GemmaParams:
    """A Gemma 3 / Gemma 4 text trunk's params."""

    embed: jax.Array = param(axes=("vocab", "embed"), linear=True)  # [V, D]
    per_layer_embed: jax.Array | None = param(axes=("vocab", None), linear=True)  # [V_ple, L*P]
    per_layer_model_proj: jax.Array | None = param(axes=(None, "embed"), linear=True)  # [L*P, D]
    per_layer_proj_norm: jax.Array | None = param(axes=(None,))  # [P]
    layers: tuple[GemmaLayer, ...]
    final_norm: jax.Array = param(axes=("embed",))  # [D]
    lm_head: jax.Array | None = param(axes=("vocab", "embed"), linear=True)  # [V, D]; None when tied


_TOP_PER_LAYER = ("per_layer_embed", "per_layer_model_proj", "per_layer_proj_norm")


def layer_shapes(cfg: GemmaConfig, index: int) -> dict[str, tuple[int, ...]]:
    """Shapes of layer `index`'s params, in checkpoint order (absent params absent)."""
    spec, D, F, P = cfg.attention_of(index), cfg.dim, cfg.ffn_dim, cfg.per_layer_dim
    N, K, H = spec.num_heads, spec.num_kv_heads, spec.head_dim
    shapes = {"attn_norm": (D,), "q_proj": (N * H, D)}
    if index < cfg.first_shared_layer:
        shapes["k_proj"] = (K * H, D)
        if not spec.values_from_keys:
            shapes["v_proj"] = (K * H, D)
    shapes["o_proj"] = (D, N * H)
    shapes["q_norm"] = (H,)
    if index < cfg.first_shared_layer:
        shapes["k_norm"] = (H,)
    shapes |= {"post_attn_norm": (D,), "mlp_norm": (D,), "gate_proj": (F, D), "up_proj": (F, D),
               "down_proj": (D, F), "post_mlp_norm": (D,)}
    if P:
        shapes |= {"per_layer_gate": (P, D), "per_layer_proj": (D, P), "per_layer_norm": (D,)}
    if cfg.generation == 4:
        shapes["scalar"] = (1,)
    return shapes


def top_shapes(cfg: GemmaConfig) -> dict[str, tuple[int, ...]]:
    shapes = {"embed": (cfg.vocab_size, cfg.dim)}
    if cfg.per_layer_dim:
        width = cfg.num_layers * cfg.per_layer_dim
        shapes |= {"per_layer_embed": (cfg.per_layer_vocab, width), "per_layer_model_proj": (width, cfg.dim),
                   "per_layer_proj_norm": (cfg.per_layer_dim,)}
    shapes["final_norm"] = (cfg.dim,)
    if not cfg.tie_embeddings:
        shapes["lm_head"] = (cfg.vocab_size, cfg.dim)
    return shapes


def params_from(cfg: GemmaConfig, leaf: LeafFn) -> GemmaParams:
    """The params tree of `cfg`, each present param `leaf(name, layer index)` (None at the top),
    asked in checkpoint order; absent params are None."""
    top = top_shapes(cfg)

    def top_leaf(name: str) -> Any:
        return leaf(name, None) if name in top else None

    def layer(index: int) -> GemmaLayer:
        names = layer_shapes(cfg, index)

        def get(name: str) -> Any:
            return leaf(name, index) if name in names else None

        attn_norm = get("attn_norm")
        attention = AttentionParams(q_proj=get("q_proj"), k_proj=get("k_proj"), v_proj=get("v_proj"),
                                    o_proj=get("o_proj"), q_bias=None, k_bias=None, v_bias=None,
                                    q_norm=get("q_norm"), k_norm=get("k_norm"))
        post_attn_norm, mlp_norm = get("post_attn_norm"), get("mlp_norm")
        mlp = MlpParams(gate_proj=get("gate_proj"), up_proj=get("up_proj"), down_proj=get("down_proj"))
        return GemmaLayer(attn_norm=attn_norm, attention=attention, post_attn_norm=post_attn_norm, mlp_norm=mlp_norm,
                          mlp=mlp, post_mlp_norm=get("post_mlp_norm"), per_layer_gate=get("per_layer_gate"),
                          per_layer_proj=get("per_layer_proj"), per_layer_norm=get("per_layer_norm"),
                          scalar=get("scalar"))

    embed = top_leaf("embed")
    per_layer = {name: top_leaf(name) for name in _TOP_PER_LAYER}
    layers = tuple(layer(index) for index in range(cfg.num_layers))
    return GemmaParams(embed=embed, **per_layer, layers=layers, final_norm=top_leaf("final_norm"),
                       lm_head=top_leaf("lm_head"))


def param_shapes(cfg: GemmaConfig) -> GemmaParams:
    top = top_shapes(cfg)
    return params_from(cfg, lambda name, index: top[name] if index is None else layer_shapes(cfg, index)[name])


_NORMS = frozenset({"attn_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm", "q_norm", "k_norm", "per_layer_norm",
                    "final_norm", "per_layer_proj_norm"})


def init_params(cfg: GemmaConfig, key: jax.Array, scale: float = 0.02) -> GemmaParams:
    """Random params of the right shapes (tests): norms 1 + noise, layer scalars near 1."""
    top = top_shapes(cfg)
    names = [(name, None, shape) for name, shape in top.items()]
    names += [(name, index, shape) for index in range(cfg.num_layers) for name, shape in layer_shapes(cfg, index).items()]
    sizes = [math.prod(shape) for _, _, shape in names]
    flat = np.asarray(jax.random.normal(key, (sum(sizes),), jnp.float32)) * scale
    values = {}
    for (name, index, shape), piece in zip(names, np.split(flat, np.cumsum(sizes)[:-1])):
        piece = piece.reshape(shape)
        if name in _NORMS or name == "scalar":
            piece = 1.0 + 5 * piece
        if name == "embed":
            piece = piece * 50  # so the embedding scale sqrt(D) leaves a stream of order 1
        values[name, index] = jnp.asarray(piece)
    return params_from(cfg, lambda name, index: values[name, index])


# ----------------------------------------------------------------------------------------------
# The forward
# ----------------------------------------------------------------------------------------------


def embed_tokens(embed, cfg: GemmaConfig, tokens: jax.Array) -> jax.Array:
    """The scaled embedding [D, B*T] of int32 tokens (any shape) from the table `embed` [V, D]:
    what enters layer 0, and what a Gemma 4 assistant reads of the target's embedding."""
    scale = np.float32(math.sqrt(cfg.dim))  # transformers rounds sqrt(D) to the weights' dtype
    return embedding_rows(embed, tokens.reshape(-1)).T * scale


def per_layer_inputs(params: GemmaParams, cfg: GemmaConfig, tokens: jax.Array, h: jax.Array) -> jax.Array:
    """Gemma 4's per-layer inputs [L, P, B*T]: (norm(proj(h) / sqrt(D)) + embed_ple(token) * sqrt(P)) / sqrt(2)."""
    L, P = cfg.num_layers, cfg.per_layer_dim
    # A layer-skip draft (fewer layers than the tables were made for) reads the first L*P rows.
    identity = embedding_rows(params.per_layer_embed, tokens.reshape(-1)).T[: L * P] * np.float32(math.sqrt(P))
    context = matmul(params.per_layer_model_proj, h)[: L * P] * np.float32(cfg.dim ** -0.5)  # [L*P, B*T]
    context = rms_norm(context.reshape(L, P, -1), params.per_layer_proj_norm, cfg.norm_eps, axis=1)
    return (context + identity.reshape(L, P, -1)) * np.float32(2.0 ** -0.5)


def attention_layer(weights: AttentionParams, spec: GemmaAttention, cfg: GemmaConfig, x: jax.Array, cos: jax.Array,
                    sin: jax.Array, keys, values, offsets: jax.Array, positions: jax.Array, batch: int, steps: int,
                    *, computes_kv: bool, attention: Attention | str, tree_mask: TreeMask | None) -> tuple:
    """One Gemma attention over the cache. x [D, B*T] (normed). A layer that computes K/V writes
    its T entries at `offsets` and returns the buffers; a sharing layer reads `keys`/`values` (its
    source's, this forward's entries already in them) and returns them unchanged."""
    N, K, G, H = spec.num_heads, spec.num_kv_heads, spec.group_size, spec.head_dim
    attention = attention_path(attention, weights)
    if weights.qkv_proj is not None:  # fused on load (`fuse_projections`): only layers with all three
        q, raw, v = (part.reshape(-1, H, batch, steps) for part in qkv_projections(weights, x))
    else:
        q = matmul(weights.q_proj, x).reshape(N, H, batch, steps)
        if computes_kv:
            raw = matmul(weights.k_proj, x).reshape(K, H, batch, steps)
            v = raw if weights.v_proj is None else matmul(weights.v_proj, x).reshape(K, H, batch, steps)
    q = apply_rope(rms_norm(q, weights.q_norm, cfg.norm_eps, axis=1), cos, sin, spec.rotary_dim)
    if computes_kv:
        k = apply_rope(rms_norm(raw, weights.k_norm, cfg.norm_eps, axis=1), cos, sin, spec.rotary_dim)
        if cfg.generation == 4:  # V normalised per head, no weight
            v = rms_norm(v, np.ones((H,), np.float32), cfg.norm_eps, axis=1)
        quantize = quantize_for(attention)
        keys = write_kv(keys, jnp.transpose(k, (2, 3, 0, 1)), offsets, quantize)  # [B, K, S, H]
        values = write_kv(values, jnp.transpose(v, (2, 3, 0, 1)), offsets, quantize)
    q = jnp.transpose(q.reshape(K, G, H, batch, steps), (3, 4, 0, 1, 2))  # [B, T, K, G, H]
    out = attend(q, keys, values, offsets, mask=tree_mask, window=spec.window, query_positions=positions,
                 scale=cfg.query_scale, attention=attention)  # [B, T, K, G, H]
    out = jnp.transpose(out, (2, 3, 4, 0, 1)).reshape(N * H, batch * steps)
    return matmul(weights.o_proj, out), keys, values


def decoder_layer(layer: GemmaLayer, cfg: GemmaConfig, h: jax.Array, mixed: jax.Array,
                  per_layer_input: jax.Array | None) -> jax.Array:
    """The rest of a layer after its attention output `mixed` [D, B*T]: the post-attention norm and
    residual, the sandwich-normed GeGLU, Gemma 4's per-layer branch and scalar."""
    h = h + rms_norm(mixed, layer.post_attn_norm, cfg.norm_eps)
    mlp_out = swiglu(layer.mlp, rms_norm(h, layer.mlp_norm, cfg.norm_eps), activation=gelu_tanh)
    h = h + rms_norm(mlp_out, layer.post_mlp_norm, cfg.norm_eps)
    if per_layer_input is not None:
        gated = gelu_tanh(matmul(layer.per_layer_gate, h)) * per_layer_input  # [P, B*T]
        h = h + rms_norm(matmul(layer.per_layer_proj, gated), layer.per_layer_norm, cfg.norm_eps)
    if layer.scalar is not None:
        h = h * layer.scalar
    return h


def soft_cap(logits: jax.Array, cap: float | None) -> jax.Array:
    return logits if cap is None else jnp.tanh(logits / cap) * cap


def forward(
    params: GemmaParams,
    cfg: GemmaConfig,
    tokens: jax.Array,
    cache: KVCache,
    *,
    positions: jax.Array | None = None,
    logit_indices: jax.Array | None = None,
    hidden_layers: tuple[int, ...] = (),
    attention: Attention | str = Attention.AUTO,
    tree_mask: TreeMask | None = None,
) -> tuple[jax.Array, tuple[jax.Array, ...], KVCache]:
    """Run T new tokens per row through the trunk (the `jaxspec.models` contract, as llama.py).

    tokens int32[B, T] at slots `cache.length[b] + t`; positions (RoPE, and the sliding window's
    reference point) default the slots; a tree verify passes each node's depth-based positions
    and its `tree_mask`. Returns logits float32[B, P, V] (soft-capped), the hiddens asked
    (-1: the scaled embedding; L: after the final norm), and the cache with K/V written.
    """
    if len(params.layers) != cfg.num_layers:
        raise UnsupportedModelError(f"params have {len(params.layers)} layers but num_layers is {cfg.num_layers}")
    batch, steps = tokens.shape
    offsets = cache.length
    if positions is None:
        positions = offsets[:, None] + jnp.arange(steps, dtype=jnp.int32)[None, :]
    rope = {kind: rope_tables(cfg.attention_for(kind), positions) for kind in set(cfg.layer_types)}
    h = embed_tokens(params.embed, cfg, tokens)  # [D, B*T]
    per_layer = per_layer_inputs(params, cfg, tokens, h) if cfg.per_layer_dim else None
    keys, values = list(cache.keys), list(cache.values)
    buffer_of = cfg.kv_sources
    hiddens = {-1: h}
    for index, layer in enumerate(params.layers):
        kind, buffer = cfg.layer_types[index], buffer_of[index]
        with jax.named_scope(f"layer_{index}_{kind.value}"):
            cos, sin = rope[kind]
            mixed, keys[buffer], values[buffer] = attention_layer(
                layer.attention, cfg.attention_of(index), cfg, rms_norm(h, layer.attn_norm, cfg.norm_eps), cos, sin,
                keys[buffer], values[buffer], offsets, positions, batch, steps,
                computes_kv=index < cfg.first_shared_layer, attention=attention, tree_mask=tree_mask)
            h = decoder_layer(layer, cfg, h, mixed, None if per_layer is None else per_layer[index])
        hiddens[index] = h
    h = rms_norm(h, params.final_norm, cfg.norm_eps)
    hiddens[cfg.num_layers] = h
    logits = logits_head(output_head(params.embed, params.lm_head), h, batch, steps, logit_indices)  # [B, P, V]
    logits = soft_cap(logits, cfg.final_logit_softcap)
    hidden_out = tuple(hiddens[i].reshape(cfg.dim, batch, steps).transpose(1, 2, 0) for i in hidden_layers)
    return logits, hidden_out, cache.replace(keys=tuple(keys), values=tuple(values))


# ----------------------------------------------------------------------------------------------
# The family descriptor: HF config.json and tensor names, GGUF (llama.cpp's gemma3)
# ----------------------------------------------------------------------------------------------

HF_MODEL_TYPES = ("gemma3_text", "gemma3", "gemma4_text", "gemma4")
_HF_PREFIXES = ("model.language_model.", "model.", "")
_HF_TOP = {"embed": "embed_tokens.weight", "per_layer_embed": "embed_tokens_per_layer.weight",
           "per_layer_model_proj": "per_layer_model_projection.weight",
           "per_layer_proj_norm": "per_layer_projection_norm.weight", "final_norm": "norm.weight"}
_HF_LAYER = {
    "attn_norm": "input_layernorm.weight", "q_proj": "self_attn.q_proj.weight", "k_proj": "self_attn.k_proj.weight",
    "v_proj": "self_attn.v_proj.weight", "o_proj": "self_attn.o_proj.weight", "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight", "post_attn_norm": "post_attention_layernorm.weight",
    "mlp_norm": "pre_feedforward_layernorm.weight", "gate_proj": "mlp.gate_proj.weight",
    "up_proj": "mlp.up_proj.weight", "down_proj": "mlp.down_proj.weight",
    "post_mlp_norm": "post_feedforward_layernorm.weight", "per_layer_gate": "per_layer_input_gate.weight",
    "per_layer_proj": "per_layer_projection.weight", "per_layer_norm": "post_per_layer_input_norm.weight",
    "scalar": "layer_scalar",
}
# Options the Gemma configs accept that this trunk does not build, and the value it needs.
_UNSUPPORTED = {"enable_moe_block": False, "use_double_wide_mlp": False, "attn_logit_softcapping": None,
                "use_bidirectional_attention": None, "attention_bias": False,
                "hidden_activation": "gelu_pytorch_tanh"}


def _text_config(hf: Mapping[str, Any]) -> tuple[Mapping[str, Any], int]:
    model_type = hf.get("model_type")
    if model_type not in HF_MODEL_TYPES:
        raise UnsupportedModelError(f"model_type {model_type!r} is not a Gemma 3 / Gemma 4 trunk ({HF_MODEL_TYPES})")
    generation = 3 if model_type.startswith("gemma3") else 4
    if model_type in ("gemma3", "gemma4"):  # multimodal: the text trunk only
        text = hf.get("text_config")
        if not isinstance(text, Mapping):
            raise UnsupportedModelError(f"config.json of model_type {model_type!r} lacks a 'text_config' object")
        return text, generation
    return hf, generation


def _rope_of(text: Mapping[str, Any], kind: LayerType, generation: int) -> tuple[float, RopeScaling | None]:
    """One layer type's RoPE from `rope_parameters[kind]` (transformers 5) or the older
    rope_theta / rope_local_base_freq / rope_scaling fields."""
    rope = text.get("rope_parameters")
    if isinstance(rope, Mapping) and isinstance(rope.get(kind.value), Mapping):
        view = {"rope_parameters": rope[kind.value], "max_position_embeddings": text.get("max_position_embeddings")}
    elif kind is LayerType.SLIDING:
        view = {"rope_theta": text.get("rope_local_base_freq", 10_000.0)}
    else:
        default = 1_000_000.0
        view = {"rope_theta": text.get("rope_theta", default), "rope_scaling": text.get("rope_scaling"),
                "max_position_embeddings": text.get("max_position_embeddings")}
        if generation == 4 and text.get("rope_scaling") is None:
            view["rope_scaling"] = {"rope_type": "proportional", "partial_rotary_factor": 0.25}
    try:
        return _rope_settings(view, proportional=True)
    except UnsupportedModelError as err:
        raise UnsupportedModelError(f"rope_parameters[{kind.value!r}]: {err}") from None


def config_from_hf(hf: Mapping[str, Any]) -> GemmaConfig:
    """Parse a gemma3_text / gemma4_text config.json (or the text_config of gemma3 / gemma4).
    Errors name the offending field."""
    text, generation = _text_config(hf)
    for field, supported in _UNSUPPORTED.items():
        value = text.get(field, supported)
        if value != supported and not (supported in (None, False) and not value):
            raise UnsupportedModelError(f"{field}={value!r} is not supported by the Gemma trunk (needs {supported!r})")
    try:
        num_layers = count(text["num_hidden_layers"])
        dim, num_heads = count(text["hidden_size"]), count(text["num_attention_heads"])
        head_dim = count(text.get("head_dim") or dim // num_heads)
        num_kv_heads = count(text.get("num_key_value_heads") or num_heads)
        layer_types = text.get("layer_types")
        if layer_types is None:  # HF's default: every sixth layer global
            pattern = count(text.get("sliding_window_pattern", 6))
            layer_types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                           for i in range(num_layers)]
        layer_types = list(layer_types)
        if len(layer_types) != num_layers:
            raise UnsupportedModelError(f"layer_types has {len(layer_types)} entries but num_hidden_layers is {num_layers}")
        if generation == 4:
            layer_types[-1] = "full_attention"  # as transformers forces it
        kinds = []
        for index, name in enumerate(layer_types):
            try:
                kinds.append(LayerType(name))
            except ValueError:
                raise UnsupportedModelError(
                    f"layer_types[{index}]={name!r} is not supported (only {[t.value for t in LayerType]})") from None
        k_eq_v = generation == 4 and flag(text.get("attention_k_eq_v", False), "attention_k_eq_v")
        full_head_dim, full_kv_heads = head_dim, num_kv_heads
        if generation == 4:
            overrides = text.get("per_layer_config")
            if isinstance(overrides, Mapping):
                # What transformers writes: the global layers' fields that differ from the top level
                # (empty when none does).
                seen = {}
                for layer, values in overrides.items():
                    index = int(layer) if isinstance(layer, str) and layer.isdigit() else layer
                    if not isinstance(index, int) or not 0 <= index < num_layers or kinds[index] is not LayerType.FULL:
                        raise UnsupportedModelError(
                            f"per_layer_config overrides layer {layer!r}; only global layers' heads may differ")
                    if not isinstance(values, Mapping) or set(values) - {"head_dim", "num_key_value_heads"}:
                        raise UnsupportedModelError(f"per_layer_config[{layer!r}]={values!r} is not supported "
                                                    "(only head_dim and num_key_value_heads may differ)")
                    seen[index] = (count(values.get("head_dim", head_dim)),
                                   count(values.get("num_key_value_heads", num_kv_heads)))
                if len(set(seen.values())) > 1:
                    raise UnsupportedModelError(f"per_layer_config gives global layers different shapes: {overrides}")
                if seen:
                    full_head_dim, full_kv_heads = next(iter(seen.values()))
            else:  # the constructor's keywords, before transformers resolves them
                full_head_dim = count(text.get("global_head_dim", 512))
                if k_eq_v and text.get("num_global_key_value_heads") is not None:
                    full_kv_heads = count(text["num_global_key_value_heads"])
        window = count(text.get("sliding_window") or 4096)
        specs = {}
        for kind, H, K in ((LayerType.SLIDING, head_dim, num_kv_heads), (LayerType.FULL, full_head_dim, full_kv_heads)):
            theta, scaling = _rope_of(text, kind, generation)
            specs[kind] = GemmaAttention(
                num_heads=num_heads, num_kv_heads=K, head_dim=H, rope_theta=theta, rope_scaling=scaling,
                rotary_dim=H, window=window if kind is LayerType.SLIDING else None,
                values_from_keys=k_eq_v and kind is LayerType.FULL)
        per_layer_dim = count(text.get("hidden_size_per_layer_input") or 0) if generation == 4 else 0
        cap = text.get("final_logit_softcapping")
        eos = text.get("eos_token_id", hf.get("eos_token_id"))
        bos = text.get("bos_token_id", hf.get("bos_token_id"))
        query_scale = 1.0 if generation == 4 else real(text.get("query_pre_attn_scalar", head_dim)) ** -0.5
        return GemmaConfig(
            generation=generation,
            vocab_size=count(text["vocab_size"]),
            dim=dim,
            num_layers=num_layers,
            layer_types=tuple(kinds),
            ffn_dim=count(text["intermediate_size"]),
            sliding=specs[LayerType.SLIDING],
            full=specs[LayerType.FULL],
            query_scale=query_scale,
            final_logit_softcap=None if cap is None else real(cap),
            per_layer_dim=per_layer_dim,
            per_layer_vocab=count(text.get("vocab_size_per_layer_input") or 0) if per_layer_dim else 0,
            num_kv_shared_layers=count(text.get("num_kv_shared_layers") or 0) if generation == 4 else 0,
            norm_eps=real(text.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=count(text.get("max_position_embeddings", 8192)),
            tie_embeddings=flag(hf.get("tie_word_embeddings", text.get("tie_word_embeddings", True)),
                                "tie_word_embeddings"),
            bos_token_id=None if bos is None else count(bos),
            eos_token_ids=eos_ids(eos),
        )
    except KeyError as missing:
        raise UnsupportedModelError(f"config.json lacks required field {missing}") from None


def _add_one(stored: np.ndarray) -> np.ndarray:
    return stored + 1.0  # Gemma 3's zero-centred norm -> its multiplier


def hf_tensors(cfg: GemmaConfig, prefix: str) -> GemmaParams:
    """The params tree of HF tensor names under `prefix`, with transforms (Gemma 3's norms + 1)."""
    def source(key: str, index: int | None) -> TensorSource:
        transform = _add_one if cfg.generation == 3 and key in _NORMS else None
        if key == "lm_head":
            return TensorSource("lm_head.weight", note=" (tie_word_embeddings is false)")
        if index is None:
            return TensorSource(prefix + _HF_TOP[key], transform)
        return TensorSource(f"{prefix}layers.{index}.{_HF_LAYER[key]}", transform,
                            f" (layer {index} is {cfg.layer_types[index].value})")

    return params_from(cfg, source)


_GGUF_TOP = {"embed": "token_embd.weight", "final_norm": "output_norm.weight", "lm_head": "output.weight"}
_GGUF_LAYER = {
    "attn_norm": "attn_norm.weight", "q_proj": "attn_q.weight", "k_proj": "attn_k.weight", "v_proj": "attn_v.weight",
    "o_proj": "attn_output.weight", "q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight",
    "post_attn_norm": "post_attention_norm.weight", "mlp_norm": "ffn_norm.weight", "gate_proj": "ffn_gate.weight",
    "up_proj": "ffn_up.weight", "down_proj": "ffn_down.weight", "post_mlp_norm": "post_ffw_norm.weight",
}
GGUF_ARCHITECTURES = ("gemma3",)
# llama.cpp's gemma3 (src/llama-model.cpp): every sixth layer global, local layers at theta 10k.
_GGUF_SWA_PATTERN = 6
_GGUF_LOCAL_THETA = 10_000.0


def gguf_tensors(cfg: GemmaConfig, arch: str) -> GemmaParams:
    """llama.cpp's gemma3 tensor names (norms already stored as 1 + w; Q/K rows not permuted)."""
    del arch

    def source(key: str, index: int | None) -> TensorSource:
        if index is None:
            return TensorSource(_GGUF_TOP[key])
        if key not in _GGUF_LAYER:
            raise UnsupportedModelError(f"llama.cpp's gemma3 has no tensor for {key!r}")
        return TensorSource(f"blk.{index}.{_GGUF_LAYER[key]}")

    return params_from(cfg, source)


def config_from_gguf(meta: Mapping[str, Any], tensor_shapes: Mapping[str, tuple[int, ...]], source: str) -> GemmaConfig:
    """GemmaConfig from a llama.cpp gemma3 GGUF's metadata, with llama.cpp's fixed choices (the
    sliding pattern, the local theta, query_pre_attn_scalar) written where the file has no key."""
    arch = str(meta.get("general.architecture", ""))
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(f"GGUF architecture {arch!r} in {source} is not a Gemma trunk")

    def get(key: str, default: Any = None) -> Any:
        full = f"{arch}.{key}"
        if full in meta:
            return meta[full]
        if default is None:
            raise CheckpointError(f"GGUF file {source} lacks required metadata key {full!r}")
        return default

    if _GGUF_TOP["embed"] not in tensor_shapes:
        raise CheckpointError(f"GGUF file {source} lacks tensor {_GGUF_TOP['embed']!r}")
    num_layers = count(get("block_count"))
    dim = count(get("embedding_length"))
    num_heads = count(get("attention.head_count"))
    num_kv_heads = count(get("attention.head_count_kv", num_heads))
    head_dim = count(get("attention.key_length", dim // num_heads))
    if count(get("attention.value_length", head_dim)) != head_dim:
        raise UnsupportedModelError(f"{source}: attention.value_length differs from key_length {head_dim}")
    scaling_type = meta.get(f"{arch}.rope.scaling.type", "none")
    global_scaling = None
    if scaling_type not in ("none", ""):
        if scaling_type != "linear":
            raise UnsupportedModelError(f"GGUF rope scaling type {scaling_type!r} in {source} is not supported")
        _, global_scaling = _rope_settings({"rope_scaling": {"rope_type": "linear",
                                                             "factor": real(get("rope.scaling.factor"))}})
    kinds = tuple(LayerType.FULL if (i + 1) % _GGUF_SWA_PATTERN == 0 else LayerType.SLIDING for i in range(num_layers))
    # llama.cpp scales q.k by 1/sqrt(head_dim), except Gemma 3 27B (62 layers): 1/sqrt(D / N).
    query_scale = (dim / num_heads) ** -0.5 if num_layers == 62 else head_dim ** -0.5
    eos = gguf_eos_ids(meta)
    tokens = meta.get("tokenizer.ggml.tokens")
    if isinstance(tokens, list) and "<end_of_turn>" in tokens and tokens.index("<end_of_turn>") not in eos:
        eos.append(tokens.index("<end_of_turn>"))  # what llama.cpp ends a chat turn on
    bos = meta.get("tokenizer.ggml.bos_token_id")
    common = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, rotary_dim=head_dim)
    return GemmaConfig(
        generation=3,
        vocab_size=gguf_vocab_size(tensor_shapes, _GGUF_TOP["embed"], dim, source),
        dim=dim,
        num_layers=num_layers,
        layer_types=kinds,
        ffn_dim=count(get("feed_forward_length")),
        sliding=GemmaAttention(**common, rope_theta=_GGUF_LOCAL_THETA,
                               window=count(get("attention.sliding_window"))),
        full=GemmaAttention(**common, rope_theta=real(get("rope.freq_base", 1_000_000.0)), rope_scaling=global_scaling),
        query_scale=query_scale,
        final_logit_softcap=None if f"{arch}.final_logit_softcapping" not in meta
        else real(meta[f"{arch}.final_logit_softcapping"]),
        norm_eps=real(get("attention.layer_norm_rms_epsilon", 1e-6)),
        max_position_embeddings=count(get("context_length", 8192)),
        tie_embeddings=_GGUF_TOP["lm_head"] not in tensor_shapes,
        bos_token_id=None if bos is None else count(bos),
        eos_token_ids=tuple(eos),
    )


def config_to_dict(cfg: GemmaConfig) -> dict[str, Any]:
    return to_json_dict(cfg)


def config_from_dict(data: Mapping[str, Any]) -> GemmaConfig:
    """Inverse of config_to_dict (the per-type attention dicts rebuilt by GemmaConfig itself)."""
    return from_json_dict(GemmaConfig, data)



def _check_tree(cfg: GemmaConfig, depth: int, whose: str) -> None:
    """A sliding-window layer sees a tree node's ancestors only inside its window
    (`flash_decode.mask_visible` leaves them to the tree mask): the tree must be shallower."""
    window = cfg.sliding.window
    if window is not None and depth >= window:
        raise InvalidRequestError(f"a draft tree of depth {depth} reaches past the {whose}'s sliding window of "
                                  f"{window} positions; use a depth below {window}")

FAMILY = Family(
    name="gemma",
    config_class=GemmaConfig,
    params_class=GemmaParams,
    forward=forward,
    create_cache=KVCache.create,  # one buffer per `kv_layout` entry
    hf_model_types=HF_MODEL_TYPES,
    config_from_hf=config_from_hf,
    hf_prefixes=_HF_PREFIXES,
    hf_embed=_HF_TOP["embed"],
    hf_tensors=hf_tensors,
    architecture=lambda cfg: f"gemma{cfg.generation}",
    param_shapes=param_shapes,
    config_to_dict=config_to_dict,
    config_from_dict=config_from_dict,
    gguf_architectures=GGUF_ARCHITECTURES,
    config_from_gguf=config_from_gguf,
    gguf_tensors=gguf_tensors,
    check_tree=_check_tree,
    truncated=GemmaConfig.truncated,
)
