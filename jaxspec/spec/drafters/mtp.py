"""MTP drafting: a multi-token-prediction head over the target's final hidden state (jaxspec.models.mtp),
shipped inside the target's checkpoint or trained by jaxspec.train."""

from __future__ import annotations

import dataclasses
import os
import weakref

from jaxspec import checkpoints
from jaxspec.errors import InvalidRequestError
from jaxspec.model import Model
from jaxspec.models import layers
from jaxspec.models import mtp as head_model
from jaxspec.sampling import SamplerSpec
from jaxspec.spec.drafting import (Drafter, DraftOptions, HeadCheckpoint, Speculation, check_tree_top_k, draft_sampling,
                                   register)
from jaxspec.spec.drafters.feature_head import FeatureHead, check_head
from jaxspec.spec.tree import DraftTree


@dataclasses.dataclass(frozen=True, kw_only=True)
class Mtp(FeatureHead):
    """MTP drafting (see jaxspec.models.mtp): the head reads the target's final-normed hidden
    state and speaks the target's vocabulary through the target's own lm_head.

    draft_params: {"head": head params, "embed": the target's embedding, "lm_head": its head}.
    """

    num_draft: int
    config: head_model.MtpConfig
    target_layers: int  # the target's L: its hidden layer L is the stream after the final norm
    sample: bool = False
    sampler: SamplerSpec | None = None
    tree: DraftTree | None = None
    name: str = "mtp"
    speaks_target_ids: bool = True  # through the target's own lm_head

    @property
    def target_hidden_layers(self) -> tuple[int, ...]:
        return (self.target_layers,)

    @property
    def context_limit(self) -> tuple[str, int]:
        """A sliding-window MTP block serves up to its window."""
        return ("MTP head's", self.config.block.max_position_embeddings)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def draft_inputs(self, target_params, draft_model_params):
        lm_head = layers.output_head(target_params.embed, target_params.lm_head)  # the embedding when tied
        return {"head": draft_model_params, "embed": target_params.embed, "lm_head": lm_head}

    def _encode(self, draft_params, hiddens):
        return hiddens[0]

    def _step(self, draft_params, tokens, g, cache, **tree_inputs):
        return head_model.forward(draft_params["head"], self.config, draft_params["embed"], draft_params["lm_head"],
                           tokens, g, cache, **tree_inputs)

    def _to_target(self, draft_params, ids):
        return ids

    def _create_cache(self, batch, capacity):
        return head_model.create_cache(self.config, batch, capacity)


def build(target: Model, head: Model | None, options: DraftOptions, sampler: SamplerSpec) -> Speculation:
    cfg = check_head(target, head, head_model.MtpConfig, "mtp", "MTP", "jaxspec.load_mtp(MODEL_DIR)")
    check_tree_top_k(options, cfg.vocab_size, "MTP head")
    proposer = Mtp(num_draft=options.num_draft, config=cfg, target_layers=target.config.num_layers, tree=options.tree,
                   **draft_sampling(sampler, options))
    return Speculation(DRAFTER.method, proposer, head)


def load_head(model_or_path: "Model | str | os.PathLike") -> Model:
    """The MTP head an HF checkpoint carries (num_nextn_predict_layers): from the target's
    directory, or the target `Model` loaded from it; or a head directory written by `jaxspec.train`."""
    source = model_or_path.source if isinstance(model_or_path, Model) else model_or_path
    if source is None:
        raise InvalidRequestError("this model has no source directory to read an MTP head from")
    path = checkpoints.resolve_model(source)
    if checkpoints.is_mtp_head_dir(path):  # a head trained by jaxspec.train, on its own
        config, params = checkpoints.load_mtp_head(path)
    elif checkpoints.has_mtp(path):
        config, params = checkpoints.load_mtp(path)
    else:
        raise InvalidRequestError(
            f"{path} carries no MTP head: an HF directory whose config.json declares num_nextn_predict_layers")
    return Model(config=config, params=layers.fuse_projections(params), source=str(path))


# The head a target's own checkpoint carries, read on the first "mtp" request without a draft and
# kept per target Model (hashable by identity; the entry goes when the target does), so later
# requests do not read it from disk again.
_OWN_HEADS: "weakref.WeakKeyDictionary[Model, Model]" = weakref.WeakKeyDictionary()


def own_head(target: Model) -> Model:
    if target not in _OWN_HEADS:
        _OWN_HEADS[target] = load_head(target)
    return _OWN_HEADS[target]


DRAFTER = register(Drafter(
    name="mtp", build=build, summary="a multi-token-prediction head (the target's own, or trained)",
    claims=lambda draft: isinstance(draft.config, head_model.MtpConfig),
    checkpoint=HeadCheckpoint(is_dir=checkpoints.is_mtp_head_dir, load=checkpoints.load_mtp_head),
    draft_help="--draft DIR (a checkpoint carrying an MTP head, or a trained head; default: the model's own)",
    load_draft=load_head, default_draft=own_head, follows_lookup=True))
