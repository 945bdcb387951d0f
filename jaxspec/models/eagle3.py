"""The EAGLE-3 draft head (Li et al. 2025), as vLLM's `llama_eagle3.py` runs it.

    g      = fc(concat(aux_1, aux_2, aux_3))             3D -> D, no bias (target features)
    step:  e      = target_embedding(token)
           cat    = [RMSNorm_in(e); RMSNorm_hidden(g)]     2D
           x1     = g + o_proj(attention(q/k/v_proj(cat)))  one Llama layer reading 2D; the
                                                           residual is the pre-norm g
           g_next = x1 + MLP(RMSNorm_post(x1))             SwiGLU
           logits = lm_head(RMSNorm(g_next))               over the draft vocabulary
           token  = draft_id + d2t[draft_id]               back to the target's vocabulary
    recurrence: the next draft step's g is g_next.

Which target layers feed `aux` (the convention, pinned from the sources): vLLM and the EAGLE
repo capture the residual stream *entering* layers (2, L // 2, L - 3), and a checkpoint's
`eagle_config.eagle_aux_hidden_state_layer_ids` is read in that same input-of-layer spelling.
The CUDA seed's (1, 15, 28) for L = 32 names the same tensors as outputs of layers 1, 15, 28.
jaxspec stores ids in the input-of-layer spelling (`aux_layer_ids`) and asks the trunk for the
outputs of layers `id - 1` (-1 being the embedding output), see `target_hidden_layers`.

Alignment: the head pairs the target feature at position p with the embedding of the token at
p + 1 and runs at RoPE position p, so its KV slot p holds (feature p, token p + 1).

Params: `Eagle3Params` (float32, weights [out, in]; d2t int32), built from per-tensor values
by `params_from` under the flat names of the EAGLE-3 checkpoint format (`TENSOR_NAMES`).
The token embedding is the target's, passed in beside these params.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec.cache import KVCache
from jaxspec.config import (ModelConfig, RopeScaling, _rope_settings, check_sizes_and_numerics, count, real,
                            resolve_rotary_dim)
from jaxspec.errors import CheckpointError, UnsupportedModelError
from jaxspec.models.layers import (
    AttentionParams,
    MlpParams,
    logits_head,
    rms_norm,
    rope_tables,
    self_attention,
    swiglu,
    unfuse_projections,
)
from jaxspec.models.quant import Weight, embedding_rows, matmul, weight_leaves
from jaxspec.models.params import param
from jaxspec.pallas.flash_decode import TreeMask


@struct.dataclass
class Eagle3Params:
    """An EAGLE-3 head: one decoder layer over [embedding; target features], its norm and lm_head."""

    fc: jax.Array = param(axes=("embed", None), linear=True)  # [D, 3D]: three target features -> one
    input_layernorm: jax.Array = param(axes=("embed",))  # [D], on the token embedding
    hidden_norm: jax.Array = param(axes=("embed",))  # [D], on the features
    attention: AttentionParams  # q_proj [N*H, 2D]; k_proj, v_proj [K*H, 2D]; o_proj [D, N*H]
    post_attention_layernorm: jax.Array = param(axes=("embed",))  # [D]
    mlp: MlpParams  # gate_proj, up_proj [F, D]; down_proj [D, F]
    norm: jax.Array = param(axes=("embed",))  # [D]
    lm_head: jax.Array = param(axes=("vocab", "embed"), linear=True)  # [Vd, D], over the draft vocabulary
    # int32[Vd]: target id - draft id; None in the trainable copy jaxspec.train optimises
    d2t: jax.Array | None = param(axes=("vocab",))


# The flat names `params_from` asks for, in checkpoint order (d2t last, as it is checked last).
TENSOR_NAMES = ("fc", "input_layernorm", "hidden_norm", "q_proj", "k_proj", "v_proj", "o_proj",
                "post_attention_layernorm", "gate_proj", "up_proj", "down_proj", "norm", "lm_head", "d2t")


def params_from(leaf: Callable[[str], Any]) -> Eagle3Params:
    """The head's params, each `leaf(name)` for a name of TENSOR_NAMES."""
    fc, input_layernorm, hidden_norm = leaf("fc"), leaf("input_layernorm"), leaf("hidden_norm")
    attention = AttentionParams(q_proj=leaf("q_proj"), k_proj=leaf("k_proj"), v_proj=leaf("v_proj"),
                                o_proj=leaf("o_proj"), q_bias=None, k_bias=None, v_bias=None, q_norm=None,
                                k_norm=None)
    post_attention_layernorm = leaf("post_attention_layernorm")
    mlp = MlpParams(gate_proj=leaf("gate_proj"), up_proj=leaf("up_proj"), down_proj=leaf("down_proj"))
    return Eagle3Params(fc=fc, input_layernorm=input_layernorm, hidden_norm=hidden_norm, attention=attention,
                        post_attention_layernorm=post_attention_layernorm, mlp=mlp, norm=leaf("norm"),
                        lm_head=leaf("lm_head"), d2t=leaf("d2t"))


