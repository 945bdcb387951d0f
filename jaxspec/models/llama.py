"""The Llama-family trunk: Llama 3, SmolLM2, Mistral, Qwen2 (qkv bias), Qwen3 (QK-norm).

A pure function `forward(params, cfg, tokens, cache) -> (logits, hiddens, cache)`, a stack of
`jaxspec.models.layers.decoder_layer` (RMSNorm, attention, SwiGLU) between the embedding and the
logits head; this module holds the family's parameter layout and its forward.

Layout, and why: weights stay `[out, in]` as HF and GGUF store them, and activations inside the
trunk are feature-major, `[D, B*T]`, so every projection is `W @ h`. On XLA CPU that is the
spelling whose cost grows slowest with T (against `x @ W`), and speculative verification is a
T = k+1 forward. Layers are a tuple of per-layer params (unrolled under jit): slicing a stacked
`[L, ...]` weight per layer is far slower on XLA CPU. Both measured on this trunk:
bench/RESULTS.md, "Measured by hand (no bench script)".

Params: `LlamaParams` (float32 unless a loader says otherwise), each field's shape and logical
axes declared on the type (jaxspec.models.params); a layer is `layers.LlamaLayer`. `params_from`
builds the tree for a config from any per-leaf function, so init, shapes and checkpoint tensor
names share one structure.
Q/K rows follow HF's rotate-half RoPE convention (the GGUF tensor map undoes llama.cpp's permutation).

`FAMILY`, at the end of this module, describes the layout to the loaders (jaxspec.models.family):
shapes, HF and GGUF tensor names, and the GGUF config parse.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxspec.cache import KVCache
from jaxspec.config import (
    HF_MODEL_TYPES,
    Architecture,
    ModelConfig,
    config_from_dict,
    config_from_hf,
    config_to_dict,
    count,
    gguf_eos_ids,
    gguf_vocab_size,
    real,
    resolve_rotary_dim,
)
from jaxspec.errors import CheckpointError, UnsupportedModelError
from jaxspec.models.family import Family, TensorSource
from jaxspec.models.layers import (
    AttentionParams,
    LlamaLayer,
    MlpParams,
    decoder_layer,
    logits_head,
    output_head,
    rms_norm,
    rope_tables,
)
from jaxspec.models.quant import embedding_rows
from jaxspec.models.params import LeafFn, param, trunk_params
from jaxspec.pallas.flash_decode import Attention, TreeMask


@struct.dataclass
class LlamaParams:
    """A Llama-family trunk's params."""

    embed: jax.Array = param(axes=("vocab", "embed"), linear=True)  # [V, D]
    layers: tuple[LlamaLayer, ...]  # L layers, unrolled under jit (module docstring)
    final_norm: jax.Array = param(axes=("embed",))  # [D]
    lm_head: jax.Array | None = param(axes=("vocab", "embed"), linear=True)  # [V, D]; None when cfg.tie_embeddings


def layer_from(cfg: ModelConfig, leaf: Callable[[str], Any]) -> LlamaLayer:
    """One layer of `cfg`'s kind, each param `leaf(name)` (names: `layer_shapes`' keys, asked in
    that order); the bias and QK-norm fields are None unless the config has them."""

    def optional(name: str, present: bool) -> Any:
        return leaf(name) if present else None

    attn_norm = leaf("attn_norm")
    attention = AttentionParams(
        q_proj=leaf("q_proj"), k_proj=leaf("k_proj"), v_proj=leaf("v_proj"), o_proj=leaf("o_proj"),
        q_bias=optional("q_bias", cfg.attention_bias), k_bias=optional("k_bias", cfg.attention_bias),
        v_bias=optional("v_bias", cfg.attention_bias),
        q_norm=optional("q_norm", cfg.qk_norm), k_norm=optional("k_norm", cfg.qk_norm))
    mlp_norm = leaf("mlp_norm")
    mlp = MlpParams(gate_proj=leaf("gate_proj"), up_proj=leaf("up_proj"), down_proj=leaf("down_proj"))
    return LlamaLayer(attn_norm=attn_norm, attention=attention, mlp_norm=mlp_norm, mlp=mlp)


def params_from(cfg: ModelConfig, leaf: LeafFn) -> LlamaParams:
    """The params tree of `cfg`, each param `leaf(name, layer index)` (index None at the top:
    embed, final_norm, lm_head), asked in checkpoint order: embed, layer by layer, the rest."""
    return trunk_params(LlamaParams, cfg, leaf, lambda index, layer_leaf: layer_from(cfg, layer_leaf))


