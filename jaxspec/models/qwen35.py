"""The Qwen3.5 hybrid trunk: Gated DeltaNet linear attention + gated full attention.

The text model of transformers' `models/qwen3_5` (the reference, tests-only). Most layers are
Gated DeltaNet (`jaxspec.models.gated_deltanet`: a short causal conv1d over the q/k/v
projections, the gated delta rule on a recurrent state [B, E, X, Y] per layer, an RMSNorm gated
by silu(z)). Every few layers (`layer_types`) is a full-attention layer with QK-norm, partial
RoPE and a sigmoid output gate (`jaxspec.models.layers.self_attention`). This module holds the
config, the params types, the forward and the family descriptor. The cache it runs on, and how
it commits and rolls back the recurrent state, is `jaxspec.models.hybrid_cache` (`Qwen35Cache`,
`RecordedSteps` and `ChunkedSteps` are re-exported here).

    forward(params, cfg, tokens [B, T], cache) -> (logits [B, P, V], hiddens, cache)

honours the trunk contract of `jaxspec.models`: the T tokens are run at each row's
`cache.length` without advancing it, and the caller commits with `advance` / `set_length`.
The forward leaves the DeltaNet layers' per-position states pending in the cache: recorded after
every position when T <= `Qwen35Config.recorded_steps` (the recurrent form), else as chunk-start
states and per-position inputs (the chunked form); the commit selects each row's state from them.

Layout follows `llama.py`: weights `[out, in]` as HF stores them, activations feature-major
`[D, B*T]` through the projections; the recurrence runs on `[B, T, heads, dim]`.
DeltaNet letters (beside `jaxspec.config.ModelConfig`'s): E value heads (the state's heads), J key heads, X key head
dim, Y value head dim, C conv channels (2*J*X + E*Y), W conv kernel, R rollback states.

Params: `Qwen35Params` (float32), its layers by cfg.layer_types[i] a `FullAttentionLayer`
(q_proj [N*2H, D]: per head H query rows, then H gate rows, as HF fuses them; QK-norm) or a
`DeltaNetLayer` (`gated_deltanet.DeltaNetParams`), each with its norms and SwiGLU MLP; shapes and
logical axes are declared on the types. `params_from` builds the tree from per-leaf values.
RMSNorm weights are stored as the multiplier: HF's Qwen3.5 norms are zero-centred (x * (1 + w)),
and the family descriptor's HF tensor map (end of this module) adds the 1 once on load, so the
forward shares `layers.rms_norm`. The gated output norm
(`out_norm`) is not zero-centred in HF and is stored as is.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxspec.config import (RopeScaling, _rope_settings, check_sizes_and_numerics, count, eos_ids, flag, from_json_dict,
                            real, resolve_rotary_dim, to_json_dict)
from jaxspec.errors import UnsupportedModelError
from jaxspec.models.family import Family, TensorSource
from jaxspec.models.gated_deltanet import DeltaNetParams, DeltaRule, gated_delta_net
from jaxspec.models.hybrid_cache import ChunkedSteps, Qwen35Cache, RecordedSteps
from jaxspec.models.layers import (
    AttentionParams,
    MlpParams,
    logits_head,
    output_head,
    rms_norm,
    rope_tables,
    self_attention,
    swiglu,
)
from jaxspec.models.quant import embedding_rows
from jaxspec.models.params import LeafFn, is_shape, param, trunk_params
from jaxspec.pallas.flash_decode import Attention


class LayerType(enum.Enum):
    LINEAR_ATTENTION = "linear_attention"  # Gated DeltaNet
    FULL_ATTENTION = "full_attention"  # gated softmax attention over the KV cache


@dataclasses.dataclass(frozen=True, kw_only=True)
class Qwen35Config:
    """Shape and numerics of a Qwen3.5 hybrid trunk. Letters: `jaxspec.config.ModelConfig`'s plus the module docstring."""

    vocab_size: int  # V
    dim: int  # D
    num_layers: int  # L
    # The kind of each layer. A longer tuple is cut to num_layers (a layer-skip draft is the
    # target's config with a smaller num_layers); a shorter one is an error.
    layer_types: tuple[LayerType, ...]
    ffn_dim: int  # F
    # gated full attention
    num_heads: int  # N
    num_kv_heads: int  # K
    head_dim: int  # H
    rotary_dim: int  # leading dims of each head RoPE rotates (Qwen3.5: H / 4)
    rope_theta: float = 10_000_000.0
    rope_scaling: RopeScaling | None = None  # parsed by config._rope_settings
    # Gated DeltaNet
    linear_num_key_heads: int  # J
    linear_num_value_heads: int  # E
    linear_key_head_dim: int  # X
    linear_value_head_dim: int  # Y
    linear_conv_kernel: int = 4  # W
    norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    tie_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Committed DeltaNet states kept per layer and row: how far back `set_length` can roll a
    # cache with no forward in between (R - 1 positions). 1 keeps only the current state (a
    # target never rolls back); a draft model or layer-skip draft drafting k tokens needs k + 2
    # (a finished row keeps drafting; jaxspec.spec.methods sizes a draft's ring from k).
    rollback_states: int = 8
    # A forward over at most this many tokens runs the recurrent form and records the state after
    # every position (commit = an index); longer ones run the chunked form and record chunk-start
    # states and per-position inputs (commit = a one-chunk recompute, one state committed).
    # 0: always the latter, fine for a target; a draft model that rolls back needs >= 2.
    recorded_steps: int = 16

    def __post_init__(self):
        try:
            layer_types = tuple(LayerType(t) for t in self.layer_types)
        except ValueError as err:
            raise UnsupportedModelError(f"layer_types: {err} (only {[t.value for t in LayerType]})") from None
        if len(layer_types) < self.num_layers:
            raise UnsupportedModelError(
                f"layer_types has {len(layer_types)} entries but num_layers is {self.num_layers}; "
                "the layer pattern must name every layer")
        object.__setattr__(self, "layer_types", layer_types[: self.num_layers])
        check_sizes_and_numerics(self, ("vocab_size", "dim", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                                        "ffn_dim", "max_position_embeddings", "linear_num_key_heads",
                                        "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim"))
        checks = [
            (self.num_layers >= 1, f"num_layers={self.num_layers} must be >= 1"),
            (self.num_heads % self.num_kv_heads == 0,
             f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"),
            (self.rotary_dim % 2 == 0 and 0 < self.rotary_dim <= self.head_dim,
             f"rotary_dim={self.rotary_dim} must be even and in (0, head_dim={self.head_dim}]"),
            (self.linear_num_value_heads % self.linear_num_key_heads == 0,
             f"linear_num_value_heads={self.linear_num_value_heads} must be a multiple of "
             f"linear_num_key_heads={self.linear_num_key_heads}"),
            (self.linear_conv_kernel >= 1, f"linear_conv_kernel={self.linear_conv_kernel} must be >= 1"),
            (self.rollback_states >= 1, f"rollback_states={self.rollback_states} must be >= 1"),
            (self.recorded_steps >= 0, f"recorded_steps={self.recorded_steps} must be >= 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise UnsupportedModelError(message)

    @property
    def group_size(self) -> int:  # G: query heads per kv head
        return self.num_heads // self.num_kv_heads

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t is LayerType.FULL_ATTENTION)

    @property
    def kv_layout(self) -> tuple[tuple[int, int], ...]:
        """(kv heads, head dim) of each K/V buffer (`cache.kv_layout`): one per attention layer."""
        return ((self.num_kv_heads, self.head_dim),) * len(self.attention_layers)

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t is LayerType.LINEAR_ATTENTION)

    @property
    def key_dim(self) -> int:  # J*X
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:  # E*Y
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:  # C: channels through the conv (q, k and v)
        return 2 * self.key_dim + self.value_dim


# ----------------------------------------------------------------------------------------------
# The forward
# ----------------------------------------------------------------------------------------------


def _check_params(params: Qwen35Params, cfg: Qwen35Config) -> None:
    """At trace time: the params must have one layer per config layer, of the config's kind."""
    layers = params.layers
    if len(layers) != cfg.num_layers:
        raise UnsupportedModelError(f"params have {len(layers)} layers but num_layers is {cfg.num_layers}")
    for index, (layer, kind) in enumerate(zip(layers, cfg.layer_types)):
        if not isinstance(layer, _LAYER_TYPES[kind]):
            raise UnsupportedModelError(f"params layer {index} is a {type(layer).__name__}, but "
                                        f"layer_types[{index}]={kind.value!r} needs a {_LAYER_TYPES[kind].__name__}")


def forward(
    params: Qwen35Params,
    cfg: Qwen35Config,
    tokens: jax.Array,
    cache: Qwen35Cache,
    *,
    positions: jax.Array | None = None,
    logit_indices: jax.Array | None = None,
    hidden_layers: tuple[int, ...] = (),
    delta_rule: DeltaRule | None = None,
    attention: Attention | str = Attention.AUTO,
) -> tuple[jax.Array, tuple[jax.Array, ...], Qwen35Cache]:
    """Run T new tokens per row through the hybrid trunk (the `jaxspec.models` contract).

    tokens int32[B, T] at slots `cache.length[b] + t`; positions (RoPE) default the slots;
    logit_indices int32[B, P] picks which positions get logits (default all T); hidden_layers
    returns the residual stream after those layers (-1: the embeddings; num_layers: after the
    final norm), each [B, T, D].
    delta_rule: the form of the delta rule; default recurrent for T <= cfg.recorded_steps (every
    state recorded), chunked above. attention: the attention layers' path, as in llama.py
    ("auto" is the XLA reference). The cache comes back with K/V written and
    the DeltaNet states pending, `length` unchanged: commit with `advance` / `set_length`.
    """
    _check_params(params, cfg)
    batch, steps = tokens.shape
    if delta_rule is None:
        delta_rule = DeltaRule.RECURRENT if steps <= cfg.recorded_steps else DeltaRule.CHUNKED
    offsets = cache.length
    if positions is None:
        positions = offsets[:, None] + jnp.arange(steps, dtype=jnp.int32)[None, :]
    cos, sin = rope_tables(cfg, positions)  # [R/2, B, T]

    h = embedding_rows(params.embed, tokens.reshape(-1)).T  # [D, B*T]
    new_keys, new_values, hiddens = [], [], {-1: h}
    recorded: list[dict[str, jax.Array]] = []
    for index, (layer, kind) in enumerate(zip(params.layers, cfg.layer_types)):
        with jax.named_scope(f"layer_{index}_{kind.value}"):
            x = rms_norm(h, layer.attn_norm, cfg.norm_eps)
            if kind is LayerType.FULL_ATTENTION:
                slot = len(new_keys)
                mixed, k_buf, v_buf = self_attention(layer.attention, cfg, x, cos, sin, cache.keys[slot], cache.values[slot],
                                                     offsets, batch, steps, qk_norm=True, output_gate=True,
                                                     attention=attention)
                new_keys.append(k_buf)
                new_values.append(v_buf)
            else:
                conv_window, state = cache.current_state(len(recorded))
                mixed, pending = gated_delta_net(layer.delta_net, cfg, x, conv_window, state, batch, steps, delta_rule)
                recorded.append(pending)
            h = h + mixed
            h = h + swiglu(layer.mlp, rms_norm(h, layer.mlp_norm, cfg.norm_eps))
        hiddens[index] = h

    h = rms_norm(h, params.final_norm, cfg.norm_eps)
    hiddens[cfg.num_layers] = h  # the final-normed stream (llama.py's convention)
    logits = logits_head(output_head(params.embed, params.lm_head), h, batch, steps, logit_indices)  # [B, P, V]
    hidden_out = tuple(hiddens[i].reshape(cfg.dim, batch, steps).transpose(1, 2, 0) for i in hidden_layers)

    pending = None
    if recorded:
        fields = {name: tuple(r[name] for r in recorded) for name in recorded[0]}
        pending = RecordedSteps(**fields) if delta_rule is DeltaRule.RECURRENT else ChunkedSteps(**fields)
    cache = cache.replace(keys=tuple(new_keys), values=tuple(new_values), pending=pending)
    return logits, hidden_out, cache


# ----------------------------------------------------------------------------------------------
# Params: random init (shapes, axes and checkpoint names: the family descriptor at the end)
# ----------------------------------------------------------------------------------------------


@struct.dataclass
class FullAttentionLayer:
    """A gated-attention layer: QK-norm, partial RoPE, sigmoid output gate (no biases)."""

    attn_norm: jax.Array = param(axes=("embed",))  # [D]
    attention: AttentionParams  # q_proj [N*2H, D]; k_proj, v_proj [K*H, D]; o_proj [D, N*H]; q/k_norm [H]
    mlp_norm: jax.Array = param(axes=("embed",))  # [D]
    mlp: MlpParams


@struct.dataclass
class DeltaNetLayer:
    """A Gated DeltaNet (linear attention) layer."""

    attn_norm: jax.Array = param(axes=("embed",))  # [D]
    delta_net: DeltaNetParams
    mlp_norm: jax.Array = param(axes=("embed",))  # [D]
    mlp: MlpParams


@struct.dataclass
class Qwen35Params:
    """A Qwen3.5 hybrid trunk's params."""

    embed: jax.Array = param(axes=("vocab", "embed"), linear=True)  # [V, D]
    layers: tuple[FullAttentionLayer | DeltaNetLayer, ...]  # by cfg.layer_types
    final_norm: jax.Array = param(axes=("embed",))  # [D]
    lm_head: jax.Array | None = param(axes=("vocab", "embed"), linear=True)  # [V, D]; None when cfg.tie_embeddings


_LAYER_TYPES = {LayerType.FULL_ATTENTION: FullAttentionLayer, LayerType.LINEAR_ATTENTION: DeltaNetLayer}
# The array fields (not the static channel-order flag, which a checkpoint's order leaves False).
_DELTA_NET_NAMES = tuple(field.name for field in dataclasses.fields(DeltaNetParams) if "axes" in field.metadata)


def layer_from(kind: LayerType, leaf: Callable[[str], Any]) -> FullAttentionLayer | DeltaNetLayer:
    """One layer of `kind`, each param `leaf(name)` (names: `layer_shapes`' keys, in that order)."""
    attn_norm = leaf("attn_norm")
    if kind is LayerType.FULL_ATTENTION:
        attention = AttentionParams(q_proj=leaf("q_proj"), k_proj=leaf("k_proj"), v_proj=leaf("v_proj"),
                                    o_proj=leaf("o_proj"), q_bias=None, k_bias=None, v_bias=None,
                                    q_norm=leaf("q_norm"), k_norm=leaf("k_norm"))
    else:
        delta_net = DeltaNetParams(**{name: leaf(name) for name in _DELTA_NET_NAMES})
    mlp_norm = leaf("mlp_norm")
    mlp = MlpParams(gate_proj=leaf("gate_proj"), up_proj=leaf("up_proj"), down_proj=leaf("down_proj"))
    if kind is LayerType.FULL_ATTENTION:
        return FullAttentionLayer(attn_norm=attn_norm, attention=attention, mlp_norm=mlp_norm, mlp=mlp)
    return DeltaNetLayer(attn_norm=attn_norm, delta_net=delta_net, mlp_norm=mlp_norm, mlp=mlp)


def params_from(cfg: Qwen35Config, leaf: LeafFn) -> Qwen35Params:
    """The params tree of `cfg`, each param `leaf(name, layer index)` (index None at the top:
    embed, final_norm, lm_head), asked in checkpoint order: embed, layer by layer, the rest."""
    return trunk_params(Qwen35Params, cfg, leaf, lambda index, layer_leaf: layer_from(cfg.layer_types[index], layer_leaf))


def init_params(cfg: Qwen35Config, key: jax.Array, scale: float = 0.02) -> Qwen35Params:
    """Random params of the right shapes (tests and benchmarks of untrained shapes).

    Norm multipliers are 1 + noise, decay rates A in [0.05, 0.5] so the recurrent state keeps a
    memory over tens of tokens (which a wrong rollback would show in the output). All draws come
    from one normal and one uniform call, so building params costs two RNG programs, not 40.
    """
    # Drawn over a name-keyed tree in jax's sorted-key leaf order, so a seed keeps its params.
    by_name = {"embed": (cfg.vocab_size, cfg.dim), "layers": [layer_shapes(cfg, kind) for kind in cfg.layer_types],
               "final_norm": (cfg.dim,)}
    if not cfg.tie_embeddings:
        by_name["lm_head"] = (cfg.vocab_size, cfg.dim)
    shapes = jax.tree.leaves(by_name, is_leaf=is_shape)
    normal_key, uniform_key = jax.random.split(key)
    sizes = [math.prod(shape) for shape in shapes]
    flat = np.asarray(jax.random.normal(normal_key, (sum(sizes),), jnp.float32)) * scale
    uniform = np.asarray(jax.random.uniform(uniform_key, (len(cfg.linear_layers), cfg.linear_num_value_heads),
                                            minval=0.05, maxval=0.5))
    pieces = iter(np.split(flat, np.cumsum(sizes)[:-1]))
    params = jax.tree.map(lambda shape: next(pieces).reshape(shape), by_name, is_leaf=is_shape)
    params["final_norm"] = 1.0 + params["final_norm"]
    for index, layer in zip(cfg.linear_layers, uniform):
        params["layers"][index]["conv_weight"] *= 0.3 / scale
        params["layers"][index]["A_log"] = np.log(layer)
        params["layers"][index]["dt_bias"] = 1.0 + params["layers"][index]["dt_bias"]
    for layer in params["layers"]:
        for norm in ("attn_norm", "mlp_norm", "q_norm", "k_norm", "out_norm"):
            if norm in layer:
                layer[norm] = 1.0 + layer[norm]
    params = jax.tree.map(jnp.asarray, params)
    return params_from(cfg, lambda name, index: params[name] if index is None else params["layers"][index][name])


# ----------------------------------------------------------------------------------------------
# The family descriptor: shapes, HF config.json and tensor names
# ----------------------------------------------------------------------------------------------

def layer_shapes(cfg: Qwen35Config, kind: LayerType) -> dict[str, tuple[int, ...]]:
    """Shapes of one layer's params: the shared norms and MLP around `kind`'s mixer."""
    D, F = cfg.dim, cfg.ffn_dim
    if kind is LayerType.FULL_ATTENTION:
        N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        mixer = {"q_proj": (2 * N * H, D), "k_proj": (K * H, D), "v_proj": (K * H, D), "o_proj": (D, N * H),
                 "q_norm": (H,), "k_norm": (H,)}
    else:
        E = cfg.linear_num_value_heads
        mixer = {"qkv_proj": (cfg.conv_dim, D), "z_proj": (cfg.value_dim, D), "b_proj": (E, D),
                 "a_proj": (E, D), "conv_weight": (cfg.conv_dim, cfg.linear_conv_kernel), "A_log": (E,),
                 "dt_bias": (E,), "out_norm": (cfg.linear_value_head_dim,), "out_proj": (D, cfg.value_dim)}
    return {"attn_norm": (D,), **mixer, "mlp_norm": (D,), "gate_proj": (F, D), "up_proj": (F, D),
            "down_proj": (D, F)}


def param_shapes(cfg: Qwen35Config) -> Qwen35Params:
    """The params tree with shape tuples as leaves (what every loader must produce)."""
    top = {"embed": (cfg.vocab_size, cfg.dim), "final_norm": (cfg.dim,), "lm_head": (cfg.vocab_size, cfg.dim)}
    layers = [layer_shapes(cfg, kind) for kind in cfg.layer_types]
    return params_from(cfg, lambda name, index: top[name] if index is None else layers[index][name])


HF_MODEL_TYPES = ("qwen3_5", "qwen3_5_text")

# Norms HF stores zero-centred (applied as x * (1 + w)); the loader stores 1 + w.
_ZERO_CENTRED = frozenset({"attn_norm", "mlp_norm", "q_norm", "k_norm", "final_norm"})
_HF_TOP = {"embed": "embed_tokens.weight", "final_norm": "norm.weight"}
_HF_COMMON = {"attn_norm": "input_layernorm.weight", "mlp_norm": "post_attention_layernorm.weight",
              "gate_proj": "mlp.gate_proj.weight", "up_proj": "mlp.up_proj.weight",
              "down_proj": "mlp.down_proj.weight"}
_HF_MIXER = {
    LayerType.FULL_ATTENTION: {"q_proj": "self_attn.q_proj.weight", "k_proj": "self_attn.k_proj.weight",
                               "v_proj": "self_attn.v_proj.weight", "o_proj": "self_attn.o_proj.weight",
                               "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight"},
    LayerType.LINEAR_ATTENTION: {"qkv_proj": "linear_attn.in_proj_qkv.weight",
                                 "z_proj": "linear_attn.in_proj_z.weight",
                                 "b_proj": "linear_attn.in_proj_b.weight",
                                 "a_proj": "linear_attn.in_proj_a.weight",
                                 "conv_weight": "linear_attn.conv1d.weight", "A_log": "linear_attn.A_log",
                                 "dt_bias": "linear_attn.dt_bias", "out_norm": "linear_attn.norm.weight",
                                 "out_proj": "linear_attn.out_proj.weight"},
}
# Prefixes of the text trunk's tensors: ForConditionalGeneration, ForCausalLM, bare text model.
_HF_PREFIXES = ("model.language_model.", "model.", "")
# Options HF's qwen3_5 accepts that this trunk does not implement, and the value it needs.
_UNSUPPORTED = {"hidden_act": "silu", "attention_bias": False, "num_experts": None}
DEFAULT_ROPE_THETA = 10_000_000.0  # HF's Qwen3.5 default, when config.json names none


def config_from_hf(hf: Mapping[str, Any], *, rollback_states: int = 8, recorded_steps: int = 16) -> Qwen35Config:
    """Parse a `qwen3_5` or `qwen3_5_text` config.json. Errors name the offending field.

    RoPE theta and scaling are read by `config._rope_settings`, as for every Llama-family trunk.
    rollback_states and recorded_steps are jaxspec's own (not in config.json): see Qwen35Config."""
    model_type = hf.get("model_type")
    if model_type not in HF_MODEL_TYPES:
        raise UnsupportedModelError(f"model_type {model_type!r} is not a Qwen3.5 hybrid ({HF_MODEL_TYPES})")
    text = hf
    if model_type == "qwen3_5":
        text = hf.get("text_config")
        if not isinstance(text, Mapping):
            raise UnsupportedModelError("config.json of model_type 'qwen3_5' lacks a 'text_config' object")
    for field, supported in _UNSUPPORTED.items():
        value = text.get(field, supported)
        if value != supported and not (supported is None and not value):
            raise UnsupportedModelError(f"{field}={value!r} is not supported by the Qwen3.5 trunk (needs {supported!r})")
    try:
        num_layers = count(text["num_hidden_layers"])
        layer_types = text.get("layer_types")
        if layer_types is None:  # HF's default pattern: every `full_attention_interval`-th layer
            interval = count(text.get("full_attention_interval", 4))
            layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                           for i in range(num_layers)]
        if len(layer_types) != num_layers:
            raise UnsupportedModelError(
                f"layer_types has {len(layer_types)} entries but num_hidden_layers is {num_layers}")
        kinds = []
        for index, name in enumerate(layer_types):
            try:
                kinds.append(LayerType(name))
            except ValueError:
                raise UnsupportedModelError(
                    f"layer_types[{index}]={name!r} is not supported (only {[t.value for t in LayerType]})") from None
        rope_fields = dict(text)
        if rope_fields.get("rope_theta") is None:
            rope_fields["rope_theta"] = DEFAULT_ROPE_THETA
        rope = text.get("rope_parameters") or {}
        dim, num_heads = count(text["hidden_size"]), count(text["num_attention_heads"])
        head_dim = count(text.get("head_dim") or dim // num_heads)
        if "rotary_dim" not in text and "partial_rotary_factor" not in text and "partial_rotary_factor" not in rope:
            rope_fields["partial_rotary_factor"] = 0.25  # HF's default for Qwen3.5 (before the parse: longrope checks it)
        try:
            theta, scaling = _rope_settings(rope_fields)
        except UnsupportedModelError as err:
            raise UnsupportedModelError(f"rope_parameters (rope_type): {err}") from None
        tie = hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        eos = text.get("eos_token_id", hf.get("eos_token_id"))
        bos = text.get("bos_token_id", hf.get("bos_token_id"))
        return Qwen35Config(
            vocab_size=count(text["vocab_size"]),
            dim=dim,
            num_layers=num_layers,
            layer_types=tuple(kinds),
            ffn_dim=count(text["intermediate_size"]),
            num_heads=num_heads,
            num_kv_heads=count(text.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            rotary_dim=resolve_rotary_dim(rope_fields, head_dim),
            rope_theta=theta,
            rope_scaling=scaling,
            linear_num_key_heads=count(text["linear_num_key_heads"]),
            linear_num_value_heads=count(text["linear_num_value_heads"]),
            linear_key_head_dim=count(text["linear_key_head_dim"]),
            linear_value_head_dim=count(text["linear_value_head_dim"]),
            linear_conv_kernel=count(text.get("linear_conv_kernel_dim", 4)),
            norm_eps=real(text.get("rms_norm_eps", 1e-6)),
            # longrope is exact only up to its original context (config.RopeScaling.context_limit)
            max_position_embeddings=min(count(text.get("max_position_embeddings", 2048)),
                                        (scaling.context_limit if scaling is not None else None) or 1 << 62),
            tie_embeddings=flag(tie, "tie_word_embeddings"),
            bos_token_id=None if bos is None else count(bos),
            eos_token_ids=eos_ids(eos),
            rollback_states=rollback_states,
            recorded_steps=recorded_steps,
        )
    except KeyError as missing:
        raise UnsupportedModelError(f"config.json lacks required field {missing}") from None


def _add_one(stored: np.ndarray) -> np.ndarray:
    return stored + 1.0  # zero-centred norm -> multiplier


def _conv_kernel(stored: np.ndarray) -> np.ndarray:
    return stored[:, 0] if stored.ndim == 3 else stored  # HF Conv1d [C, 1, W] -> [C, W]


def _hf_source(key: str, name: str, note: str = "") -> TensorSource:
    transform = _add_one if key in _ZERO_CENTRED else _conv_kernel if key == "conv_weight" else None
    return TensorSource(name, transform, note)


def hf_tensors(cfg: Qwen35Config, prefix: str) -> Qwen35Params:
    """The params tree of HF tensor names under `prefix` (one of _HF_PREFIXES), with transforms."""

    def source(key: str, index: int | None) -> TensorSource:
        if key == "lm_head":
            return TensorSource("lm_head.weight", note=" (tie_word_embeddings is false)")
        if index is None:
            return _hf_source(key, prefix + _HF_TOP[key])
        kind = cfg.layer_types[index]
        return _hf_source(key, f"{prefix}layers.{index}.{({**_HF_COMMON, **_HF_MIXER[kind]})[key]}",
                          f" (layer {index} is {kind.value} per config layer_types)")

    return params_from(cfg, source)


def config_to_dict(cfg: Qwen35Config) -> dict[str, Any]:
    """JSON-able form of a Qwen35Config (what a converted directory stores)."""
    return to_json_dict(cfg)


def config_from_dict(data: Mapping[str, Any]) -> Qwen35Config:
    """Inverse of config_to_dict."""
    return from_json_dict(Qwen35Config, data, layer_types=lambda kinds: tuple(LayerType(kind) for kind in kinds))



def _refuse_trees(cfg: Qwen35Config, depth: int, whose: str) -> None:
    """A DeltaNet layer keeps one recurrent state per position, and a tree's siblings share one."""
    raise UnsupportedModelError(
        f"the {whose} is a Qwen3.5 hybrid: its DeltaNet layers carry one recurrent state per position, "
        f"not per tree node, so draft trees are not supported; use a chain (tree=None)")


def _with_rollback_ring(cfg: Qwen35Config, steps: int, recorded: int) -> Qwen35Config:
    """A config whose state ring holds `steps` states back and whose forwards record `recorded`."""
    return dataclasses.replace(cfg, rollback_states=max(cfg.rollback_states, steps),
                               recorded_steps=max(cfg.recorded_steps, recorded))

FAMILY = Family(
    name="qwen3_5",
    config_class=Qwen35Config,
    params_class=Qwen35Params,
    forward=forward,
    create_cache=Qwen35Cache.create,
    hf_model_types=HF_MODEL_TYPES,
    config_from_hf=config_from_hf,
    hf_prefixes=_HF_PREFIXES,
    hf_embed=_HF_TOP["embed"],
    hf_tensors=hf_tensors,
    architecture=lambda cfg: "qwen3_5",
    param_shapes=param_shapes,
    config_to_dict=config_to_dict,
    config_from_dict=config_from_dict,
    check_tree=_refuse_trees,
    with_rollback=_with_rollback_ring,
    takes_filler_tokens=False,
)
