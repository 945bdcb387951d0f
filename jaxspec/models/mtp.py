"""The MTP (multi-token prediction) draft head, DeepSeek-V3 NextN style, as transformers'
`MtpModel` runs it.

    pair p:  e  = target_embedding(token p + 1)
             x  = eh_proj([enorm(e); hnorm(h_p)])          2D -> D, no bias
             y  = decoder_layer(x)                          one layer of the trunk's kind, own KV
             h' = post_norm(y)                              (DeepSeek's `shared_head.norm`)
             logits = target_lm_head(h')                    the target's own head and vocabulary
    chain:   the next draft step's h is h' (the head threads its own output; k > 1 reuses it)

h_0 is the target's last hidden state *after* its final norm (HF's tied `hidden_states[-1]`; the
trunk returns it as hidden layer `num_layers`). Pair p runs at RoPE position p + 1 (the token's
own position) and lives in KV slot p, as in `MtpModel`: the input ids are the target's shifted
left by one. With `mtp_hidden_states_first` a checkpoint orders the projection input [h; e].

A checkpoint may carry several MTP layers (num_nextn_predict_layers); each is trained for one
further depth, but the first chained on its own output drafts every depth exactly (verification
keeps the output exact whatever proposes), so jaxspec loads the first and chains it, as vLLM
does for k > num_nextn_predict_layers.

Params: `MtpParams` (float32; weights [out, in]): the projection's norms and weight, and one
trunk layer (`layers.LlamaLayer`, run by `layers.decoder_layer`) as its block. `params_from`
builds it from per-tensor values under flat names ("enorm", ..., "block.q_proj": a block
param is "block." + its `llama.layer_shapes` key), the names an MTP head file stores.
The embedding and lm_head are the target's, passed in beside these params.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec.cache import KVCache
from jaxspec.config import ModelConfig, count, flag
from jaxspec.config import config_from_hf as trunk_config_from_hf
from jaxspec.errors import UnsupportedModelError
from jaxspec.models import llama
from jaxspec.models.layers import LlamaLayer, decoder_layer, logits_head, rms_norm, rope_tables, unfuse_projections
from jaxspec.models.params import param
from jaxspec.models.quant import Weight, embedding_rows, matmul, weight_leaves
from jaxspec.pallas.flash_decode import TreeMask


@dataclasses.dataclass(frozen=True, kw_only=True)
class MtpConfig:
    block: ModelConfig  # the head's decoder layer seen as a one-layer trunk of the target's kind
    hidden_first: bool = False  # projection input [hnorm(h); enorm(e)] instead of [enorm(e); hnorm(h)]
    num_checkpoint_layers: int = 1  # MTP layers the checkpoint declares (the first is used)

    @property
    def dim(self) -> int:
        return self.block.dim

    @property
    def vocab_size(self) -> int:
        return self.block.vocab_size


@struct.dataclass
class MtpParams:
    """An MTP head: [enorm(e); hnorm(h)] projected to D, one trunk layer, a final norm."""

    enorm: jax.Array = param(axes=("embed",))  # [D], on the token embedding
    hnorm: jax.Array = param(axes=("embed",))  # [D], on the target's hidden
    eh_proj: jax.Array = param(axes=("embed", None), linear=True)  # [D, 2D]
    post_norm: jax.Array = param(axes=("embed",))  # [D]
    block: LlamaLayer  # one layer of the target's kind


def leaf_shapes(cfg: MtpConfig) -> dict[str, tuple[int, ...]]:
    """Every param's shape by its flat name (see the module docstring), in checkpoint order."""
    D = cfg.dim
    block = {f"block.{name}": shape for name, shape in llama.layer_shapes(cfg.block).items()}
    return {"enorm": (D,), "hnorm": (D,), "eh_proj": (D, 2 * D), "post_norm": (D,), **block}


def params_from(cfg: MtpConfig, leaf: Callable[[str], Any]) -> MtpParams:
    """The head's params, each `leaf(name)` for a flat name of `leaf_shapes`."""
    enorm, hnorm, eh_proj, post_norm = leaf("enorm"), leaf("hnorm"), leaf("eh_proj"), leaf("post_norm")
    block = llama.layer_from(cfg.block, lambda name: leaf(f"block.{name}"))
    return MtpParams(enorm=enorm, hnorm=hnorm, eh_proj=eh_proj, post_norm=post_norm, block=block)


def named_leaves(params: MtpParams, cfg: MtpConfig) -> dict[str, jax.Array]:
    """The head's weights by their flat names (the inverse of `params_from`; fused projections
    split back, an int8 weight one leaf)."""
    names = jax.tree.leaves(params_from(cfg, lambda name: name))
    return dict(zip(names, weight_leaves(unfuse_projections(params)), strict=True))


