"""Frozen, hashable model configs (static under jit), HF config.json parsing, and the JSON form.

Every checkpoint reader (HF directories, GGUF files) of a Llama-family trunk ends in a
`ModelConfig`; the RoPE width is resolved here once, by `resolve_rotary_dim`, and RoPE theta and
scaling by `_rope_settings`, so the readers (Qwen3.5's included) cannot disagree about them.
`config_to_dict` / `config_from_dict` are the form a converted directory stores.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import numbers
from collections.abc import Mapping
from typing import Any

from jaxspec.errors import CheckpointError, UnsupportedModelError, is_integer


class Architecture(enum.Enum):
    """Trunk families sharing the Llama forward (GQA, RMSNorm, SwiGLU, rotate-half RoPE)."""

    LLAMA = "llama"  # Llama 2/3, SmolLM2
    MISTRAL = "mistral"
    QWEN2 = "qwen2"  # q/k/v projection bias
    QWEN3 = "qwen3"  # per-head RMSNorm on q and k (QK-norm), no bias


# HF `model_type` / `architectures[0]` -> family.
HF_MODEL_TYPES = {
    "llama": Architecture.LLAMA,
    "mistral": Architecture.MISTRAL,
    "qwen2": Architecture.QWEN2,
    "qwen3": Architecture.QWEN3,
    "mellum": Architecture.QWEN3,  # dense, full-attention Mellum: Qwen3 layers (see _per_layer_type_view)
}


class RopeType(str, enum.Enum):
    """RoPE frequency schemes (transformers' `rope_type`) that a static KV cache serves exactly.

    A str enum, so a config holding one serialises to JSON as its name.
    """

    DEFAULT = "default"
    LINEAR = "linear"  # positions interpolated: every frequency divided by `factor`
    LLAMA3 = "llama3"  # Llama 3.1: low frequencies divided by `factor`, high kept, a ramp between
    YARN = "yarn"  # NTK-by-parts ramp between interpolation and extrapolation, plus cos/sin scaled
    LONGROPE = "longrope"  # per-frequency `short_factor` divisors, plus cos/sin scaled
    # Dynamic NTK: transformers grows theta only once a sequence passes max_position_embeddings;
    # within it the frequencies are the default ones, and jaxspec never serves past it.
    DYNAMIC = "dynamic"
    # Gemma 4's full-attention layers: the first `rotated_fraction` of the head's frequency pairs
    # turn (exponents over the whole head width), the rest have frequency 0, and rotate-half pairs
    # dim i with i + H/2 across the whole head. Only trunks that ask for it (gemma.py) parse it.
    PROPORTIONAL = "proportional"


# Types transformers knows that jaxspec refuses, and why (a static cache cannot follow them).
_REFUSED_ROPE_TYPES = {
    "proportional": "it pairs rotated dims across the whole head (Gemma 4), not within the leading rotary_dim",
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """How RoPE's inverse frequencies (and, for yarn and longrope, cos/sin) are scaled.

    `jaxspec.models.layers.rope_inv_freq` turns it into frequencies; the fields each type needs:
        LINEAR, DYNAMIC: factor
        LLAMA3: factor, low_freq_factor, high_freq_factor, original_max_position_embeddings
        YARN: factor, original_max_position_embeddings, beta_fast, beta_slow, truncate, and
            attention_factor or (mscale, mscale_all_dim) for the cos/sin scale
        LONGROPE: short_factor (one divisor per frequency), original_max_position_embeddings,
            factor and attention_factor for the cos/sin scale. transformers switches a whole
            forward to `long_factor` once the sequence passes original_max_position_embeddings,
            which keys already cached cannot follow; jaxspec serves the context up to it
            (`context_limit`), where the short factors are exact.
    """

    rope_type: RopeType
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    beta_fast: float = 32.0  # yarn: rotations per context above which dims are extrapolated
    beta_slow: float = 1.0  # yarn: below which they are interpolated
    truncate: bool = True  # yarn: round the correction range to whole dims
    mscale: float | None = None  # yarn (DeepSeek): attention factor numerator's log multiplier
    mscale_all_dim: float | None = None  # yarn (DeepSeek): its denominator's
    attention_factor: float | None = None  # yarn, longrope: explicit cos/sin scale (else derived)
    short_factor: tuple[float, ...] | None = None  # longrope: R/2 divisors
    rotated_fraction: float = 1.0  # proportional: the share of the head's frequency pairs that turn

    def __post_init__(self):
        # Coerce what a JSON round trip returns (a str, a list) back to the hashable types.
        try:
            object.__setattr__(self, "rope_type", RopeType(self.rope_type))
        except ValueError:
            raise UnsupportedModelError(
                f"rope scaling type {self.rope_type!r} is not supported; jaxspec reads "
                f"{[t.value for t in RopeType]}") from None
        if self.short_factor is not None:
            object.__setattr__(self, "short_factor", tuple(real(f) for f in self.short_factor))
        needed = {
            RopeType.LLAMA3: ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
            RopeType.YARN: ("original_max_position_embeddings",),
            RopeType.LONGROPE: ("short_factor", "original_max_position_embeddings"),
        }.get(self.rope_type, ())
        missing = [name for name in needed if getattr(self, name) is None]
        if missing:
            raise UnsupportedModelError(f"rope scaling {self.rope_type.value!r} needs {missing}")
        if self.factor <= 0:
            raise UnsupportedModelError(f"rope scaling factor={self.factor} must be > 0")
        if not 0.0 <= self.rotated_fraction <= 1.0:
            raise UnsupportedModelError(f"rope partial_rotary_factor={self.rotated_fraction} must be in [0, 1]")

    @property
    def attention_scale(self) -> float:
        """The factor on cos and sin (transformers' `attention_scaling`); 1 for most types."""
        if self.attention_factor is not None:
            return self.attention_factor
        if self.rope_type is RopeType.YARN:
            def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
                return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0
            if self.mscale and self.mscale_all_dim:
                return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
            return yarn_mscale(self.factor)
        if self.rope_type is RopeType.LONGROPE and self.factor > 1.0:
            return math.sqrt(1 + math.log(self.factor) / math.log(self.original_max_position_embeddings))
        return 1.0

    @property
    def context_limit(self) -> int | None:
        """The longest context the scaling is exact for, if it has one (longrope; see above)."""
        return self.original_max_position_embeddings if self.rope_type is RopeType.LONGROPE else None




@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape and numerics of a Llama-family trunk.

    Its fields name the dimension letters of jaxspec's shape comments (V, D, L, N, K, H, F,
    below); beside them B is the batch's rows, T the new tokens per row, S the cache's slots and
    G = N / K the query heads per kv head. A module that needs more letters says which in its
    docstring.
    """

    architecture: Architecture = Architecture.LLAMA
    vocab_size: int  # V
    dim: int  # D
    num_layers: int  # L
    num_heads: int  # N
    num_kv_heads: int  # K
    head_dim: int  # H
    ffn_dim: int  # F
    rope_theta: float = 10000.0
    rotary_dim: int  # leading dims of each head that RoPE rotates (<= H, even)
    rope_scaling: RopeScaling | None = None
    norm_eps: float = 1e-6
    max_position_embeddings: int = 2048  # the context: prompt + new tokens never exceed it
    tie_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projection bias (Qwen2)
    qk_norm: bool = False  # RMSNorm over H on q and k before RoPE (Qwen3)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        check_sizes_and_numerics(self, ("vocab_size", "dim", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                                        "ffn_dim", "max_position_embeddings"))
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise UnsupportedModelError(
                f"rotary_dim={self.rotary_dim} must be even and in (0, head_dim={self.head_dim}]"
            )

    @property
    def kv_layout(self) -> tuple[tuple[int, int], ...]:
        """(kv heads, head dim) of each cache buffer (`cache.kv_layout`): one per layer."""
        return ((self.num_kv_heads, self.head_dim),) * self.num_layers

    @property
    def group_size(self) -> int:  # G: query heads per kv head
        return self.num_heads // self.num_kv_heads


def count(value: Any) -> int:
    """A config's integer, strictly: an int, or a float holding a whole number (exporters write
    32.0). A bool, a string ("32") or 2.5 raises CheckpointError (`config_values_checked` names
    the file): int() would take "32" and silently truncate 2.5."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise CheckpointError(f"expected an integer, got {value!r:.40}")
    if isinstance(value, numbers.Integral):
        return int(value)
    if not float(value).is_integer():
        raise CheckpointError(f"expected an integer, got {value!r}")
    return int(value)


