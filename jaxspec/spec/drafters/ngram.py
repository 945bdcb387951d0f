"""Prompt lookup (n-gram) drafting: model-free, copies what followed the context's last n-gram."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from jaxspec.errors import InvalidRequestError
from jaxspec.spec import tree as tree_lib
from jaxspec.spec.drafting import Drafter, Speculation, refuse_draft, register
from jaxspec.spec.proposers import Context, Proposal
from jaxspec.spec.tree import DraftTree


@dataclasses.dataclass(frozen=True, kw_only=True)
class PromptLookup:
    """Prompt lookup (n-gram) drafting, model-free.

    Match the context's last `n` tokens, for n from `ngram_max` down to `ngram_min`, against
    earlier context (most recent occurrence first) and propose up to k tokens that followed it.
    Strong on summarization, RAG and code editing, where the output copies the input.
    With a tree, the top_k best matches (longest n, then most recent) each propose up to depth
    tokens, merged as a trie: matches that agree share nodes, and where they part, branches.
    """

    num_draft: int
    ngram_max: int = 3
    ngram_min: int = 1
    tree: DraftTree | None = None
    name: str = "ngram"
    target_hidden_layers: tuple[int, ...] = ()
    can_abstain: ClassVar[bool] = True  # rows without a match propose nothing
    context_limit: ClassVar[None] = None

    def draft_inputs(self, target_params, draft_model_params):
        return None  # model-free

    def init(self, draft_params, prefill, capacity):
        return None

    def update(self, draft_params, state, verified):
        return state

    def _match_scores(self, tokens: jax.Array, length: jax.Array) -> jax.Array:
        """int32[B, S]: n * S + j for each earlier start j of the context's last n tokens, with the
        longest n that matches there; -1 where none does. Larger is better: longer, then later."""
        batch, size = tokens.shape
        starts = jnp.arange(size)[None, :]  # [1, S]: candidate match start j
        scores = jnp.full((batch, size), -1, jnp.int32)
        for n in range(self.ngram_min, self.ngram_max + 1):  # a longer n overrides a shorter
            suffix_at = length - n  # [B]: where the context's own last n tokens start
            match = jnp.ones((batch, size), bool)
            for i in range(n):
                suffix_token = jnp.take_along_axis(tokens, jnp.maximum(suffix_at + i, 0)[:, None], axis=1)
                shifted = jnp.roll(tokens, -i, axis=1)  # shifted[:, j] = tokens[:, j + i]
                match &= shifted == suffix_token
            # A usable match ends before the suffix itself, so something follows it.
            match &= (starts < suffix_at[:, None]) & (suffix_at[:, None] >= 0)
            scores = jnp.where(match, n * size + starts, scores)
        return scores

    def propose(self, draft_params, state, context: Context):
        tokens, length = context.tokens, context.length
        size = tokens.shape[1]
        matches = 1 if self.tree is None else min(self.tree.top_k, size)  # there are only S starts
        span = self.num_draft  # k, or the tree's depth
        best, starts = _top_per_row(self._match_scores(tokens, length), matches)  # [B, M]
        follow = starts + best // size  # [B, M]: the first token after each match
        at = follow[:, :, None] + jnp.arange(span)[None, None, :]  # [B, M, span]
        real = (best >= 0)[:, :, None] & (at < length[:, None, None])
        continuations = jnp.where(real, jnp.take_along_axis(tokens, jnp.clip(at, 0, size - 1).reshape(
            tokens.shape[0], -1), axis=1).reshape(at.shape), 0)
        if self.tree is None:
            return Proposal(drafts=continuations[:, 0], num_proposed=jnp.sum(real[:, 0], axis=1).astype(jnp.int32)), state
        drafts, parents, num_proposed = tree_lib.trie(continuations, real, self.tree.num_nodes)
        return Proposal(drafts=drafts, num_proposed=num_proposed, parents=parents), state


def _top_per_row(scores: jax.Array, count: int) -> tuple[jax.Array, jax.Array]:
    """`lax.top_k` of each row of distinct scores int32[B, S] for a small `count`, as `count`
    argmaxes: each is local to its row, so under a mesh the rows stay on their "data" shard
    (XLA's partitioner gathers a top_k's whole [B, S] operand to every device). -> [B, count] x 2"""
    best, where = [], []
    for _ in range(count):
        at = jnp.argmax(scores, axis=1).astype(jnp.int32)  # [B]
        best.append(jnp.take_along_axis(scores, at[:, None], axis=1)[:, 0])
        where.append(at)
        scores = scores.at[jnp.arange(scores.shape[0]), at].set(jnp.iinfo(jnp.int32).min)
    return jnp.stack(best, axis=1), jnp.stack(where, axis=1)


def build(target, draft, options, sampler) -> Speculation:
    refuse_draft("ngram", draft)
    if options.draft_sampling == "sample":
        raise InvalidRequestError(
            "prompt lookup proposes copied tokens, not samples: it has no q for draft_sampling='sample'")
    proposer = PromptLookup(num_draft=options.num_draft, ngram_max=options.ngram_max, ngram_min=options.ngram_min,
                            tree=options.tree)
    return Speculation(DRAFTER.method, proposer)


DRAFTER = register(Drafter(
    name="ngram", build=build, summary="prompt lookup: copies what followed the context's last n-gram",
    lookup_first_refusal="the method already is prompt lookup (ngram_min sets its shortest n-gram)"))
