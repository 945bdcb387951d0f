"""EAGLE-3 drafting: a head over three of the target's hidden layers (jaxspec.models.eagle3)."""

from __future__ import annotations

import dataclasses

from jaxspec import checkpoints
from jaxspec.errors import InvalidRequestError
from jaxspec.model import Model
from jaxspec.models import eagle3 as head_model
from jaxspec.sampling import SamplerSpec
from jaxspec.spec.drafting import (Drafter, DraftOptions, HeadCheckpoint, Speculation, check_tree_top_k, draft_sampling,
                                   register)
from jaxspec.spec.drafters.feature_head import FeatureHead, check_head
from jaxspec.spec.tree import DraftTree


@dataclasses.dataclass(frozen=True, kw_only=True)
class Eagle3(FeatureHead):
    """EAGLE-3 drafting (see jaxspec.models.eagle3 for the head): g = fc(three aux features).

    draft_params: {"head": head params, "embed": the target's embedding [V, D]}.
    """

    num_draft: int
    config: head_model.Eagle3Config
    aux_layer_ids: tuple[int, ...]  # input-of-layer spelling (see models/eagle3.py)
    sample: bool = False
    sampler: SamplerSpec | None = None
    tree: DraftTree | None = None
    name: str = "eagle3"
    speaks_target_ids: bool = False  # its ids map through d2t, even when it has the target's V of them

    @property
    def target_hidden_layers(self) -> tuple[int, ...]:
        return head_model.target_hidden_layers(self.aux_layer_ids)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def draft_inputs(self, target_params, draft_model_params):
        return {"head": draft_model_params, "embed": target_params.embed}

    def _encode(self, draft_params, hiddens):
        return head_model.encode(draft_params["head"], hiddens)

    def _step(self, draft_params, tokens, g, cache, **tree_inputs):
        return head_model.forward(draft_params["head"], self.config, draft_params["embed"], tokens, g, cache,
                              **tree_inputs)

    def _to_target(self, draft_params, ids):
        return head_model.to_target_ids(draft_params["head"], ids)

    def _create_cache(self, batch, capacity):
        return head_model.create_cache(self.config, batch, capacity)


def build(target: Model, head: Model | None, options: DraftOptions, sampler: SamplerSpec) -> Speculation:
    cfg = check_head(target, head, head_model.Eagle3Config, "eagle3", "EAGLE-3", "jaxspec.load(HEAD_DIR)")
    layers = target.config.num_layers
    aux = cfg.resolved_aux_layers(layers)
    if len(aux) != 3 or any(not 0 <= i < layers for i in aux):
        raise InvalidRequestError(
            f"EAGLE-3 aux layer ids {aux} must be three layer indices in [0, {layers}) of the target")
    check_tree_top_k(options, cfg.draft_vocab_size, "EAGLE-3 head")
    proposer = Eagle3(num_draft=options.num_draft, config=cfg, aux_layer_ids=tuple(aux), tree=options.tree,
                      **draft_sampling(sampler, options))
    return Speculation(DRAFTER.method, proposer, head)


DRAFTER = register(Drafter(
    name="eagle3", build=build, summary="an EAGLE-3 head over the target's features",
    claims=lambda draft: isinstance(draft.config, head_model.Eagle3Config),
    checkpoint=HeadCheckpoint(is_dir=checkpoints.is_eagle3_dir, load=checkpoints.load_eagle3),
    draft_help="--draft HEAD_DIR (an EAGLE-3 head directory, or eagle3-smollm2-135m)", follows_lookup=True))
