"""Gemma 4's shared-KV assistant: a drafter with no KV cache of its own.

The reference is transformers' `gemma4_assistant` (`Gemma4AssistantForCausalLM`, tests-only) as
driven by its `SinglePositionMultiTokenCandidateGenerator`. The assistant is a small Gemma 4 text
stack whose every layer is KV-shared: its attention layers have only q (and o) projections and
attend over the *target's* keys and values, those of the target's last layer of the same type
(sliding or global) before the target's own shared layers (`GemmaConfig.kv_source_of`), read in
place from the loop's cache. A draft step:

    x = pre_projection(concat(target_embed(token) * sqrt(D_target), hidden))        # [D_a]
    h = the assistant's layers over x, the query at position p, then its final norm
    logits = its tied LM head (or the centroid-masked head) of h;  hidden' = post_projection(h)

where, for the first draft of a round, `token` is the pending token and `hidden` the target's
final-normed hidden state at the position before it (what produced it), and for the next drafts
the previous draft and hidden'. Every step's query sits at the same position p (the pending
token's, = the target cache's committed length) and writes nothing: the keys it sees are the
target's at positions < p, the sliding layers' the last window + 1 of them (the reach
transformers' flipped bidirectional mask gives the assistant).

The centroid-masked head (`use_ordered_embeddings`): a [C, D_a] centroid projection picks the
top `centroid_intermediate_top_k` of C token clusters (`token_ordering` lists the vocabulary
cluster by cluster, V / C each); only their tokens get logits, the rest the smallest of those
minus 1 (per position here; transformers takes the minimum over the whole batch).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec.cache import KVCache
from jaxspec.config import count, flag
from jaxspec.errors import UnsupportedModelError
from jaxspec.models import gemma
from jaxspec.models.gemma import GemmaConfig, GemmaLayer
from jaxspec.models.layers import AttentionParams, MlpParams, logits_head, rms_norm, rope_tables
from jaxspec.models.params import is_shape, param
from jaxspec.models.quant import embedding_rows, matmul
from jaxspec.pallas.flash_decode import Attention, TreeMask


@dataclasses.dataclass(frozen=True, kw_only=True)
class AssistantConfig:
    """A Gemma 4 assistant: its own stack (every layer reads the target's K/V) and its heads."""

    text: GemmaConfig  # its layers, heads and RoPE; num_kv_shared_layers 0 here (all share, by construction)
    backbone_dim: int  # D_b: the target's hidden size
    num_centroids: int | None = None  # C: the centroid-masked head's clusters (None: the plain tied head)
    centroid_top_k: int = 32  # clusters kept per position

    def __post_init__(self):
        if isinstance(self.text, Mapping):
            object.__setattr__(self, "text", GemmaConfig(**self.text))
        if self.text.generation != 4:
            raise UnsupportedModelError("a shared-KV assistant is a Gemma 4 stack")
        if self.num_centroids is not None:
            if self.text.vocab_size % self.num_centroids:
                raise UnsupportedModelError(f"num_centroids={self.num_centroids} must divide the vocabulary "
                                            f"({self.text.vocab_size})")
            if not 1 <= self.centroid_top_k <= self.num_centroids:
                raise UnsupportedModelError(f"centroid_intermediate_top_k={self.centroid_top_k} must be in "
                                            f"[1, num_centroids={self.num_centroids}]")

    @property
    def vocab_size(self) -> int:
        return self.text.vocab_size

    @property
    def dim(self) -> int:  # what `methods` compares with the target's hidden size
        return self.backbone_dim

    # What sharding's axis counts read (a draft on its target's mesh): its own stack's.
    @property
    def num_heads(self) -> int:
        return self.text.num_heads

    @property
    def num_kv_heads(self) -> int:
        return self.text.num_kv_heads

    @property
    def ffn_dim(self) -> int:
        return self.text.ffn_dim


@struct.dataclass
class AssistantParams:
    pre_projection: jax.Array = param(axes=(None, "embed"), linear=True)  # [D_a, 2 * D_b]
    layers: tuple[GemmaLayer, ...]  # q-only attention (k/v fields None)
    final_norm: jax.Array = param(axes=(None,))  # [D_a]
    embed: jax.Array = param(axes=("vocab", None), linear=True)  # [V, D_a]: the tied LM head
    post_projection: jax.Array = param(axes=("embed", None), linear=True)  # [D_b, D_a]
    centroids: jax.Array | None = param(axes=(None, None), linear=True)  # [C, D_a]
    token_ordering: jax.Array | None = param(axes=(None,))  # int32[V]: the vocabulary cluster by cluster


def layer_shapes(cfg: AssistantConfig, index: int) -> dict[str, tuple[int, ...]]:
    text = cfg.text
    spec, D, F = text.attention_of(index), text.dim, text.ffn_dim
    N, H = spec.num_heads, spec.head_dim
    return {"attn_norm": (D,), "q_proj": (N * H, D), "o_proj": (D, N * H), "q_norm": (H,), "post_attn_norm": (D,),
            "mlp_norm": (D,), "gate_proj": (F, D), "up_proj": (F, D), "down_proj": (D, F), "post_mlp_norm": (D,),
            "scalar": (1,)}


def top_shapes(cfg: AssistantConfig) -> dict[str, tuple[int, ...]]:
    D, Db, V = cfg.text.dim, cfg.backbone_dim, cfg.vocab_size
    shapes = {"pre_projection": (D, 2 * Db), "final_norm": (D,), "embed": (V, D), "post_projection": (Db, D)}
    if cfg.num_centroids is not None:
        shapes |= {"centroids": (cfg.num_centroids, D), "token_ordering": (V,)}
    return shapes


def params_from(cfg: AssistantConfig, leaf) -> AssistantParams:
    """The params tree, each present param `leaf(name, layer index or None)`."""
    top = top_shapes(cfg)

    def layer(index: int) -> GemmaLayer:
        get = lambda name: leaf(name, index)  # noqa: E731
        attention = AttentionParams(q_proj=get("q_proj"), k_proj=None, v_proj=None, o_proj=get("o_proj"),
                                    q_bias=None, k_bias=None, v_bias=None, q_norm=get("q_norm"), k_norm=None)
        return GemmaLayer(attn_norm=get("attn_norm"), attention=attention, post_attn_norm=get("post_attn_norm"),
                          mlp_norm=get("mlp_norm"),
                          mlp=MlpParams(gate_proj=get("gate_proj"), up_proj=get("up_proj"), down_proj=get("down_proj")),
                          post_mlp_norm=get("post_mlp_norm"), per_layer_gate=None, per_layer_proj=None,
                          per_layer_norm=None, scalar=get("scalar"))

    optional = {name: leaf(name, None) if name in top else None for name in ("centroids", "token_ordering")}
    return AssistantParams(pre_projection=leaf("pre_projection", None),
                           layers=tuple(layer(i) for i in range(cfg.text.num_layers)),
                           final_norm=leaf("final_norm", None), embed=leaf("embed", None),
                           post_projection=leaf("post_projection", None), **optional)


def param_shapes(cfg: AssistantConfig) -> AssistantParams:
    top = top_shapes(cfg)
    return params_from(cfg, lambda name, index: top[name] if index is None else layer_shapes(cfg, index)[name])


# HF names (Gemma4AssistantForCausalLM): the text stack under "model.", the heads at the top.
HF_TOP = {"pre_projection": "pre_projection.weight", "final_norm": "model.norm.weight",
          "embed": "model.embed_tokens.weight", "post_projection": "post_projection.weight",
          "centroids": "masked_embedding.centroids.weight", "token_ordering": "masked_embedding.token_ordering"}


def hf_names(cfg: AssistantConfig) -> AssistantParams:
    layer_names = gemma._HF_LAYER

    def name(key: str, index: int | None) -> str:
        return HF_TOP[key] if index is None else f"model.layers.{index}.{layer_names[key]}"

    return params_from(cfg, name)


def config_from_hf(hf: Mapping[str, Any]) -> AssistantConfig:
    """Parse a `gemma4_assistant` config.json; its text_config is a gemma4_text stack whose every
    layer is KV-shared (transformers sets num_kv_shared_layers = num_hidden_layers)."""
    if hf.get("model_type") != "gemma4_assistant":
        raise UnsupportedModelError(f"model_type {hf.get('model_type')!r} is not a Gemma 4 assistant")
    text = hf.get("text_config")
    if not isinstance(text, Mapping):
        raise UnsupportedModelError("a gemma4_assistant config.json needs a 'text_config' object")
    layers = text.get("num_hidden_layers")
    shared = text.get("num_kv_shared_layers") or layers
    if shared != layers:
        raise UnsupportedModelError(f"every layer of a Gemma 4 assistant shares K/V: num_kv_shared_layers={shared}, "
                                    f"num_hidden_layers={layers}")
    if text.get("hidden_size_per_layer_input"):
        raise UnsupportedModelError("hidden_size_per_layer_input must be 0 in a Gemma 4 assistant")
    stack = gemma.config_from_hf({**text, "model_type": "gemma4_text", "num_kv_shared_layers": 0,
                                  "tie_word_embeddings": True})
    ordered = flag(hf.get("use_ordered_embeddings", False), "use_ordered_embeddings")
    return AssistantConfig(text=stack, backbone_dim=count(hf.get("backbone_hidden_size", 1536)),
                           num_centroids=count(hf.get("num_centroids", 2048)) if ordered else None,
                           centroid_top_k=count(hf.get("centroid_intermediate_top_k", 32)))


def check_target(cfg: AssistantConfig, target: Any) -> None:
    """UnsupportedModelError unless `target` is a Gemma 4 trunk whose K/V the assistant can read:
    its hidden size, vocabulary, and per layer type the kv heads and head width."""
    if not isinstance(target, GemmaConfig) or target.generation != 4:
        kind = f"a Gemma {target.generation}" if isinstance(target, GemmaConfig) else type(target).__name__
        raise UnsupportedModelError(f"a Gemma 4 assistant drafts for a Gemma 4 target; the target is {kind}")
    if cfg.backbone_dim != target.dim:
        raise UnsupportedModelError(f"the assistant's backbone_hidden_size ({cfg.backbone_dim}) differs from the "
                                    f"target's hidden size ({target.dim})")
    if cfg.vocab_size != target.vocab_size:
        raise UnsupportedModelError(f"the assistant's vocabulary ({cfg.vocab_size}) differs from the target's "
                                    f"({target.vocab_size})")
    for kind in sorted(set(cfg.text.layer_types), key=lambda k: k.value):
        mine, theirs = cfg.text.attention_for(kind), None
        if kind in target.layer_types[: target.first_shared_layer]:
            theirs = target.attention_of(target.kv_source_of(kind))
        if theirs is None:
            raise UnsupportedModelError(f"the assistant has {kind.value} layers but the target has none to share")
        if (mine.num_kv_heads, mine.head_dim) != (theirs.num_kv_heads, theirs.head_dim):
            raise UnsupportedModelError(
                f"the assistant's {kind.value} layers read {mine.num_kv_heads} kv heads of width {mine.head_dim}, "
                f"the target's store {theirs.num_kv_heads} of width {theirs.head_dim}")


def _head(params: AssistantParams, cfg: AssistantConfig, h: jax.Array, batch: int, steps: int) -> jax.Array:
    """Logits float32[B, T, V] from the final-normed stream h [D_a, B*T]."""
    if cfg.num_centroids is None:
        return logits_head(params.embed, h, batch, steps)
    V, C, top = cfg.vocab_size, cfg.num_centroids, cfg.centroid_top_k
    positions = batch * steps
    scores = matmul(params.centroids, h).T  # [B*T, C]
    _, clusters = jax.lax.top_k(scores, top)  # [B*T, top]
    candidates = params.token_ordering.reshape(C, V // C)[clusters].reshape(positions, -1)  # [B*T, M]
    rows = embedding_rows(params.embed, candidates.reshape(-1)).reshape(positions, candidates.shape[1], -1)
    selected = jnp.einsum("PMD,DP->PM", rows, h)  # [B*T, M]
    fill = jnp.min(selected, axis=1, keepdims=True) - 1.0
    logits = jnp.broadcast_to(fill, (positions, V))
    logits = logits.at[jnp.arange(positions)[:, None], candidates].set(selected)
    return logits.reshape(batch, steps, V)


def forward(params: AssistantParams, cfg: AssistantConfig, target_cfg: GemmaConfig, target_embed: jax.Array,
            tokens: jax.Array, hidden: jax.Array, target_cache: KVCache, *,
            attention: Attention | str = Attention.AUTO) -> tuple[jax.Array, jax.Array]:
    """T independent assistant steps per row, all at the position `target_cache.length` (the
    pending token's): tokens int32[B, T] (target ids), hidden [B, T, D_b] (the target's hidden
    or the assistant's previous post-projection). Nothing is written to the target's cache.

    Returns (logits float32[B, T, V], next hidden [B, T, D_b]).
    """
    text = cfg.text
    batch, steps = tokens.shape
    position = target_cache.length  # [B]: the query's position; keys < it are visible
    embedded = gemma.embed_tokens(target_embed, target_cfg, tokens)  # [D_b, B*T], times sqrt(D_b)
    x = jnp.concatenate([embedded, hidden.reshape(batch * steps, -1).T], axis=0)  # [2*D_b, B*T]
    h = matmul(params.pre_projection, x)  # [D_a, B*T]
    queries = jnp.repeat(position[:, None], steps, axis=1)  # [B, T]
    # No key at or past `position`: a window starting there with nothing visible in it.
    sees_context_only = TreeMask(start=position, visible=jnp.zeros((batch, steps, 1), bool))
    # Per layer type (once, not per layer): its spec, the sliding layers reaching window + 1 keys
    # (positions > p - 2 - window), and its RoPE at the query's position.
    specs = {kind: text.attention_for(kind) for kind in set(text.layer_types)}
    specs = {kind: spec if spec.window is None else dataclasses.replace(spec, window=spec.window + 1)
             for kind, spec in specs.items()}
    rope = {kind: rope_tables(spec, queries) for kind, spec in specs.items()}
    for index, layer in enumerate(params.layers):
        kind = text.layer_types[index]
        spec, (cos, sin) = specs[kind], rope[kind]
        buffer = target_cfg.kv_source_of(kind)
        mixed, _, _ = gemma.attention_layer(
            layer.attention, spec, text, rms_norm(h, layer.attn_norm, text.norm_eps), cos, sin,
            target_cache.keys[buffer], target_cache.values[buffer], position, queries - 1, batch, steps,
            computes_kv=False, attention=attention, tree_mask=sees_context_only)
        h = gemma.decoder_layer(layer, text, h, mixed, None)
    h = rms_norm(h, params.final_norm, text.norm_eps)
    logits = _head(params, cfg, h, batch, steps)
    projected = matmul(params.post_projection, h)  # [D_b, B*T]
    return logits, projected.reshape(-1, batch, steps).transpose(1, 2, 0)


def init_params(cfg: AssistantConfig, key: jax.Array, scale: float = 0.02) -> AssistantParams:
    """Random params of the right shapes (tests and benchmarks): norms and layer scalars near 1,
    the clusters a random ordering of the vocabulary."""
    shapes = jax.tree.leaves(param_shapes(cfg), is_leaf=is_shape)
    keys = iter(jax.random.split(key, len(shapes)))
    norms = {"attn_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm", "q_norm", "final_norm", "scalar"}

    def leaf(name: str, index: int | None) -> jax.Array:
        shape = top_shapes(cfg)[name] if index is None else layer_shapes(cfg, index)[name]
        if name == "token_ordering":
            return jax.random.permutation(next(keys), shape[0]).astype(jnp.int32)
        values = scale * jax.random.normal(next(keys), shape, jnp.float32)
        return 1.0 + 5 * values if name in norms else values

    return params_from(cfg, leaf)