def real(value: Any) -> float:
    """A config's number, strictly: an int or a float, never a bool or a numeric string."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise CheckpointError(f"expected a number, got {value!r:.40}")
    return float(value)


def check_token_ids(cfg: Any) -> None:
    """bos/eos ids are ids of this vocabulary: an id outside [0, vocab_size) could never be sampled
    (an EOS that never stops) or embedded (a BOS that indexes past the table)."""
    bos = getattr(cfg, "bos_token_id", None)  # a draft head's config has neither
    ids = [("bos_token_id", bos)] if bos is not None else []
    ids += [("eos_token_id", token) for token in getattr(cfg, "eos_token_ids", ())]
    for name, token in ids:
        if not is_integer(token) or not 0 <= token < cfg.vocab_size:
            raise UnsupportedModelError(f"{name}={token!r} is not a token id of the {cfg.vocab_size}-token vocabulary")


# The range every real checkpoint's value falls in, for the config numbers a corrupt file would
# otherwise load silently (an epsilon of 1e9 flattens every norm to zero): RMSNorm epsilons run
# 1e-12 (BERT-era) to 1e-5, RoPE bases 1e2 (test models) to 1e8 (long-context Qwen and Llama 4 use
# 5e5-1e7). A value outside is refused with the range.
SANE_RANGES = {"norm_eps": (1e-12, 1e-2), "rope_theta": (1.0, 1e10)}


def check_sizes_and_numerics(cfg: Any, sizes: tuple[str, ...]) -> None:
    """UnsupportedModelError unless every field in `sizes` is >= 1 and rope_theta and norm_eps are
    finite and in `SANE_RANGES`: a zero dimension, a NaN theta or an epsilon no model has would
    otherwise load and compute garbage (a NaN theta makes every RoPE angle NaN, and generate
    returns zeros)."""
    for name in sizes:
        value = getattr(cfg, name)
        if not is_integer(value):
            raise UnsupportedModelError(f"{name}={value!r} must be an integer")
        if value < 1:
            raise UnsupportedModelError(f"{name}={value} must be >= 1")
    for name in SANE_RANGES:
        check_sane(name, getattr(cfg, name))
    check_token_ids(cfg)


def check_sane(name: str, value: float) -> None:
    """UnsupportedModelError unless `value` is finite and in SANE_RANGES[name]."""
    low, high = SANE_RANGES[name]
    if not (math.isfinite(value) and value > 0):
        raise UnsupportedModelError(f"{name}={value} must be a finite number > 0")
    if not low <= value <= high:
        raise UnsupportedModelError(f"{name}={value} is outside [{low:g}, {high:g}], the range real models use")


def flag(value: Any, name: str) -> bool:
    """A config's boolean: true/false (or 0/1). A string such as "false" is refused: bool("false")
    is True, and a truthy string would silently drop a tied model's lm_head."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise CheckpointError(f"{name} must be true or false; got {value!r}")


