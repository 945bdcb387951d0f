"""The Llama-family trunk: Llama 3, SmolLM2, Mistral, Qwen2 (qkv bias), Qwen3 (QK-norm).

A pure function `forward(params, cfg, tokens, cache) -> (logits, hiddens, cache)`, a stack of
`jaxspec.models.layers.decoder_layer` (RMSNorm, attention, SwiGLU) between the embedding and the
logits head; this module holds the family's parameter layout and its forward.

Layout, and why: weights stay `[out, in]` as HF and GGUF store them, and activations inside the
trunk are feature-major, `[D, B*T]`, so every projection is `W @ h`. On XLA CPU that is the
spelling whose cost grows slowest with T (T = 8 costs ~1.8x T = 1, against ~3.3x for `x @ W`;
measured on this trunk), and speculative verification is a T = k+1 forward. Layers are a Python list
(unrolled under jit): slicing a stacked `[L, ...]` weight per layer measured 9x slower here.

Params pytree (float32 unless a loader says otherwise):
    embed [V, D]; final_norm [D]; lm_head [V, D] (absent when cfg.tie_embeddings)
    layers: list of L dicts
        attn_norm [D]; q_proj [N*H, D]; k_proj [K*H, D]; v_proj [K*H, D]; o_proj [D, N*H]
        q_bias [N*H]; k_bias [K*H]; v_bias [K*H]   (cfg.attention_bias)
        q_norm [H]; k_norm [H]                       (cfg.qk_norm)
        mlp_norm [D]; gate_proj [F, D]; up_proj [F, D]; down_proj [D, F]
Q/K rows follow HF's rotate-half RoPE convention (GGUF loaders undo llama.cpp's permutation).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxspec.cache import KVCache
from jaxspec.config import ModelConfig
from jaxspec.models.layers import decoder_layer, logits_head, output_head, rms_norm, rope_tables
from jaxspec.pallas.flash_decode import Attention

Params = dict[str, Any]

# Logical axis names per parameter (DESIGN.md contract 8): `heads` and `ffn` shard tensor-parallel.
LAYER_AXES = {
    "attn_norm": ("embed",),
    "q_proj": ("heads", "embed"),
    "k_proj": ("kv_heads", "embed"),
    "v_proj": ("kv_heads", "embed"),
    "o_proj": ("embed", "heads"),
    "q_bias": ("heads",),
    "k_bias": ("kv_heads",),
    "v_bias": ("kv_heads",),
    "q_norm": (None,),
    "k_norm": (None,),
    "mlp_norm": ("embed",),
    "gate_proj": ("ffn", "embed"),
    "up_proj": ("ffn", "embed"),
    "down_proj": ("embed", "ffn"),
}
TOP_AXES = {"embed": ("vocab", "embed"), "final_norm": ("embed",), "lm_head": ("vocab", "embed")}


def param_axes(params: Params) -> Params:
    """The params pytree with each array replaced by its tuple of logical axis names."""
    axes = {name: TOP_AXES[name] for name in params if name != "layers"}
    axes["layers"] = [{name: LAYER_AXES[name] for name in layer} for layer in params["layers"]]
    return axes


def init_params(cfg: ModelConfig, key: jax.Array, scale: float = 0.02) -> Params:
    """Random params of the right shapes (tests and benchmarks of untrained shapes)."""
    D, N, K, H, F, V = cfg.dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.ffn_dim, cfg.vocab_size
    keys = iter(jax.random.split(key, 8 * cfg.num_layers + 2))

    def normal(*shape):
        return scale * jax.random.normal(next(keys), shape, jnp.float32)

    layers = []
    for _ in range(cfg.num_layers):
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
    params = {"embed": normal(V, D), "layers": layers, "final_norm": jnp.ones((D,))}
    if not cfg.tie_embeddings:
        params["lm_head"] = normal(V, D)
    return params


def forward(
    params: Params,
    cfg: ModelConfig,
    tokens: jax.Array,
    cache: KVCache,
    *,
    positions: jax.Array | None = None,
    logit_indices: jax.Array | None = None,
    hidden_layers: tuple[int, ...] = (),
    attention: Attention | str = Attention.AUTO,
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
    attention: "auto" (the Pallas kernel on GPU, the XLA reference elsewhere), "reference",
        "pallas", or "interpret" (the kernel in the Pallas interpreter, for tests). The cache's
        own KV format (`KVCache.create(..., kv_format=...)`) decides how K/V are stored and read.

    Returns logits float32[B, P, V], the requested hiddens, and the cache.
    """
    batch, steps = tokens.shape
    offsets = cache.length
    if positions is None:
        positions = offsets[:, None] + jnp.arange(steps, dtype=jnp.int32)[None, :]
    cos, sin = rope_tables(cfg, positions)

    h = jnp.take(params["embed"], tokens.reshape(-1), axis=0).T  # [D, B*T]
    new_keys, new_values, hiddens = [], [], {-1: h}
    for index, layer in enumerate(params["layers"]):
        with jax.named_scope(f"layer_{index}"):
            h, k_buf, v_buf = decoder_layer(layer, cfg, h, cos, sin, cache.keys[index], cache.values[index],
                                            offsets, batch, steps, qk_norm=cfg.qk_norm, attention=attention)
        new_keys.append(k_buf)
        new_values.append(v_buf)
        if index in hidden_layers:
            hiddens[index] = h

    h = rms_norm(h, params["final_norm"], cfg.norm_eps)
    hiddens[cfg.num_layers] = h
    logits = logits_head(output_head(params, tied=cfg.tie_embeddings), h, batch, steps, logit_indices)  # [B, P, V]
    hidden_out = tuple(hiddens[i].reshape(cfg.dim, batch, steps).transpose(1, 2, 0) for i in hidden_layers)
    cache = cache.replace(keys=tuple(new_keys), values=tuple(new_values))
    return logits, hidden_out, cache