def named_leaves(params: Eagle3Params) -> dict[str, jax.Array]:
    """The head's weights by their TENSOR_NAMES name (the inverse of `params_from`; fused
    projections split back, an int8 weight one leaf)."""
    names = jax.tree.leaves(params_from(lambda name: name))
    return dict(zip(names, weight_leaves(unfuse_projections(params)), strict=True))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Eagle3Config:
    dim: int  # D, equal to the target's
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_dim: int
    draft_vocab_size: int  # Vd
    vocab_size: int  # the target's V, which d2t maps into
    rope_theta: float
    rotary_dim: int
    rope_scaling: RopeScaling | None = None  # as the head's checkpoint declares it (Llama 3.1 heads: llama3)
    norm_eps: float
    max_position_embeddings: int
    aux_layer_ids: tuple[int, ...] | None = None  # input-of-layer ids; None = the default for the target

    def __post_init__(self):
        check_sizes_and_numerics(self, ("dim", "num_heads", "num_kv_heads", "head_dim", "ffn_dim", "draft_vocab_size",
                                        "vocab_size", "max_position_embeddings"))
        if self.draft_vocab_size > self.vocab_size:
            raise UnsupportedModelError(f"draft_vocab_size={self.draft_vocab_size} exceeds vocab_size={self.vocab_size}: "
                                        "the draft vocabulary is a subset of the target's")
        self.attention_config  # the head's layer as a trunk config: heads, kv heads and rotary_dim checked there

    @property
    def attention_config(self) -> ModelConfig:
        """The head's single decoder layer seen as a one-layer trunk (for attention and its cache)."""
        return ModelConfig(
            vocab_size=self.draft_vocab_size, dim=self.dim, num_layers=1, num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, ffn_dim=self.ffn_dim,
            rope_theta=self.rope_theta, rotary_dim=self.rotary_dim, rope_scaling=self.rope_scaling,
            norm_eps=self.norm_eps, max_position_embeddings=self.max_position_embeddings,
        )

    def resolved_aux_layers(self, target_layers: int) -> tuple[int, ...]:
        """Declared ids win; else (2, L // 2, L - 3), the EAGLE repo's and vLLM's default."""
        if self.aux_layer_ids is not None:
            return self.aux_layer_ids
        return (2, target_layers // 2, target_layers - 3)


def default_aux_layers(target_layers: int) -> tuple[int, ...]:
    return (2, target_layers // 2, target_layers - 3)


def target_hidden_layers(aux_layer_ids: tuple[int, ...]) -> tuple[int, ...]:
    """The trunk's `hidden_layers` (outputs of layers) that are the streams entering `aux_layer_ids`."""
    return tuple(i - 1 for i in aux_layer_ids)


def config_from_hf(hf: Mapping[str, Any]) -> Eagle3Config:
    """Parse an EAGLE-3 head's config.json (LlamaForCausalLMEagle3 style)."""
    try:
        dim = count(hf["hidden_size"])
        num_heads = count(hf["num_attention_heads"])
        head_dim = count(hf.get("head_dim") or dim // num_heads)
        theta, scaling = _rope_settings(hf)
        eagle = hf.get("eagle_config") or {}
        if not isinstance(eagle, Mapping):
            raise CheckpointError(f"eagle_config must be an object; got {eagle!r:.40}")
        aux = eagle.get("eagle_aux_hidden_state_layer_ids")
        if aux is not None and not isinstance(aux, list):
            raise CheckpointError(f"eagle_aux_hidden_state_layer_ids must be a list of layer ids; got {aux!r:.40}")
        vocab = count(hf["vocab_size"])
        return Eagle3Config(
            dim=dim, num_heads=num_heads, num_kv_heads=count(hf.get("num_key_value_heads") or num_heads),
            head_dim=head_dim, ffn_dim=count(hf["intermediate_size"]),
            draft_vocab_size=count(hf.get("draft_vocab_size") or vocab), vocab_size=vocab,
            rope_theta=theta, rotary_dim=resolve_rotary_dim(hf, head_dim), rope_scaling=scaling,
            norm_eps=real(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=count(hf.get("max_position_embeddings", 2048)),
            aux_layer_ids=None if aux is None else tuple(count(i) for i in aux),
        )
    except KeyError as missing:
        raise UnsupportedModelError(f"EAGLE-3 config.json lacks required field {missing}") from None


def is_eagle3_config(hf: Any) -> bool:
    """Whether a config.json's value describes an EAGLE-3 head (anything else, a list or a
    malformed `architectures` included, is not one: the trunk loaders then name what is wrong)."""
    if not isinstance(hf, Mapping):
        return False
    architectures = hf.get("architectures")
    names = architectures if isinstance(architectures, list) else []
    return (any(isinstance(a, str) and "eagle3" in a.lower() for a in names) or "eagle_config" in hf
            or "draft_vocab_size" in hf)


def init_params(cfg: Eagle3Config, key: jax.Array, scale: float = 0.05) -> Eagle3Params:
    """Random head params (tests); d2t maps draft ids onto the first Vd target ids, shuffled."""
    D, N, K, H, F, Vd = cfg.dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.ffn_dim, cfg.draft_vocab_size
    keys = iter(jax.random.split(key, 16))

    def normal(*shape):
        return scale * jax.random.normal(next(keys), shape, jnp.float32)

    target_ids = jax.random.permutation(next(keys), cfg.vocab_size)[:Vd]
    drawn = {
        "fc": normal(D, 3 * D), "input_layernorm": 1.0 + normal(D), "hidden_norm": 1.0 + normal(D),
        "q_proj": normal(N * H, 2 * D), "k_proj": normal(K * H, 2 * D), "v_proj": normal(K * H, 2 * D),
        "o_proj": normal(D, N * H), "post_attention_layernorm": 1.0 + normal(D),
        "gate_proj": normal(F, D), "up_proj": normal(F, D), "down_proj": normal(D, F),
        "norm": 1.0 + normal(D), "lm_head": normal(Vd, D),
        "d2t": (target_ids - jnp.arange(Vd)).astype(jnp.int32),
    }
    return params_from(drawn.__getitem__)


def encode(params: Eagle3Params, aux: tuple[jax.Array, ...]) -> jax.Array:
    """g = fc(concat(aux)): the target features [B, T, D] each -> [B, T, D]."""
    batch, steps, _ = aux[0].shape
    features = jnp.concatenate(aux, axis=-1).reshape(batch * steps, -1).T  # [3D, B*T]
    return matmul(params.fc, features).T.reshape(batch, steps, -1)


def create_cache(cfg: Eagle3Config, batch: int, capacity: int) -> KVCache:
    return KVCache.create(cfg.attention_config, batch, capacity)


def forward(
    params: Eagle3Params,
    cfg: Eagle3Config,
    embed: Weight,
    tokens: jax.Array,
    g: jax.Array,
    cache: KVCache,
    *,
    positions: jax.Array | None = None,
    tree_mask: TreeMask | None = None,
) -> tuple[jax.Array, jax.Array, KVCache]:
    """One head step over T positions per row, written at the cache's per-row offsets.

    embed: the target's [V, D]; tokens int32[B, T] (the token after each feature's position);
    g: [B, T, D] (encoded target features, or the head's own previous g_next).
    positions: int32[B, T] RoPE positions, default the slots; tree_mask: a draft tree's ancestor
    mask in place of the causal rule (the head drafting a tree's frontier).
    Returns draft-vocabulary logits [B, T, Vd], g_next [B, T, D], the cache (length unchanged).
    """
    batch, steps = tokens.shape
    attention_cfg = cfg.attention_config
    if positions is None:
        positions = cache.length[:, None] + jnp.arange(steps, dtype=jnp.int32)[None, :]
    cos, sin = rope_tables(attention_cfg, positions)

    e = embedding_rows(embed, tokens.reshape(-1)).T  # [D, B*T]
    g = g.reshape(batch * steps, cfg.dim).T  # [D, B*T]
    cat = jnp.concatenate([rms_norm(e, params.input_layernorm, cfg.norm_eps),
                           rms_norm(g, params.hidden_norm, cfg.norm_eps)], axis=0)  # [2D, B*T]
    attn_out, keys, values = self_attention(params.attention, attention_cfg, cat, cos, sin, cache.keys[0], cache.values[0],
                                            cache.length, batch, steps, tree_mask=tree_mask)
    x1 = g + attn_out  # the residual is the pre-norm g
    g_next = x1 + swiglu(params.mlp, rms_norm(x1, params.post_attention_layernorm, cfg.norm_eps))
    logits = logits_head(params.lm_head, rms_norm(g_next, params.norm, cfg.norm_eps), batch, steps)  # [B, T, Vd]
    g_next = g_next.reshape(cfg.dim, batch, steps).transpose(1, 2, 0)
    return logits, g_next, cache.replace(keys=(keys,), values=(values,))


def to_target_ids(params: Eagle3Params, draft_ids: jax.Array) -> jax.Array:
    return draft_ids + jnp.take(params.d2t, draft_ids)
