"""Trunks and draft heads: pure forward functions over params pytrees.

`forward` and `create_cache` dispatch on the config's type, so the loop and the proposers run
any trunk: a model module registers its config class with its forward and its cache factory.
Every trunk honours one contract:

    forward(params, cfg, tokens [B, T], cache, *, positions=None, logit_indices=None,
            hidden_layers=()) -> (logits [B, P, V], hiddens, cache)

writing the T new tokens at each row's `cache.length` without advancing it; the caller commits
with `cache.advance(n)` / `cache.set_length(...)` (rollback by length, DESIGN.md contract 2).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jaxspec.cache import KVCache
from jaxspec.config import ModelConfig
from jaxspec.models import llama, qwen35

# config class -> (forward, create_cache(cfg, batch, capacity))
_TRUNKS: dict[type, tuple[Callable[..., Any], Callable[..., Any]]] = {
    ModelConfig: (llama.forward, KVCache.create),
    qwen35.Qwen35Config: (qwen35.forward, qwen35.Qwen35Cache.create),
}


def register_trunk(config_class: type, forward_fn: Callable[..., Any], cache_factory: Callable[..., Any]) -> None:
    _TRUNKS[config_class] = (forward_fn, cache_factory)


def _trunk(cfg) -> tuple[Callable[..., Any], Callable[..., Any]]:
    try:
        return _TRUNKS[type(cfg)]
    except KeyError:
        raise TypeError(f"no trunk registered for config type {type(cfg).__name__}") from None


def forward(params, cfg, tokens, cache, **kwargs):
    return _trunk(cfg)[0](params, cfg, tokens, cache, **kwargs)


def create_cache(cfg, batch: int, capacity: int, **kwargs):
    return _trunk(cfg)[1](cfg, batch, capacity, **kwargs)