def resolve_rotary_dim(hf: Mapping[str, Any], head_dim: int) -> int:
    """RoPE width, one rule for every reader.

    Explicit `rotary_dim` wins; else `partial_rotary_factor` (top level, or under
    `rope_parameters`) times the head dim; else the full head dim. A malformed factor (<= 0 or
    > 1) is ignored and the full width is used, as the CUDA seed's config tests pin it.
    """
    explicit = hf.get("rotary_dim")
    if explicit is not None:
        return count(explicit)
    factor = hf.get("partial_rotary_factor")
    if factor is None and isinstance(hf.get("rope_parameters"), Mapping):
        factor = hf["rope_parameters"].get("partial_rotary_factor")
    if factor is None:
        return head_dim
    factor = real(factor)
    if not 0.0 < factor <= 1.0:
        return head_dim
    return int(head_dim * factor)


def _rope_settings(hf: Mapping[str, Any], *, proportional: bool = False) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from `rope_theta`/`rope_scaling` or transformers 5's `rope_parameters`.

    Fields default as transformers' `standardize_rope_params` and `ROPE_INIT_FUNCTIONS` default
    them: original_max_position_embeddings from the top level or max_position_embeddings; a yarn
    or longrope `factor` left out is max_position_embeddings / original. A type jaxspec cannot
    serve exactly is refused by name, with the reason. `proportional`: the trunk applies Gemma 4's
    proportional RoPE over the whole head (rotary_dim = head_dim), so that type is read, not refused.
    """
    params = hf.get("rope_parameters")
    scaling = hf.get("rope_scaling")
    theta = hf.get("rope_theta")
    if isinstance(params, Mapping):
        theta = params.get("rope_theta", theta)
        if scaling is None and params.get("rope_type", "default") != "default":
            scaling = params
    theta = real(theta if theta is not None else 10000.0)
    if not scaling:
        return theta, None
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type == RopeType.PROPORTIONAL.value and proportional:
        fraction = scaling.get("partial_rotary_factor", 1.0)
        return theta, RopeScaling(rope_type=RopeType.PROPORTIONAL, factor=real(scaling.get("factor", 1.0)),
                                  rotated_fraction=real(fraction))
    if rope_type in _REFUSED_ROPE_TYPES:
        raise UnsupportedModelError(f"rope scaling type {rope_type!r} is not supported: {_REFUSED_ROPE_TYPES[rope_type]}")
    if rope_type not in {t.value for t in RopeType}:
        raise UnsupportedModelError(
            f"rope scaling type {rope_type!r} is not supported; jaxspec reads {[t.value for t in RopeType]}")

    def number(name: str, convert=float):
        value = scaling.get(name)
        return None if value is None else convert(value)

    context = hf.get("max_position_embeddings")
    original = hf.get("original_max_position_embeddings", scaling.get("original_max_position_embeddings", context))
    original = None if original is None else count(original)
    factor = number("factor")
    if factor is None and rope_type in ("yarn", "longrope") and context is not None and original:
        factor = int(context) / original
    if factor is None and rope_type != "longrope":
        raise UnsupportedModelError(f"rope scaling {rope_type!r} lacks its 'factor'")
    short_factor = scaling.get("short_factor")
    if short_factor is not None and "hidden_size" in hf and "num_attention_heads" in hf:
        head_dim = count(hf.get("head_dim") or count(hf["hidden_size"]) // count(hf["num_attention_heads"]))
        if len(short_factor) != resolve_rotary_dim(hf, head_dim) // 2:
            raise UnsupportedModelError(
                f"rope scaling 'longrope' short_factor has {len(short_factor)} entries; the rotated width "
                f"{resolve_rotary_dim(hf, head_dim)} needs one per frequency, {resolve_rotary_dim(hf, head_dim) // 2}")
    return theta, RopeScaling(
        rope_type=RopeType(rope_type),
        factor=1.0 if factor is None else factor,
        original_max_position_embeddings=original,
        low_freq_factor=number("low_freq_factor"),
        high_freq_factor=number("high_freq_factor"),
        beta_fast=number("beta_fast") or 32.0,
        beta_slow=number("beta_slow") or 1.0,
        truncate=flag(scaling.get("truncate", True), "rope_scaling.truncate"),
        mscale=number("mscale"),
        mscale_all_dim=number("mscale_all_dim"),
        attention_factor=number("attention_factor"),
        short_factor=None if short_factor is None else tuple(real(f) for f in short_factor),
    )


def eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, numbers.Real):
        return (count(value),)
    if not isinstance(value, list):
        raise CheckpointError(f"eos_token_id must be a token id or a list of them; got {value!r:.40}")
    return tuple(count(v) for v in value)


def gguf_vocab_size(tensor_shapes: Mapping[str, tuple[int, ...]], embed: str, dim: int, source: Any) -> int:
    """The vocabulary a GGUF's params serve: the rows of its embedding `embed`, which must be
    [rows, dim] (numpy order) before anything is sized by it."""
    shape = tuple(tensor_shapes[embed])
    if len(shape) != 2 or shape[1] != dim or shape[0] < 1:
        raise CheckpointError(f"tensor {embed!r} in {source} has shape {shape}, expected (vocab_size, {dim}) "
                              "from the config")
    return shape[0]


def gguf_eos_ids(meta: Mapping[str, Any]) -> list[int]:
    """A GGUF's end-of-generation ids: `tokenizer.ggml.eos_token_id`, `eot_token_id`,
    `eom_token_id`, each once, in that order."""
    ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        token = meta.get(f"tokenizer.ggml.{key}")
        if token is not None and count(token) not in ids:
            ids.append(count(token))
    return ids


def _per_layer_type_view(hf: Mapping[str, Any], layer_type: str = "full_attention") -> dict[str, Any]:
    """A config with per-layer-type fields (Mellum) seen as one uniform stack of `layer_type`.

    Mellum declares `layer_types` (full or sliding attention), `mlp_layer_types` (dense or
    sparse MoE) and one `rope_parameters` entry per attention type. jaxspec runs it when every
    layer is a dense full-attention layer, which is a Qwen3 layer (QK-norm, SwiGLU); anything else
    is refused by name rather than run wrongly.
    """
    view = dict(hf)
    for field, wanted in (("layer_types", "full_attention"), ("mlp_layer_types", "dense")):
        kinds = hf.get(field)
        if kinds is not None and any(kind != wanted for kind in kinds):
            raise UnsupportedModelError(
                f"{field} {sorted(set(kinds))}: jaxspec runs {hf.get('model_type')} only with every layer "
                f"{wanted!r}")
    rope = hf.get("rope_parameters")
    if isinstance(rope, Mapping) and isinstance(rope.get(layer_type), Mapping):
        view["rope_parameters"] = rope[layer_type]
    return view


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    """Parse an HF `config.json` dict. Raises UnsupportedModelError naming what is unsupported."""
    model_type = hf.get("model_type")
    if model_type not in HF_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; jaxspec reads {sorted(HF_MODEL_TYPES)}"
        )
    if model_type == "mellum":
        hf = _per_layer_type_view(hf)
    architecture = HF_MODEL_TYPES[model_type]
    if hf.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act {hf['hidden_act']!r} is not supported (only 'silu')")
    try:
        dim = count(hf["hidden_size"])
        num_heads = count(hf["num_attention_heads"])
        head_dim = count(hf.get("head_dim") or dim // num_heads)
        theta, scaling = _rope_settings(hf)
        context = count(hf.get("max_position_embeddings", 2048))
        if scaling is not None and scaling.context_limit:
            context = min(context, scaling.context_limit)  # longrope: exact only up to here
        if hf.get("use_sliding_window", model_type == "mistral") and hf.get("sliding_window"):
            # Attention is full up to the window; past it the model would need a ring cache.
            context = min(context, count(hf["sliding_window"]))
        return ModelConfig(
            architecture=architecture,
            vocab_size=count(hf["vocab_size"]),
            dim=dim,
            num_layers=count(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=count(hf.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            ffn_dim=count(hf["intermediate_size"]),
            rope_theta=theta,
            rotary_dim=resolve_rotary_dim(hf, head_dim),
            rope_scaling=scaling,
            norm_eps=real(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=context,
            tie_embeddings=flag(hf.get("tie_word_embeddings", False), "tie_word_embeddings"),
            attention_bias=flag(hf.get("attention_bias", architecture is Architecture.QWEN2), "attention_bias"),
            qk_norm=architecture is Architecture.QWEN3,
            bos_token_id=None if hf.get("bos_token_id") is None else count(hf["bos_token_id"]),
            eos_token_ids=eos_ids(hf.get("eos_token_id")),
        )
    except KeyError as missing:
        raise UnsupportedModelError(f"config.json lacks required field {missing}") from None


def to_json_dict(cfg: Any) -> dict[str, Any]:
    """JSON-able form of a frozen config dataclass: enums by value, tuples as lists, nested
    dataclasses (a RopeScaling) as dicts. `from_json_dict` reads it back."""
    def plain(value: Any) -> Any:
        if isinstance(value, enum.Enum):
            return value.value
        if isinstance(value, (tuple, list)):
            return [plain(item) for item in value]
        if isinstance(value, dict):
            return {key: plain(item) for key, item in value.items()}
        return value

    return {name: plain(value) for name, value in dataclasses.asdict(cfg).items()}


def from_json_dict(config_class: type, data: Mapping[str, Any], **rebuild: Any) -> Any:
    """`config_class` from its `to_json_dict` form: the fields every config shares (eos ids, RoPE
    scaling) are rebuilt here, the class's own enums and tuples by `rebuild` (field -> function).
    Raises UnsupportedModelError on fields the class does not have (a newer jaxspec wrote them)."""
    fields = dict(data)
    unknown = set(fields) - {field.name for field in dataclasses.fields(config_class)}
    if unknown:
        raise UnsupportedModelError(
            f"config fields {sorted(unknown)} are not {config_class.__name__}'s (a newer jaxspec?)")
    fields["eos_token_ids"] = tuple(fields.get("eos_token_ids", ()))
    if "rope_scaling" in {field.name for field in dataclasses.fields(config_class)}:
        fields["rope_scaling"] = rope_scaling_from_dict(fields.get("rope_scaling"))
    for name, function in rebuild.items():
        if name in fields:
            fields[name] = function(fields[name])
    return config_class(**fields)


def config_to_dict(cfg: ModelConfig) -> dict[str, Any]:
    """JSON-able form of a ModelConfig (what a converted directory stores)."""
    return to_json_dict(cfg)


def config_from_dict(data: Mapping[str, Any]) -> ModelConfig:
    """Inverse of config_to_dict (a directory written before `architecture` was stored is Llama)."""
    return from_json_dict(ModelConfig, {"architecture": Architecture.LLAMA.value, **data}, architecture=Architecture)


def rope_scaling_from_dict(data: Mapping[str, Any] | None) -> RopeScaling | None:
    """A RoPE scaling written by `dataclasses.asdict` (converted directories), back as a dataclass.

    Directories converted before `RopeScaling` existed hold Llama-3 fields with no `rope_type`.
    """
    if data is None:
        return None
    return RopeScaling(**{"rope_type": RopeType.LLAMA3, **data})