def init_params(cfg: ModelConfig, key: jax.Array, scale: float = 0.02) -> LlamaParams:
    """Random params of the right shapes (tests and benchmarks of untrained shapes)."""
    D, N, K, H, F, V = cfg.dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.ffn_dim, cfg.vocab_size
    # Draws per layer: 7 matrices, 3 biases, 2 QK-norms. At least 8 keys per layer, as ever, so
    # a plain config keeps the params it always had (split's keys depend on their count).
    draws_per_layer = 7 + 3 * cfg.attention_bias + 2 * cfg.qk_norm
    keys = iter(jax.random.split(key, max(8, draws_per_layer) * cfg.num_layers + 2))

    def normal(*shape):
        return scale * jax.random.normal(next(keys), shape, jnp.float32)

    layers = []
    for _ in range(cfg.num_layers):  # drawn in this order whatever the params' field order
        layer = {
            "attn_norm": jnp.ones((D,)), "q_proj": normal(N * H, D), "k_proj": normal(K * H, D),
            "v_proj": normal(K * H, D), "o_proj": normal(D, N * H), "mlp_norm": jnp.ones((D,)),
            "gate_proj": normal(F, D), "up_proj": normal(F, D), "down_proj": normal(D, F),
        }
        if cfg.attention_bias:
            layer |= {"q_bias": normal(N * H), "k_bias": normal(K * H), "v_bias": normal(K * H)}
        if cfg.qk_norm:
            layer |= {"q_norm": 1.0 + normal(H), "k_norm": 1.0 + normal(H)}
        layers.append(layer)
    top = {"embed": normal(V, D), "final_norm": jnp.ones((D,))}
    if not cfg.tie_embeddings:
        top["lm_head"] = normal(V, D)
    return params_from(cfg, lambda name, index: top[name] if index is None else layers[index][name])


def forward(
    params: LlamaParams,
    cfg: ModelConfig,
    tokens: jax.Array,
    cache: KVCache,
    *,
    positions: jax.Array | None = None,
    logit_indices: jax.Array | None = None,
    hidden_layers: tuple[int, ...] = (),
    attention: Attention | str = Attention.AUTO,
    tree_mask: TreeMask | None = None,
) -> tuple[jax.Array, tuple[jax.Array, ...], KVCache]:
    """Run T new tokens per row through the trunk.

    tokens: int32[B, T], written to the cache at slots `cache.length[b] + t`. The cache comes back
    with those K/V written but `length` unchanged: the caller commits (or not) by setting lengths.
    positions: int32[B, T] RoPE positions, default the slots.
    logit_indices: int32[B, P] which of the T positions need logits (prefill needs one per row);
        default all T.
    hidden_layers: residual stream after these layers (0-based; HF's hidden_states[i + 1]; -1 is
        the embedding output, the stream entering layer 0; L = cfg.num_layers is the stream
        after the final norm, HF's hidden_states[-1] and what an MTP head reads) is returned in
        the order asked, each [B, T, D].
    attention: "auto" (the XLA reference; on a GPU the kernel where jaxspec.pallas.tuning's table
        has measured a win: `flash_decode.attend`), "reference",
        "pallas", or "interpret" (the kernel in the Pallas interpreter, for tests). The cache's
        own KV format (`KVCache.create(..., kv_format=...)`) decides how K/V are stored and read.
    tree_mask: a draft tree's ancestor mask over the T new tokens (jaxspec.pallas.flash_decode.TreeMask)
        in place of the causal rule; pass positions too (each node's RoPE position is its depth).

    Returns logits float32[B, P, V], the requested hiddens, and the cache.
    """
    batch, steps = tokens.shape
    offsets = cache.length
    if positions is None:
        positions = offsets[:, None] + jnp.arange(steps, dtype=jnp.int32)[None, :]
    cos, sin = rope_tables(cfg, positions)

    h = embedding_rows(params.embed, tokens.reshape(-1)).T  # [D, B*T]
    new_keys, new_values, hiddens = [], [], {-1: h}
    for index, layer in enumerate(params.layers):
        with jax.named_scope(f"layer_{index}"):
            h, k_buf, v_buf = decoder_layer(layer, cfg, h, cos, sin, cache.keys[index], cache.values[index],
                                            offsets, batch, steps, qk_norm=cfg.qk_norm, attention=attention,
                                            tree_mask=tree_mask)
        new_keys.append(k_buf)
        new_values.append(v_buf)
        if index in hidden_layers:
            hiddens[index] = h

    h = rms_norm(h, params.final_norm, cfg.norm_eps)
    hiddens[cfg.num_layers] = h
    logits = logits_head(output_head(params.embed, params.lm_head), h, batch, steps, logit_indices)  # [B, P, V]
    hidden_out = tuple(hiddens[i].reshape(cfg.dim, batch, steps).transpose(1, 2, 0) for i in hidden_layers)
    cache = cache.replace(keys=tuple(new_keys), values=tuple(new_values))
    return logits, hidden_out, cache


