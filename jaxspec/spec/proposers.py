"""Proposers: where draft tokens come from. One protocol, many sources (jaxspec.spec.drafters).

A proposer is a frozen, hashable dataclass (static under jit: its fields shape the program) with
three pure methods over its own state pytree:

    init(draft_params, prefill: Prefill, capacity) -> state      after the target's prefill
    propose(draft_params, state, context) -> (Proposal, state)
    update(draft_params, state, verified: Verified) -> state     after verification

and a host-side `draft_inputs(target_params, draft_model_params) -> draft_params`: the pytree
the jitted program receives (a draft trunk's params; a head's params beside the target's
embedding it reads), and a static `target_hidden_layers`: the trunk's residual streams the proposer needs (EAGLE-3's
aux layers), returned by the prefill and every verify forward, so no second target forward.
Its capabilities are fields every proposer declares (`Proposer`): `tree`, the tree it grows
(None: a chain); `can_abstain`, whether its rows may propose nothing (prompt lookup without a
match; the loop then runs a plain T = 1 step in rounds where no running row has a draft); and
`context_limit`, a bound (whose, tokens) below the target's context that its model serves, which
the request's length is checked against before anything compiles.

`context` is the loop's token history: `tokens` int32[B, S] holds each row's prompt and committed
tokens, `length` int32[B] how many (the last one is the pending token the target has not run);
plus the round's PRNG key and the request's sampling parameters, for proposers that sample; and,
under constrained decoding, the request's grammar table and each row's automaton state, which
model drafters use to draw each draft from their logits masked by the state their drafts reach
(`Context.allowed`, `Context.advance`; trees through `tree.GrowGrammar`).
A proposal's `probs` is the distribution q each draft was drawn from, which lossless rejection
sampling needs; None means point masses on the drafts (prompt lookup, argmax drafts).

With `tree` set (a `jaxspec.spec.tree.DraftTree`), a proposer drafts a tree instead of a chain:
`drafts` holds its N nodes and `parents` their parents' verify indices, and `num_draft` is the
tree's depth (the most a round accepts). Tree drafts are deterministic (top_k children), so
`probs` is None. After the verify, `Verified.path` says which nodes the row accepted, and a
proposer with per-node state (a draft model's K/V) keeps that path's only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec.cache import Cache
from jaxspec.grammar import GrammarTable
from jaxspec.sampling import SamplerSpec, SamplingParams, distribution, masked
from jaxspec.spec import tree as tree_lib
from jaxspec.spec.tree import DraftTree


@struct.dataclass
class Context:
    tokens: jax.Array  # int32[B, S]: prompt then committed tokens, zero past `length`
    length: jax.Array  # int32[B]: valid tokens per row; tokens[b, length[b] - 1] is pending
    key: jax.Array | None = None  # PRNG key for this round's draft sampling
    sampling: SamplingParams | None = None
    # Constrained decoding (jaxspec.grammar): the request's automaton table and each row's state
    # after its committed tokens. Model drafters draw from their logits masked by it (q masked as
    # p is), so their drafts stand; None: no grammar.
    grammar: GrammarTable | None = None
    grammar_state: jax.Array | None = None  # int32[B]
    # The target's cache (its length the committed tokens, `length - 1`): what a shared-KV
    # assistant attends over, read in place. Other proposers ignore it.
    target_cache: Cache | None = None

    def allowed(self, grammar_state: jax.Array | None) -> jax.Array | None:
        """bool[B, V]: the tokens the grammar allows in each row's `grammar_state`; None without one."""
        return None if self.grammar is None else self.grammar.allowed(grammar_state)

    def advance(self, grammar_state: jax.Array | None, token: jax.Array) -> jax.Array | None:
        """Each row's state after drafting `token` int32[B] (None without a grammar)."""
        return None if self.grammar is None else self.grammar.advance(grammar_state, token)


@struct.dataclass
class Prefill:
    prompt: jax.Array  # int32[B, P]: right-padded prompts
    prompt_length: jax.Array  # int32[B]
    first_token: jax.Array  # int32[B]: sampled from the prefill, the first pending token
    hiddens: tuple[jax.Array, ...]  # target_hidden_layers, each [B, P, D]


@struct.dataclass
class Verified:
    accepted: jax.Array  # int32[B]: n, drafts accepted this round (0 for finished rows)
    committed: jax.Array  # int32[B, k+1]: d_1 .. d_n then the bonus token, then padding
    num_committed: jax.Array  # int32[B]: n + 1 for rows that ran this round, else 0
    hiddens: tuple[jax.Array, ...]  # target_hidden_layers over [pending, d_1 .. d_k], each [B, k+1, D]
    path: jax.Array  # int32[B, k+1]: the accepted nodes' verify indices (a chain's: 0 .. n)


