"""Gemma 4's shared-KV assistant: a drafter with no cache of its own, reading the target's K/V in
place (jaxspec.models.assistant)."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec import checkpoints
from jaxspec.cache import Cache
from jaxspec.errors import InvalidRequestError
from jaxspec.model import Model
from jaxspec.models import assistant as head_model
from jaxspec.sampling import SamplerSpec
from jaxspec.spec import tree as tree_lib
from jaxspec.spec.drafting import (Drafter, DraftOptions, HeadCheckpoint, Speculation, check_tree_top_k, draft_sampling,
                                   register)
from jaxspec.spec.proposers import Context, Prefill, Verified, draft_chain, next_token, tree_proposal
from jaxspec.spec.tree import DraftTree


@struct.dataclass
class AssistantState:
    hidden: jax.Array  # [B, D_b]: the target's final-normed hidden state at the position before the pending token


@dataclasses.dataclass(frozen=True, kw_only=True)
class SharedKVAssistant:
    """Gemma 4's shared-KV assistant (jaxspec.models.assistant): no cache of its own, no prefill.

    Each draft step reads the target's K/V in place from the loop's cache (`Context.target_cache`,
    committed length = the pending token's position p), at the constant position p, fed the
    previous token's target embedding and a hidden state: the target's final-normed hidden before
    the pending token for the first draft (kept in the state from the prefill and each verify,
    at the last accepted position), the assistant's own post-projection after. Chains draw argmax
    or sampled drafts (q for the verify); a tree's nodes each run one step from their parent's
    token and hidden, top_k children each.

    draft_params: {"assistant": its params, "embed": the target's embedding [V, D_b]}.
    """

    num_draft: int
    config: head_model.AssistantConfig
    target_config: Any  # the target's GemmaConfig: which of its layers hold the K/V, its embedding scale
    sample: bool = False
    sampler: SamplerSpec | None = None
    tree: DraftTree | None = None
    name: str = "assistant"
    can_abstain: ClassVar[bool] = False
    context_limit: ClassVar[None] = None

    @property
    def target_hidden_layers(self) -> tuple[int, ...]:
        return (self.target_config.num_layers,)  # the stream after the final norm

    def draft_inputs(self, target_params, draft_model_params):
        return {"assistant": draft_model_params, "embed": target_params.embed}

    def init(self, draft_params, prefill: Prefill, capacity: int) -> AssistantState:
        last = (prefill.prompt_length - 1)[:, None, None]
        return AssistantState(hidden=jnp.take_along_axis(prefill.hiddens[0], last, axis=1)[:, 0])

    def update(self, draft_params, state: AssistantState, verified: Verified) -> AssistantState:
        # Over [pending, d_1 .. d_k] (a tree's accepted path), index n produced the new pending token.
        hidden = jnp.take_along_axis(verified.hiddens[0], verified.accepted[:, None, None], axis=1)[:, 0]
        return state.replace(hidden=jnp.where((verified.num_committed > 0)[:, None], hidden, state.hidden))

    def _step(self, draft_params, tokens: jax.Array, hidden: jax.Array, target_cache: Cache):
        return head_model.forward(draft_params["assistant"], self.config, self.target_config, draft_params["embed"],
                                 tokens, hidden, target_cache)

    def propose(self, draft_params, state: AssistantState, context: Context):
        pending = jnp.take_along_axis(context.tokens, (context.length - 1)[:, None], axis=1)[:, 0]
        logits, hidden = self._step(draft_params, pending[:, None], state.hidden[:, None], context.target_cache)
        if self.tree is not None:
            return self._propose_tree(draft_params, state, context, logits[:, 0], hidden[:, 0])

        def step(hidden, token):
            logits, hidden = self._step(draft_params, token[:, None], hidden[:, None], context.target_cache)
            return logits[:, 0], hidden[:, 0]

        def draw(logits, index, grammar_state):
            return next_token(logits, context, index, self.sample, self.sampler, context.allowed(grammar_state))

        proposal, _ = draft_chain(self.num_draft, logits[:, 0], hidden[:, 0], step, draw, context)
        return proposal, state

    def _propose_tree(self, draft_params, state: AssistantState, context: Context, root_logits: jax.Array,
                      root_hidden: jax.Array):
        """The root's children from the step on the pending token; each frontier then runs as T = top_k
        independent steps (the nodes do not see each other: the assistant attends to the target only)."""

        def expand(target_cache, tokens, hiddens, level, sees):
            logits, hiddens = self._step(draft_params, tokens, hiddens, target_cache)
            return logits, hiddens, target_cache

        grown, _ = tree_lib.grow(self.tree, root_logits, root_hidden, expand, lambda ids: ids, context.target_cache,
                                 tree_lib.GrowGrammar.of(context, None))
        return tree_proposal(grown), state


def build(target: Model, head: Model | None, options: DraftOptions, sampler: SamplerSpec) -> Speculation:
    if not isinstance(head, Model) or not isinstance(head.config, head_model.AssistantConfig):
        raise InvalidRequestError("method='assistant' needs draft_params: a Gemma 4 assistant from "
                                  "jaxspec.load(ASSISTANT_DIR)")
    head_model.check_target(head.config, target.config)
    check_tree_top_k(options, head.config.vocab_size, "assistant")
    proposer = SharedKVAssistant(num_draft=options.num_draft, config=head.config, target_config=target.config,
                                 **draft_sampling(sampler, options), tree=options.tree)
    return Speculation(DRAFTER.method, proposer, head)


DRAFTER = register(Drafter(
    name="assistant", build=build, summary="Gemma 4's shared-KV assistant, reading the target's K/V",
    claims=lambda draft: isinstance(draft.config, head_model.AssistantConfig),
    checkpoint=HeadCheckpoint(is_dir=checkpoints.is_assistant_dir, load=checkpoints.load_assistant),
    draft_help="--draft DIR (a Gemma 4 assistant checkpoint, transformers' gemma4_assistant)", follows_lookup=True))