# ----------------------------------------------------------------------------------------------
# The family descriptor: shapes, HF and GGUF tensor names, GGUF config
# ----------------------------------------------------------------------------------------------


def layer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of one layer's params, in a fixed key order (also an MTP head's block)."""
    D, F, H = cfg.dim, cfg.ffn_dim, cfg.head_dim
    q_rows, kv_rows = cfg.num_heads * H, cfg.num_kv_heads * H
    shapes = {"attn_norm": (D,), "q_proj": (q_rows, D), "k_proj": (kv_rows, D), "v_proj": (kv_rows, D),
              "o_proj": (D, q_rows)}
    if cfg.attention_bias:
        shapes |= {"q_bias": (q_rows,), "k_bias": (kv_rows,), "v_bias": (kv_rows,)}
    if cfg.qk_norm:
        shapes |= {"q_norm": (H,), "k_norm": (H,)}
    shapes |= {"mlp_norm": (D,), "gate_proj": (F, D), "up_proj": (F, D), "down_proj": (D, F)}
    return shapes


def param_shapes(cfg: ModelConfig) -> LlamaParams:
    """The params tree with shape tuples as leaves (what every loader must produce)."""
    top = {"embed": (cfg.vocab_size, cfg.dim), "final_norm": (cfg.dim,), "lm_head": (cfg.vocab_size, cfg.dim)}
    layer = layer_shapes(cfg)
    return params_from(cfg, lambda name, index: top[name] if index is None else layer[name])


# params key -> tensor name after the trunk's prefix ("model."); lm_head is never prefixed.
HF_NAMES = {
    "embed": "embed_tokens.weight", "final_norm": "norm.weight", "lm_head": "lm_head.weight",
    "attn_norm": "input_layernorm.weight", "q_proj": "self_attn.q_proj.weight",
    "k_proj": "self_attn.k_proj.weight", "v_proj": "self_attn.v_proj.weight",
    "o_proj": "self_attn.o_proj.weight", "q_bias": "self_attn.q_proj.bias", "k_bias": "self_attn.k_proj.bias",
    "v_bias": "self_attn.v_proj.bias", "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight",
    "mlp_norm": "post_attention_layernorm.weight", "gate_proj": "mlp.gate_proj.weight",
    "up_proj": "mlp.up_proj.weight", "down_proj": "mlp.down_proj.weight",
}
# params key -> llama.cpp's name (top level as is, layer keys under "blk.{i}.").
GGUF_NAMES = {
    "embed": "token_embd.weight", "final_norm": "output_norm.weight", "lm_head": "output.weight",
    "attn_norm": "attn_norm.weight", "q_proj": "attn_q.weight", "k_proj": "attn_k.weight",
    "v_proj": "attn_v.weight", "o_proj": "attn_output.weight", "q_bias": "attn_q.bias", "k_bias": "attn_k.bias",
    "v_bias": "attn_v.bias", "q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight",
    "mlp_norm": "ffn_norm.weight", "gate_proj": "ffn_gate.weight", "up_proj": "ffn_up.weight",
    "down_proj": "ffn_down.weight",
}
GGUF_ARCHITECTURES = {"llama": Architecture.LLAMA, "mistral": Architecture.MISTRAL, "qwen2": Architecture.QWEN2,
                      "qwen3": Architecture.QWEN3}
# llama.cpp's converter (LlamaModel.permute) interleaves Q/K rows only for these.
PERMUTED_GGUF_ARCHITECTURES = frozenset({"llama", "mistral"})


def hf_tensors(cfg: ModelConfig, prefix: str) -> LlamaParams:
    """The params tree of HF tensor names under `prefix` ("model." or "" for a bare trunk)."""

    def source(key: str, index: int | None) -> TensorSource:
        if index is not None:
            return TensorSource(f"{prefix}layers.{index}.{HF_NAMES[key]}")
        return TensorSource(HF_NAMES[key] if key == "lm_head" else prefix + HF_NAMES[key])

    return params_from(cfg, source)


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's LlamaModel.permute, restoring HF's rotate-half row order.

    The converter maps rows [n, 2, H/2] -> [n, H/2, 2] (interleaved RoPE pairs); we map back.
    Works for weights [n*H, D] and biases [n*H].
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(cfg: ModelConfig, arch: str) -> LlamaParams:
    """The params tree of GGUF tensor names for a file of `general.architecture` `arch`."""
    permuted = arch in PERMUTED_GGUF_ARCHITECTURES
    heads = {"q_proj": cfg.num_heads, "q_bias": cfg.num_heads, "k_proj": cfg.num_kv_heads, "k_bias": cfg.num_kv_heads}

    def source(key: str, index: int | None) -> TensorSource:
        name = GGUF_NAMES[key] if index is None else f"blk.{index}.{GGUF_NAMES[key]}"
        if permuted and key in heads:
            return TensorSource(name, functools.partial(unpermute_rows, n_head=heads[key]))
        return TensorSource(name)

    return params_from(cfg, source)


def _uniform(value: Any, key: str, source: str) -> int:
    """Per-layer GGUF arrays (e.g. head_count_kv) are supported only when all equal."""
    if isinstance(value, list):
        if not value or len(set(value)) != 1:
            raise UnsupportedModelError(f"{key} varies by layer in {source}: {value}")
        value = value[0]
    return count(value)


def config_from_gguf(meta: Mapping[str, Any], tensor_shapes: Mapping[str, tuple[int, ...]],
                     source: str) -> ModelConfig:
    """ModelConfig from GGUF metadata (`{arch}.*` and `tokenizer.ggml.*` keys) and tensor shapes."""
    arch = str(meta.get("general.architecture", ""))
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(f"GGUF architecture {arch!r} in {source} is not a Llama-family trunk")

    def get(key: str, default: Any = None) -> Any:
        full = f"{arch}.{key}"
        if full in meta:
            return meta[full]
        if default is None:
            raise CheckpointError(f"GGUF file {source} lacks required metadata key {full!r}")
        return default

    if "rope_freqs.weight" in tensor_shapes:
        raise UnsupportedModelError(
            f"{source} carries rope_freqs.weight (Llama 3.1 RoPE scaling baked into a tensor); "
            "load the HF checkpoint instead")
    scaling_type = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling_type not in ("none", ""):
        raise UnsupportedModelError(f"GGUF rope scaling type {scaling_type!r} in {source} is not supported")
    if GGUF_NAMES["embed"] not in tensor_shapes:
        raise CheckpointError(f"GGUF file {source} lacks tensor {GGUF_NAMES['embed']!r}")

    dim = count(get("embedding_length"))
    num_heads = _uniform(get("attention.head_count"), f"{arch}.attention.head_count", source)
    num_kv_heads = _uniform(get("attention.head_count_kv", num_heads), f"{arch}.attention.head_count_kv", source)
    head_dim = count(get("attention.key_length", dim // num_heads))
    value_dim = count(get("attention.value_length", head_dim))
    if value_dim != head_dim:
        raise UnsupportedModelError(f"{source}: value_length {value_dim} != key_length {head_dim}")
    rope_width = meta.get(f"{arch}.rope.dimension_count")
    context = count(get("context_length", 2048))
    window = meta.get(f"{arch}.attention.sliding_window")
    if window:  # full attention up to the window, as config_from_hf does for Mistral
        context = min(context, count(window))
    eos_ids = gguf_eos_ids(meta)
    bos = meta.get("tokenizer.ggml.bos_token_id")
    architecture = GGUF_ARCHITECTURES[arch]
    return ModelConfig(
        architecture=architecture,
        # The embedding's rows are the vocabulary the params serve (the token list may be shorter).
        vocab_size=gguf_vocab_size(tensor_shapes, GGUF_NAMES["embed"], dim, source),
        dim=dim,
        num_layers=count(get("block_count")),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        ffn_dim=_uniform(get("feed_forward_length"), f"{arch}.feed_forward_length", source),
        rope_theta=real(get("rope.freq_base", 10000.0)),
        rotary_dim=resolve_rotary_dim({} if rope_width is None else {"rotary_dim": rope_width}, head_dim),
        norm_eps=real(get("attention.layer_norm_rms_epsilon", 1e-6)),
        max_position_embeddings=context,
        tie_embeddings=GGUF_NAMES["lm_head"] not in tensor_shapes,
        attention_bias=f"blk.0.{GGUF_NAMES['q_bias']}" in tensor_shapes,
        qk_norm=architecture is Architecture.QWEN3,
        bos_token_id=None if bos is None else count(bos),
        eos_token_ids=tuple(eos_ids),
    )


FAMILY = Family(
    name="llama",
    config_class=ModelConfig,
    params_class=LlamaParams,
    forward=forward,
    create_cache=KVCache.create,
    hf_model_types=tuple(HF_MODEL_TYPES),
    config_from_hf=config_from_hf,
    hf_prefixes=("model.", ""),
    hf_embed=HF_NAMES["embed"],
    hf_tensors=hf_tensors,
    architecture=lambda cfg: cfg.architecture.value,
    param_shapes=param_shapes,
    config_to_dict=config_to_dict,
    config_from_dict=config_from_dict,
    gguf_architectures=tuple(GGUF_ARCHITECTURES),
    config_from_gguf=config_from_gguf,
    gguf_tensors=gguf_tensors,
)
