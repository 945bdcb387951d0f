"""`Model`: what `load` returns and `generate` takes, and the drafts derived from one.

A Model is a config (static, hashable), a params pytree (arrays) and, for a trunk loaded from a
checkpoint, its tokenizer. Draft heads (EAGLE-3, MTP) are Models too, with no tokenizer of their
own. Nothing here traces or compiles.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import jax

from jaxspec import models
from jaxspec.errors import InvalidRequestError, UnsupportedModelError, is_integer
from jaxspec.models import backends, layers, quant
from jaxspec.models.backends import Backend, Products
from jaxspec.models.quant import WeightFormat
from jaxspec.sharding import Plan, ShardingError, laid_out_for, place_params, plan_for
from jaxspec.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True, eq=False)
class Model:
    """What `load` returns and `generate` takes: config (static), params (arrays), tokenizer."""

    config: Any  # a trunk's config (ModelConfig, Qwen35Config) or a head's (Eagle3Config, MtpConfig)
    params: Any  # the params pytree (see jaxspec.models)
    tokenizer: Tokenizer | None = None
    source: str | None = None
    exit_layer: int | None = None  # a layer-skip draft: how many of its target's layers it keeps
    # The weight format asked for at load: a concrete one, or AUTO (a draft in AUTO runs in its
    # target's format, `with_weight_format`). The params' own format is `quant.format_of(params)`.
    weight_format: WeightFormat = WeightFormat.AUTO
    # Where the params lie over a device mesh (`jaxspec.shard`); None: one device.
    sharding: Plan | None = None

    @property
    def products(self) -> Backend:
        """The product backend the params are laid out for (chosen at load,
        jaxspec.models.backends), with what it declares: token lanes, width invariance."""
        return backends.of_params(self.params)


# The draft heads' configs, by class name, as a refusal names them (a head is not a trunk).
DRAFT_HEAD_KINDS = {"Eagle3Config": "an EAGLE-3 draft head", "MtpConfig": "an MTP draft head",
                    "AssistantConfig": "a shared-KV assistant draft"}


def check_trunk(model: Model, use: str) -> None:
    """Refuse, by name and before anything is traced, a draft head passed where a trunk goes (the
    target of `generate`, the model `score` reads): it predicts only from a target's hidden states."""
    try:
        models.family_of(model.config)
    except UnsupportedModelError:
        name = type(model.config).__name__
        kind = DRAFT_HEAD_KINDS.get(name, f"a model of config type {name}")
        raise InvalidRequestError(
            f"{use} needs a trunk model; got a draft head: this is {kind}, which predicts only from its target's "
            "hidden states; pass it as draft_params beside its target") from None


def shard(model: Model, mesh, rules=None) -> Model:
    """`model` with its params laid out over `mesh` (a `jax.sharding.Mesh`, e.g.
    `jaxspec.make_mesh(data=2, model=4)`) by logical-axis `rules` (jaxspec.sharding.DEFAULT_RULES:
    heads, kv heads, the MLP and the vocabulary over "model"; batch rows over "data"). `generate`
    follows the params: its caches and loop state are created sharded and the whole loop is one
    SPMD program. A draft passed beside a sharded target is sharded the same way. Kv heads that
    do not divide the model axis are repeated up to a multiple of it (the returned Model's config
    says the repeated count; the outputs are the same); any other misfit raises ShardingError
    before anything compiles."""
    if not isinstance(model, Model):
        raise InvalidRequestError(f"shard takes a jaxspec Model (from jaxspec.load); got {type(model).__name__}")
    plan = plan_for(model.config, mesh, rules)
    # The native CPU kernels serve one device: a sharded model runs XLA's products.
    config, params = laid_out_for(model.config, backends.standard(model.params), plan)
    return dataclasses.replace(model, config=config, params=place_params(params, plan), sharding=plan)


def layer_skip(model: Model, exit_layer: int) -> Model:
    """Self-speculation draft: the target's first `exit_layer` layers, then its final norm and
    head (LayerSkip; HF's `assistant_early_exit`). Shares the target's weight arrays."""
    num_layers = model.config.num_layers
    if not is_integer(exit_layer) or not 1 <= exit_layer < num_layers:
        raise InvalidRequestError(f"exit_layer must be an integer in [1, {num_layers}); got {exit_layer!r}")
    params = dataclasses.replace(model.params, layers=model.params.layers[:exit_layer])
    config = models.family_of(model.config).truncated(model.config, int(exit_layer))
    return Model(config=config, params=params, tokenizer=model.tokenizer,
                 source=f"layer_skip({model.source}, exit_layer={exit_layer})", exit_layer=int(exit_layer),
                 sharding=model.sharding)


