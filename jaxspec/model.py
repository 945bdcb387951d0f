"""`Model`: what `load` returns and `generate` takes, and the drafts derived from one.

A Model is a config (static, hashable), a params pytree (arrays) and, for a trunk loaded from a
checkpoint, its tokenizer. Draft heads (EAGLE-3, MTP) are Models too, with no tokenizer of their
own. Nothing here traces or compiles.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from jaxspec.errors import InvalidRequestError, is_integer
from jaxspec.models import layers
from jaxspec.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True, eq=False)
class Model:
    """What `load` returns and `generate` takes: config (static), params (arrays), tokenizer."""

    config: Any  # a trunk's config (ModelConfig, Qwen35Config) or a head's (Eagle3Config, MtpConfig)
    params: Any  # the params pytree (see jaxspec.models)
    tokenizer: Tokenizer | None = None
    source: str | None = None
    exit_layer: int | None = None  # a layer-skip draft: how many of its target's layers it keeps


def layer_skip(model: Model, exit_layer: int) -> Model:
    """Self-speculation draft: the target's first `exit_layer` layers, then its final norm and
    head (LayerSkip; HF's `assistant_early_exit`). Shares the target's weight arrays."""
    num_layers = model.config.num_layers
    if not is_integer(exit_layer) or not 1 <= exit_layer < num_layers:
        raise InvalidRequestError(f"exit_layer must be an integer in [1, {num_layers}); got {exit_layer!r}")
    params = dataclasses.replace(model.params, layers=model.params.layers[:exit_layer])
    config = dataclasses.replace(model.config, num_layers=int(exit_layer))
    return Model(config=config, params=params, tokenizer=model.tokenizer,
                 source=f"layer_skip({model.source}, exit_layer={exit_layer})", exit_layer=int(exit_layer))


def lm_head_of(model: Model) -> jax.Array:
    """The target's output projection [V, D]: its embedding when tied. An MTP head speaks through it."""
    return layers.output_head(model.params.embed, model.params.lm_head)
