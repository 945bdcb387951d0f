"""A draft model: a smaller model of the target's vocabulary drafts with its own KV cache.
Registers two methods: "draft" (a model from jaxspec.load) and "layer_skip" (the target's own first
layers, LayerSkip self-speculation)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec import models
from jaxspec.cache import Cache
from jaxspec.config import ModelConfig
from jaxspec.errors import InvalidRequestError
from jaxspec.model import Model, layer_skip
from jaxspec.sampling import SamplerSpec
from jaxspec.spec import tree as tree_lib
from jaxspec.spec.drafting import (DRAFTERS, Drafter, DraftOptions, Method, Speculation, check_tree_top_k, register,
                                   draft_sampling)
from jaxspec.spec.proposers import Context, Prefill, Verified, draft_chain, next_token, tree_proposal
from jaxspec.spec.tree import DraftTree


@dataclasses.dataclass(frozen=True, kw_only=True)
class DraftModel:
    """A smaller model of the same vocabulary drafts k tokens greedily with its own KV cache.

    Cache invariant at each `propose`: the draft's cache is valid for every context token but the
    last two. After a round that accepted n of k drafts, the draft has run the old context plus
    d_1 .. d_{k-1}, of which d_1 .. d_n are now context, so that holds (n - 1 <= min(n, k - 1)).
    Each round therefore sets the draft's length to `length - 2` (a rollback by length) and runs
    the last two context tokens at once (T = 2: it catches up on whatever it has not seen, one or
    two tokens), then k - 1 single-token steps.
    Layer-skip self-speculation is this proposer with the target's own first layers as the draft.

    With `sampler` set (sampled verification), `sample=True` draws each draft from the draft's
    own processed distribution (the request's temperature, top-k, top-p, min-p) and reports it as
    q; otherwise drafts are the draft's argmax, point masses.

    With a tree, the draft grows it (`tree.grow`) from the catch-up forward's logits, running
    each frontier at scratch slots past the context; `update` then moves the accepted path's
    K/V to the slots the chain would have written them to, so the invariant above holds again.
    """

    num_draft: int
    config: ModelConfig
    sample: bool = False
    sampler: SamplerSpec | None = None
    tree: DraftTree | None = None
    name: str = "draft"  # "layer_skip" when the draft is the target's own first layers
    target_hidden_layers: tuple[int, ...] = ()
    can_abstain: ClassVar[bool] = False
    context_limit: ClassVar[None] = None

    def draft_inputs(self, target_params, draft_model_params):
        return draft_model_params

    def init(self, draft_params, prefill: Prefill, capacity: int) -> "Cache | TreeDraftState":
        batch = prefill.prompt.shape[0]
        cache = models.create_cache(self.config, batch, capacity)
        _, _, cache = models.forward(draft_params, self.config, prefill.prompt, cache,
                                     logit_indices=jnp.zeros((batch, 1), jnp.int32))
        # The context is prompt + first token; valid for all but its last two is prompt_length - 1.
        cache = cache.set_length(prefill.prompt_length - 1)
        if self.tree is None:
            return cache
        return TreeDraftState(cache=cache, scratch_slot=jnp.full((batch, self.tree.num_nodes), -1, jnp.int32))

    def update(self, draft_params, state, verified: Verified):
        if self.tree is None:
            return state
        # Path node i (depth i) ran at scratch slot s past the context's length h; the chain
        # would have written it at h + i - 1. Nodes the draft never ran (a leaf of the growth),
        # and path entries past the accepted ones, stay where they are.
        depth = self.tree.depth
        base = state.cache.length  # h: the context's length when the round drafted
        node_slot = tree_lib.gather_path(jnp.pad(state.scratch_slot, ((0, 0), (1, 0)), constant_values=-1),
                                         verified.path)[:, 1:]  # [B, depth]
        chain_slot = jnp.arange(depth)[None, :]
        moved = (node_slot >= 0) & (chain_slot < verified.accepted[:, None])
        sources = base[:, None] + jnp.where(moved, node_slot, chain_slot)
        return state.replace(cache=state.cache.move_slots(sources, base))

    def propose(self, draft_params, state, context: Context):
        cache = state if self.tree is None else state.cache
        last_two_at = jnp.maximum(context.length - 2, 0)[:, None] + jnp.arange(2)[None, :]  # [B, 2]
        last_two = jnp.take_along_axis(context.tokens, last_two_at, axis=1)
        cache = cache.set_length(last_two_at[:, 0])
        logits, _, cache = models.forward(draft_params, self.config, last_two, cache,
                                         logit_indices=jnp.ones((last_two.shape[0], 1), jnp.int32))
        cache = cache.advance(jnp.full_like(cache.length, 2))
        if self.tree is not None:
            return self._propose_tree(draft_params, cache, logits[:, 0], context)

        def step(cache, token):
            logits, _, cache = models.forward(draft_params, self.config, token[:, None], cache)
            return logits[:, 0], cache.advance(jnp.ones_like(cache.length))

        def draw(logits, index, grammar_state):
            return next_token(logits, context, index, self.sample, self.sampler, context.allowed(grammar_state))

        return draft_chain(self.num_draft, logits[:, 0], cache, step, draw, context)

    def _propose_tree(self, draft_params, cache: Cache, root_logits: jax.Array, context: Context):
        """Grow the tree from the catch-up's logits; the cache's length h (the context's) is where
        the scratch slots start, and where it is left."""
        base, top_k = cache.length, self.tree.top_k

        def expand(cache, tokens, carry, level, sees):
            offset, positions, mask = tree_lib.frontier_inputs(base, level, top_k, sees)
            logits, _, cache = models.forward(draft_params, self.config, tokens, cache.set_length(offset),
                                              positions=positions, tree_mask=mask)
            return logits, carry, cache

        grown, cache = tree_lib.grow(self.tree, root_logits, None, expand, lambda ids: ids, cache,
                                     tree_lib.GrowGrammar.of(context))
        state = TreeDraftState(cache=cache.set_length(base), scratch_slot=grown.scratch_slot)
        return tree_proposal(grown), state


@struct.dataclass
class TreeDraftState:
    """A draft model's state under a tree: its cache, and where this round's nodes ran."""

    cache: Cache  # length: the context's, h, between propose and update
    scratch_slot: jax.Array  # int32[B, N]: each node's slot past h, or -1 (never ran)


def _build(method: str, target: Model, draft: Model, options: DraftOptions, sampler: SamplerSpec) -> Speculation:
    if not isinstance(draft, Model):
        raise InvalidRequestError(
            f"draft_params must be a jaxspec Model (from jaxspec.load); got {type(draft).__name__}")
    if not models.is_trunk(draft.config):
        implied = Method.infer(draft)
        raise InvalidRequestError(f"method={method!r} needs a draft model; this draft is for method={implied!r} "
                                  f"(use method={implied!r})")
    if draft.config.vocab_size != target.config.vocab_size:
        raise InvalidRequestError(
            f"the draft's vocabulary ({draft.config.vocab_size}) differs from the target's "
            f"({target.config.vocab_size}); a draft model must share the target's tokenizer")
    family = models.family_of(draft.config)
    if options.tree is not None:
        family.check_tree(draft.config, options.tree.depth, "draft")
    check_tree_top_k(options, draft.config.vocab_size, "draft model")
    k = options.num_draft
    # A draft runs k + 1 positions past its context's length - 2 each round and is set back to the
    # new length - 2: k positions back for a row that committed one token, k + 1 for a row that
    # already finished (its context no longer grows, yet the batch drafts on), from a T = 2 catch-up.
    config = family.with_rollback(draft.config, k + 2, 2)
    proposer = DraftModel(num_draft=k, config=config, **draft_sampling(sampler, options),
                          tree=options.tree, name=method)
    return Speculation(DRAFTERS[method].method, proposer, draft)


def build_draft(target: Model, draft: Model | None, options: DraftOptions, sampler: SamplerSpec) -> Speculation:
    if draft is None:
        raise InvalidRequestError("method='draft' needs draft_params: a model from jaxspec.load")
    return _build("draft", target, draft, options, sampler)


def build_layer_skip(target: Model, draft: Model | None, options: DraftOptions, sampler: SamplerSpec) -> Speculation:
    if draft is None:
        exit_layer = options.exit_layer if options.exit_layer is not None else target.config.num_layers // 2
        draft = layer_skip(target, exit_layer)
    elif options.exit_layer is not None:
        raise InvalidRequestError("pass exit_layer or a layer-skip draft_params, not both")
    return _build("layer_skip", target, draft, options, sampler)


# layer_skip first: a truncated target is a trunk too, and claims it by its exit layer.
register(Drafter(name="layer_skip", build=build_layer_skip, summary="the target's own first layers draft",
                 claims=lambda draft: draft.exit_layer is not None))
register(Drafter(name="draft", build=build_draft, summary="a smaller model of the same vocabulary drafts",
                 claims=lambda draft: models.is_trunk(draft.config),
                 draft_help="--draft MODEL (a draft model sharing the vocabulary)"))