def init_params(cfg: MtpConfig, key: jax.Array, scale: float = 0.05) -> MtpParams:
    """Random head params (tests): norms near 1, a random trunk layer."""
    D = cfg.dim
    keys = jax.random.split(key, 6)
    block = llama.init_params(dataclasses.replace(cfg.block, num_layers=1), keys[0], scale).layers[0]

    def perturb_norm(path, value):  # attn_norm, mlp_norm, q_norm, k_norm
        return value + scale * jax.random.normal(keys[1], value.shape) if path[-1].name.endswith("norm") else value

    block = jax.tree_util.tree_map_with_path(perturb_norm, block)

    def norm(k):
        return 1.0 + scale * jax.random.normal(k, (D,))

    return MtpParams(enorm=norm(keys[2]), hnorm=norm(keys[3]), post_norm=norm(keys[4]),
                     eh_proj=scale * jax.random.normal(keys[5], (D, 2 * D)), block=block)


def create_cache(cfg: MtpConfig, batch: int, capacity: int) -> KVCache:
    return KVCache.create(cfg.block, batch, capacity)


def forward(
    params: MtpParams,
    cfg: MtpConfig,
    embed: Weight,
    lm_head: Weight,
    tokens: jax.Array,
    h: jax.Array,
    cache: KVCache,
    *,
    positions: jax.Array | None = None,
    tree_mask: TreeMask | None = None,
) -> tuple[jax.Array, jax.Array, KVCache]:
    """One head step over T pairs per row, written at the cache's per-row offsets.

    embed, lm_head: the target's [V, D]; tokens int32[B, T]: the token after each hidden's
    position; h [B, T, D]: the target's final-normed hiddens, or the head's own previous output.
    positions: int32[B, T] the slots' positions (default the slots; token p + 1 is placed at
    position p + 1); tree_mask: a draft tree's ancestor mask in place of the causal rule.
    Returns logits [B, T, V], the head's output h' [B, T, D], the cache (length unchanged).
    """
    batch, steps = tokens.shape
    block_cfg = cfg.block
    if positions is None:
        positions = cache.length[:, None] + jnp.arange(steps, dtype=jnp.int32)[None, :]
    cos, sin = rope_tables(block_cfg, positions + 1)  # slot p pairs with token p + 1: RoPE at p + 1

    e = rms_norm(embedding_rows(embed, tokens.reshape(-1)).T, params.enorm, block_cfg.norm_eps)
    hidden = rms_norm(h.reshape(batch * steps, cfg.dim).T, params.hnorm, block_cfg.norm_eps)
    projected = matmul(params.eh_proj, jnp.concatenate([hidden, e] if cfg.hidden_first else [e, hidden], axis=0))
    y, keys, values = decoder_layer(params.block, block_cfg, projected, cos, sin, cache.keys[0], cache.values[0],
                                    cache.length, batch, steps, qk_norm=block_cfg.qk_norm, tree_mask=tree_mask)
    out = rms_norm(y, params.post_norm, block_cfg.norm_eps)  # [D, B*T]
    logits = logits_head(lm_head, out, batch, steps)  # [B, T, V]
    out = out.reshape(cfg.dim, batch, steps).transpose(1, 2, 0)
    return logits, out, cache.replace(keys=(keys,), values=(values,))


def config_from_hf(hf: Mapping[str, Any]) -> MtpConfig:
    """The MTP head's config from its target's config.json (`num_nextn_predict_layers`, or
    transformers' `num_mtp_layers`; Mellum's `mtp_layer_types` / `mtp_mlp_layer_types`)."""
    layers = hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers"))
    if not layers:
        raise UnsupportedModelError(
            "config.json declares no MTP layers (num_nextn_predict_layers / num_mtp_layers); this "
            "checkpoint has no MTP head")
    layer_type = (hf.get("mtp_layer_types") or ["full_attention"])[0]
    mlp_type = (hf.get("mtp_mlp_layer_types") or ["dense"])[0]
    if mlp_type != "dense":
        raise UnsupportedModelError(f"mtp_mlp_layer_types[0] is {mlp_type!r}; jaxspec runs dense MTP blocks only")
    if layer_type not in ("full_attention", "sliding_attention"):
        raise UnsupportedModelError(f"mtp_layer_types[0] is {layer_type!r}; expected full or sliding attention")
    view = {key: value for key, value in hf.items() if key not in ("layer_types", "mlp_layer_types")}
    view["num_hidden_layers"] = 1
    rope = hf.get("rope_parameters")
    if isinstance(rope, Mapping) and isinstance(rope.get(layer_type), Mapping):
        view["rope_parameters"] = rope[layer_type]  # per-layer-type RoPE (Mellum)
    block = trunk_config_from_hf(view)
    window = hf.get("sliding_window")
    if layer_type == "sliding_attention" and window:
        # A sliding layer attends like a full one up to its window: the head serves contexts
        # that fit in it (a request beyond is refused, see jaxspec.api).
        block = dataclasses.replace(block, max_position_embeddings=min(block.max_position_embeddings, count(window)))
    return MtpConfig(block=block, hidden_first=flag(hf.get("mtp_hidden_states_first", False), "mtp_hidden_states_first"),
                     num_checkpoint_layers=count(layers))
