"""Trunks and draft heads: pure forward functions over params pytrees, and the family registry.

`forward` and `create_cache` dispatch on the config's type, so the loop and the proposers run
any trunk: each trunk module describes itself with a `Family` (jaxspec.models.family) and is
registered here. Every trunk honours one contract:

    forward(params, cfg, tokens [B, T], cache, *, positions=None, logit_indices=None,
            hidden_layers=()) -> (logits [B, P, V], hiddens, cache)

writing the T new tokens at each row's `cache.length` without advancing it; the caller commits
with `cache.advance(n)` / `cache.set_length(...)` (docs/design.md, "One cache protocol, rollback by length").

Params are typed pytrees (`flax.struct` dataclasses, jaxspec.models.params) whose fields carry
their logical axis names; a family's `param_shapes` and checkpoint tensor trees are the same types.

The same registry is how the checkpoint readers find a family: by config type, by HF
`model_type`, by GGUF `general.architecture`, or by the name a converted directory records.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxspec.errors import InvalidRequestError, UnsupportedModelError
from jaxspec.models import gemma, llama, qwen35
from jaxspec.models.family import Family

FAMILIES: dict[str, Family] = {}  # family name -> descriptor, in registration order


def register_family(family: Family) -> None:
    """Add a trunk family; its name, config class, HF model_types and GGUF architectures must be new
    (a clash is a bug in the registry, not bad input: RuntimeError)."""
    for other in FAMILIES.values():
        claimed = (set(family.hf_model_types) & set(other.hf_model_types)
                   | set(family.gguf_architectures) & set(other.gguf_architectures))
        if family.name == other.name or family.config_class is other.config_class or claimed:
            raise RuntimeError(f"family {family.name!r} overlaps the registered {other.name!r}")
    FAMILIES[family.name] = family


register_family(llama.FAMILY)
register_family(qwen35.FAMILY)
register_family(gemma.FAMILY)


def family_of(cfg: Any) -> Family:
    """The family whose config class `cfg` is (exact type: a subclass is a different family);
    UnsupportedModelError for any other config (a draft head's is not a trunk's)."""
    for family in FAMILIES.values():
        if type(cfg) is family.config_class:
            return family
    raise UnsupportedModelError(f"no trunk family registered for config type {type(cfg).__name__}")


def is_trunk(cfg: Any) -> bool:
    """Whether `cfg` is a registered trunk's config (not a draft head's)."""
    return any(type(cfg) is family.config_class for family in FAMILIES.values())


def family_named(name: str) -> Family:
    try:
        return FAMILIES[name]
    except (KeyError, TypeError):  # TypeError: an unhashable name (a list read from a file)
        raise UnsupportedModelError(f"model family {name!r} is not known; jaxspec has {sorted(FAMILIES)}") from None


def family_for_hf(hf: Mapping[str, Any]) -> Family:
    """The family that claims an HF config.json's `model_type`."""
    model_type = hf.get("model_type")
    for family in FAMILIES.values():
        if isinstance(model_type, str) and model_type in family.hf_model_types:
            return family
    supported = sorted(t for family in FAMILIES.values() for t in family.hf_model_types)
    raise UnsupportedModelError(f"model_type {model_type!r} is not supported; jaxspec reads {supported}")


def family_for_gguf(architecture: str, source: str) -> Family:
    """The family that claims a GGUF file's `general.architecture`."""
    for family in FAMILIES.values():
        if architecture in family.gguf_architectures:
            return family
    supported = sorted(a for family in FAMILIES.values() for a in family.gguf_architectures)
    raise UnsupportedModelError(
        f"GGUF architecture {architecture!r} in {source} is not supported; jaxspec reads {supported}")


def forward(params, cfg, tokens, cache, **kwargs):
    family = family_of(cfg)
    if not isinstance(params, family.params_class):  # at trace time: before anything compiles
        raise InvalidRequestError(
            f"{family.name} params must be a {family.params_class.__name__}; got {type(params).__name__}")
    return family.forward(params, cfg, tokens, cache, **kwargs)


def create_cache(cfg, batch: int, capacity: int, **kwargs):
    return family_of(cfg).create_cache(cfg, batch, capacity, **kwargs)