@struct.dataclass
class Proposal:
    drafts: jax.Array  # int32[B, k]: entries past num_proposed are padding
    num_proposed: jax.Array  # int32[B]
    probs: jax.Array | None = None  # float32[B, k, V]: q of each draft; None = point masses
    parents: jax.Array | None = None  # int32[B, N]: a tree's parent verify indices; None: a chain


class Proposer(Protocol):
    num_draft: int  # k: drafts per round (fixed shape; rows may propose fewer); a tree's depth
    name: str
    target_hidden_layers: tuple[int, ...]  # the target's residual streams it reads
    tree: DraftTree | None  # the tree it grows each round; None: a chain of k
    can_abstain: bool  # whether its rows may propose nothing (the loop then runs a T = 1 step)
    context_limit: tuple[str, int] | None  # (whose, tokens): a bound below the target's context

    def draft_inputs(self, target_params: Any, draft_model_params: Any) -> Any: ...

    def init(self, draft_params: Any, prefill: Prefill, capacity: int) -> Any: ...

    def propose(self, draft_params: Any, state: Any, context: Context) -> tuple[Proposal, Any]: ...

    def update(self, draft_params: Any, state: Any, verified: Verified) -> Any: ...


def tree_proposal(grown: "tree_lib.Grown") -> Proposal:
    batch, nodes = grown.drafts.shape
    return Proposal(drafts=grown.drafts, num_proposed=jnp.full((batch,), nodes, jnp.int32), parents=grown.parents)


def next_token(logits: jax.Array, context: Context, step: int, sample: bool,
               sampler: SamplerSpec | None, allowed: jax.Array | None = None) -> tuple[jax.Array, jax.Array | None]:
    """A draft token [B] from draft logits [B, V] and, when sampling, its distribution q [B, V].

    The draft's q needs no repetition penalty: any q is exact as long as drafts are drawn from it.
    `step` (possibly traced) folds into the round's key, so every draft position draws afresh.
    `allowed` bool[B, V]: a grammar's mask. A row where it allows none of these logits' tokens
    (a head's small vocabulary may lack them all) drafts unmasked; the verify then cuts the draft.
    """
    logits = masked(logits, allowed)
    if not sample:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), None
    probs = distribution(logits, context.sampling, dataclasses.replace(sampler, repetition_penalty=False))
    token = jax.random.categorical(jax.random.fold_in(context.key, step), jnp.log(probs), axis=-1)
    return token.astype(jnp.int32), probs


# draw(logits [B, V'], step, grammar_state int32[B] | None) -> (token int32[B], q [B, V] | None)
Draw = Callable[[jax.Array, Any, Any], tuple[jax.Array, Any]]
# step(carry, token int32[B]) -> (logits [B, V'] for the token after it, carry)
ChainStep = Callable[[Any, jax.Array], tuple[jax.Array, Any]]


def draft_chain(num_draft: int, first_logits: jax.Array, carry: Any, step: ChainStep, draw: Draw,
                context: Context) -> tuple[Proposal, Any]:
    """A chain of k drafts from a model drafter: the first drawn from `first_logits`, each later
    one from the logits `step` gives on the draft before it (threading the drafter's `carry`: its
    cache, its hidden state). Under a grammar each draft is drawn in the state its predecessors
    reach. A scan, not an unrolled loop: compile time stays flat in k. -> (Proposal, carry)"""
    first, first_probs = draw(first_logits, 0, context.grammar_state)

    def body(loop_carry, index):
        token, carry, grammar_state = loop_carry
        grammar_state = context.advance(grammar_state, token)
        logits, carry = step(carry, token)
        following, probs = draw(logits, index, grammar_state)
        return (following, carry, grammar_state), (following, probs)

    (_, carry, _), (rest, rest_probs) = jax.lax.scan(
        body, (first, carry, context.grammar_state), jnp.arange(1, num_draft))
    drafts = jnp.concatenate([first[:, None], rest.T], axis=1)  # [B, k]
    probs = None
    if first_probs is not None:
        probs = jnp.concatenate([first_probs[:, None], jnp.swapaxes(rest_probs, 0, 1)], axis=1)  # [B, k, V]
    return Proposal(drafts=drafts, num_proposed=jnp.full(first.shape, num_draft, jnp.int32), probs=probs), carry