def lm_head_of(model: Model) -> jax.Array:
    """The target's output projection [V, D]: its embedding when tied. An MTP head speaks through it."""
    return layers.output_head(model.params.embed, model.params.lm_head)


# Drafts converted to a target's format, kept per draft Model so a repeated generate call
# converts once (a Model is hashable by identity; the entry goes when the draft does).
_CONVERTED_DRAFTS: "weakref.WeakKeyDictionary[Model, dict[tuple[WeightFormat, Products], Model]]" = (
    weakref.WeakKeyDictionary())


def with_weight_format(draft: Model, target: Model) -> Model:
    """The draft in the format it runs in beside `target`: its own when it was loaded with an
    explicit weight format, else the target's (converted once, then reused); and on the target's
    product backend where that serves the draft's format."""
    fmt = quant.format_of(target.params)
    if draft.weight_format is not WeightFormat.AUTO:
        fmt = quant.format_of(draft.params)
    target_products = target.products.name
    products = backends.resolve(target_products, fmt) if target_products is Products.NATIVE else Products.XLA
    if quant.format_of(draft.params) is fmt and draft.products.name is products:
        return draft
    converted = _CONVERTED_DRAFTS.setdefault(draft, {})
    if (fmt, products) not in converted:
        converted[(fmt, products)] = dataclasses.replace(convert_weights(draft, fmt, products),
                                                         weight_format=draft.weight_format)
    return converted[(fmt, products)]


# Drafts laid out on a target's mesh, kept per draft Model like _CONVERTED_DRAFTS.
_PLACED_DRAFTS: "weakref.WeakKeyDictionary[Model, dict[Plan, Model]]" = weakref.WeakKeyDictionary()


def on_mesh_of(draft: Model, target: Model) -> Model:
    """The draft laid out beside `target`: unchanged when the target is on one device or the
    draft is already on the target's mesh; sharded by the target's rules (placed once, then
    reused) when it is on one device, each of its axes that does not divide the mesh replicated
    (a draft is small; a 4096-token draft vocabulary does not split 3 ways). A draft on
    another mesh is refused."""
    plan = target.sharding
    if plan is None and draft.sharding is None:
        return draft
    if plan is None or (draft.sharding is not None and draft.sharding.mesh != plan.mesh):
        raise ShardingError(
            "the draft and the target must lie on the same mesh: shard both with one mesh (or shard only the "
            f"target, and the draft follows); target: {plan or 'one device'}, draft: {draft.sharding or 'one device'}")
    if draft.sharding is not None:
        return draft
    placed = _PLACED_DRAFTS.setdefault(draft, {})
    if plan not in placed:
        draft_plan = plan_for(draft.config, plan.mesh, plan.rules_for_another_model(), replicate_misfits=True)
        config, params = laid_out_for(draft.config, draft.params, draft_plan)
        placed[plan] = dataclasses.replace(draft, config=config, params=place_params(params, draft_plan),
                                           sharding=draft_plan)
    return placed[plan]


def convert_weights(model: Model, weight_format: WeightFormat | str, products: Products | str | None = None) -> Model:
    """`model` with its linear weights in `weight_format` ("f32", "bf16", "int8"; "auto" is
    this platform's) and q/k/v, gate/up fused (`layers.fuse_projections`), as `load` gives
    them, laid out for `products` (jaxspec.models.backends; None: the model's own backend where
    it serves the new format, else XLA). Converting to int8 and back to f32 keeps int8's rounding."""
    fmt = WeightFormat.parse(weight_format)
    params = layers.fuse_projections(quant.convert(backends.standard(model.params), fmt))
    if products is None:
        products = Products.AUTO if model.products.name is Products.NATIVE else Products.XLA
    params = backends.apply(params, backends.resolve(products, quant.format_of(params),
                                                     sharded=model.sharding is not None))
    converted = dataclasses.replace(model, params=params, weight_format=fmt)
    if model.sharding is not None:  # back onto the mesh, unfused where split
        converted = dataclasses.replace(converted, params=place_params(params, model.sharding))
    return converted
