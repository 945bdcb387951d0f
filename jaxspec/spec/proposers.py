"""Proposers: where draft tokens come from. One protocol, many sources (DESIGN.md contract 7).

A proposer is a frozen, hashable dataclass (static under jit: its fields shape the program) with
three pure methods over its own state pytree:

    init(draft_params, prefill: Prefill, capacity) -> state      after the target's prefill
    propose(draft_params, state, context) -> (Proposal, state)
    update(draft_params, state, verified: Verified) -> state     after verification

and a host-side `draft_inputs(target_params, draft_model_params) -> draft_params`: the pytree
the jitted program receives (a draft trunk's params; a head's params beside the target's
embedding it reads), and a static `target_hidden_layers`: the trunk's residual streams the proposer needs (EAGLE-3's
aux layers), returned by the prefill and every verify forward, so no second target forward.
A proposer whose rows may propose nothing (prompt lookup without a match) sets `can_abstain`:
the loop then runs a plain T = 1 step in rounds where no running row has a draft. One whose
model serves fewer positions than the target names that bound in `context_limit` (whose, tokens),
which the request's length is checked against before anything compiles.

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
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec import models
from jaxspec.models import assistant, eagle3, layers, mtp
from jaxspec.cache import Cache, KVCache
from jaxspec.config import ModelConfig
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
    path: jax.Array | None = None  # int32[B, k+1]: with a tree, the accepted nodes' verify indices


@struct.dataclass
class Proposal:
    drafts: jax.Array  # int32[B, k]: entries past num_proposed are padding
    num_proposed: jax.Array  # int32[B]
    probs: jax.Array | None = None  # float32[B, k, V]: q of each draft; None = point masses
    parents: jax.Array | None = None  # int32[B, N]: a tree's parent verify indices; None: a chain


class Proposer(Protocol):
    num_draft: int  # k: drafts per round (fixed shape; rows may propose fewer)
    name: str
    target_hidden_layers: tuple[int, ...]

    def draft_inputs(self, target_params: Any, draft_model_params: Any) -> Any: ...

    def init(self, draft_params: Any, prefill: Prefill, capacity: int) -> Any: ...

    def propose(self, draft_params: Any, state: Any, context: Context) -> tuple[Proposal, Any]: ...

    def update(self, draft_params: Any, state: Any, verified: Verified) -> Any: ...


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
    can_abstain: bool = True  # rows without a match propose nothing (the loop then runs T = 1)

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
        grammar_state = context.grammar_state
        first, first_probs = _next_token(logits[:, 0], context, 0, self.sample, self.sampler,
                                         context.allowed(grammar_state))

        def step(carry, index):
            token, cache, grammar_state = carry
            grammar_state = context.advance(grammar_state, token)
            logits, _, cache = models.forward(draft_params, self.config, token[:, None], cache)
            cache = cache.advance(jnp.ones_like(cache.length))
            following, probs = _next_token(logits[:, 0], context, index, self.sample, self.sampler,
                                           context.allowed(grammar_state))
            return (following, cache, grammar_state), (following, probs)

        # A scan, not an unrolled loop: compile time stays flat in k.
        (_, cache, _), (rest, rest_probs) = jax.lax.scan(
            step, (first, cache, grammar_state), jnp.arange(1, self.num_draft))
        drafts = jnp.concatenate([first[:, None], rest.T], axis=1)  # [B, k]
        probs = None
        if self.sample:
            probs = jnp.concatenate([first_probs[:, None], jnp.swapaxes(rest_probs, 0, 1)], axis=1)  # [B, k, V]
        proposal = Proposal(drafts=drafts, num_proposed=jnp.full(first.shape, self.num_draft, jnp.int32),
                            probs=probs)
        return proposal, cache

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
        return _tree_proposal(grown), state


@struct.dataclass
class TreeDraftState:
    """A draft model's state under a tree: its cache, and where this round's nodes ran."""

    cache: Cache  # length: the context's, h, between propose and update
    scratch_slot: jax.Array  # int32[B, N]: each node's slot past h, or -1 (never ran)


def _tree_proposal(grown: "tree_lib.Grown") -> Proposal:
    batch, nodes = grown.drafts.shape
    return Proposal(drafts=grown.drafts, num_proposed=jnp.full((batch,), nodes, jnp.int32), parents=grown.parents)


def _next_token(logits: jax.Array, context: Context, step: int, sample: bool,
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


@struct.dataclass
class HeadState:
    cache: KVCache  # the head's KV over the whole sequence; length == the target cache's
    g_next: jax.Array  # [B, D]: the head's output at the last committed position
    next_logits: jax.Array  # [B, Vd]: draft logits for the token after the pending one


class _FeatureHead:
    """Drafting with a one-layer head over the target's hidden states: EAGLE-3 and MTP.

    The head keeps its own KV over the whole sequence across rounds (as vLLM does), not a
    scratch buffer: after each verify, the committed positions are written into it from the
    target's own features (one head forward over the k + 1 verified positions, padded), and the
    last of them yields the next round's first draft. Later drafts within a round run on the
    head's own output; their KV slots are speculative and rolled back by length. Slot p holds
    the pair (target feature p, token p + 1).

    A subclass says how target features become the head's input (`_encode`), runs one head step
    (`_step`), maps head-vocabulary ids to target ids (`_to_target`) and makes the head's cache.
    Fields it must have: num_draft, sample, sampler, a `vocab_size` (the target's V) and
    `speaks_target_ids` (whether the head's ids are the target's, or map through `_to_target`).
    """

    def _encode(self, draft_params, hiddens: tuple[jax.Array, ...]) -> jax.Array: ...

    def _step(self, draft_params, tokens, g, cache, **tree_inputs) -> tuple[jax.Array, jax.Array, KVCache]: ...

    def _to_target(self, draft_params, ids: jax.Array) -> jax.Array: ...

    def _vocab_map(self, draft_params, size: int) -> jax.Array | None:
        """int32[Vd]: the target id of each of the head's `size` ids; None where they are the
        target's own (MTP). A map of the full vocabulary size may still permute it (a d2t), so
        the head's type decides, not its size."""
        return None if self.speaks_target_ids else self._to_target(draft_params, jnp.arange(size))

    def _create_cache(self, batch: int, capacity: int) -> KVCache: ...

    def _absorb(self, draft_params, cache: KVCache, tokens, features, count) -> HeadState:
        """Write (feature p, token p + 1) pairs at the cache's offsets and commit `count` per row."""
        logits, g_next, cache = self._step(draft_params, tokens, self._encode(draft_params, features), cache)
        last = jnp.maximum(count - 1, 0)[:, None, None]
        return HeadState(
            cache=cache.advance(count),
            g_next=jnp.take_along_axis(g_next, last, axis=1)[:, 0],
            next_logits=jnp.take_along_axis(logits, last, axis=1)[:, 0],
        )

    def _draft_token(self, draft_params, logits, context, step, grammar_state=None):
        """Head-vocabulary logits -> target token id [B], and q over the target vocabulary; under a
        grammar, drawn from the logits masked by each row's `grammar_state`."""
        all_targets = self._vocab_map(draft_params, logits.shape[-1])  # [Vd], or None: the target's ids
        allowed = context.allowed(grammar_state)  # [B, V] over the target's vocabulary
        if allowed is not None and all_targets is not None:
            allowed = allowed[:, all_targets]  # [B, Vd]
        head_id, head_probs = _next_token(logits, context, step, self.sample, self.sampler, allowed)
        token = self._to_target(draft_params, head_id)
        if head_probs is None or all_targets is None:
            return token, head_probs
        probs = jnp.zeros((logits.shape[0], self.vocab_size)).at[:, all_targets].set(head_probs)
        return token, probs

    def init(self, draft_params, prefill: Prefill, capacity: int) -> HeadState:
        batch, size = prefill.prompt.shape
        cache = self._create_cache(batch, capacity)
        # Feature p pairs with token p + 1: the prompt shifted left, the first token at the end.
        shifted = jnp.concatenate([prefill.prompt[:, 1:], jnp.zeros((batch, 1), jnp.int32)], axis=1)
        last = (prefill.prompt_length - 1)[:, None]
        tokens = jnp.where(jnp.arange(size)[None, :] == last, prefill.first_token[:, None], shifted)
        return self._absorb(draft_params, cache, tokens, prefill.hiddens, prefill.prompt_length)

    def propose(self, draft_params, state: HeadState, context: Context):
        if self.tree is not None:
            return self._propose_tree(draft_params, state, context)
        first, first_probs = self._draft_token(draft_params, state.next_logits, context, 0, context.grammar_state)
        committed_length = state.cache.length

        def step(carry, index):
            token, g, cache, grammar_state = carry
            grammar_state = context.advance(grammar_state, token)
            logits, g_next, cache = self._step(draft_params, token[:, None], g[:, None], cache)
            following, probs = self._draft_token(draft_params, logits[:, 0], context, index, grammar_state)
            return (following, g_next[:, 0], cache.advance(jnp.ones_like(cache.length)), grammar_state), \
                (following, probs)

        (_, _, cache, _), (rest, rest_probs) = jax.lax.scan(
            step, (first, state.g_next, state.cache, context.grammar_state), jnp.arange(1, self.num_draft))
        drafts = jnp.concatenate([first[:, None], rest.T], axis=1)  # [B, k]
        probs = None
        if self.sample:
            probs = jnp.concatenate([first_probs[:, None], jnp.swapaxes(rest_probs, 0, 1)], axis=1)
        # The speculative slots stay written but uncommitted: the update overwrites them.
        state = state.replace(cache=cache.set_length(committed_length))
        return Proposal(drafts=drafts, num_proposed=jnp.full(first.shape, self.num_draft, jnp.int32),
                        probs=probs), state

    def _propose_tree(self, draft_params, state: HeadState, context: Context):
        """Grow the tree from the head's next-token logits: each frontier runs as one head step,
        fed its parent's g, at scratch slots past the committed length (rolled back after)."""
        committed_length, top_k = state.cache.length, self.tree.top_k

        def expand(cache, tokens, g, level, sees):
            offset, positions, mask = tree_lib.frontier_inputs(committed_length, level, top_k, sees)
            logits, g_next, cache = self._step(draft_params, tokens, g, cache.set_length(offset),
                                               positions=positions, tree_mask=mask)
            return logits, g_next, cache

        vocab_map = self._vocab_map(draft_params, state.next_logits.shape[-1])  # the head's ids -> target ids
        grown, cache = tree_lib.grow(self.tree, state.next_logits, state.g_next, expand,
                                     lambda ids: self._to_target(draft_params, ids), state.cache,
                                     tree_lib.GrowGrammar.of(context, vocab_map))
        return _tree_proposal(grown), state.replace(cache=cache.set_length(committed_length))

    def update(self, draft_params, state: HeadState, verified: Verified) -> HeadState:
        # Under a tree, `verified` is already the accepted path's: the head absorbs it like a chain.
        return self._absorb(draft_params, state.cache, verified.committed, verified.hiddens,
                            verified.num_committed)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Eagle3(_FeatureHead):
    """EAGLE-3 drafting (see jaxspec.models.eagle3 for the head): g = fc(three aux features).

    draft_params: {"head": head params, "embed": the target's embedding [V, D]}.
    """

    num_draft: int
    config: "eagle3.Eagle3Config"
    aux_layer_ids: tuple[int, ...]  # input-of-layer spelling (see models/eagle3.py)
    sample: bool = False
    sampler: SamplerSpec | None = None
    tree: DraftTree | None = None
    name: str = "eagle3"
    speaks_target_ids: bool = False  # its ids map through d2t, even when it has the target's V of them

    @property
    def target_hidden_layers(self) -> tuple[int, ...]:
        return eagle3.target_hidden_layers(self.aux_layer_ids)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def draft_inputs(self, target_params, draft_model_params):
        return {"head": draft_model_params, "embed": target_params.embed}

    def _encode(self, draft_params, hiddens):
        return eagle3.encode(draft_params["head"], hiddens)

    def _step(self, draft_params, tokens, g, cache, **tree_inputs):
        return eagle3.forward(draft_params["head"], self.config, draft_params["embed"], tokens, g, cache,
                              **tree_inputs)

    def _to_target(self, draft_params, ids):
        return eagle3.to_target_ids(draft_params["head"], ids)

    def _create_cache(self, batch, capacity):
        return eagle3.create_cache(self.config, batch, capacity)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Mtp(_FeatureHead):
    """MTP drafting (see jaxspec.models.mtp): the head reads the target's final-normed hidden
    state and speaks the target's vocabulary through the target's own lm_head.

    draft_params: {"head": head params, "embed": the target's embedding, "lm_head": its head}.
    """

    num_draft: int
    config: "mtp.MtpConfig"
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
        return mtp.forward(draft_params["head"], self.config, draft_params["embed"], draft_params["lm_head"],
                           tokens, g, cache, **tree_inputs)

    def _to_target(self, draft_params, ids):
        return ids

    def _create_cache(self, batch, capacity):
        return mtp.create_cache(self.config, batch, capacity)


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
    config: "assistant.AssistantConfig"
    target_config: Any  # the target's GemmaConfig: which of its layers hold the K/V, its embedding scale
    sample: bool = False
    sampler: SamplerSpec | None = None
    tree: DraftTree | None = None
    name: str = "assistant"

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
        return assistant.forward(draft_params["assistant"], self.config, self.target_config, draft_params["embed"],
                                 tokens, hidden, target_cache)

    def propose(self, draft_params, state: AssistantState, context: Context):
        pending = jnp.take_along_axis(context.tokens, (context.length - 1)[:, None], axis=1)[:, 0]
        if self.tree is not None:
            return self._propose_tree(draft_params, state, context, pending)

        def step(carry, index):
            token, hidden, grammar_state = carry
            logits, hidden = self._step(draft_params, token[:, None], hidden[:, None], context.target_cache)
            draft, probs = _next_token(logits[:, 0], context, index, self.sample, self.sampler,
                                       context.allowed(grammar_state))
            return (draft, hidden[:, 0], context.advance(grammar_state, draft)), (draft, probs)

        _, (drafts, probs) = jax.lax.scan(step, (pending, state.hidden, context.grammar_state),
                                          jnp.arange(self.num_draft))
        probs = jnp.swapaxes(probs, 0, 1) if self.sample else None  # [B, k, V]
        return Proposal(drafts=drafts.T, num_proposed=jnp.full(pending.shape, self.num_draft, jnp.int32),
                        probs=probs), state

    def _propose_tree(self, draft_params, state: AssistantState, context: Context, pending: jax.Array):
        """The root's children from one step on the pending token; each frontier then runs as T = top_k
        independent steps (the nodes do not see each other: the assistant attends to the target only)."""
        logits, hidden = self._step(draft_params, pending[:, None], state.hidden[:, None], context.target_cache)

        def expand(target_cache, tokens, hiddens, level, sees):
            logits, hiddens = self._step(draft_params, tokens, hiddens, target_cache)
            return logits, hiddens, target_cache

        grown, _ = tree_lib.grow(self.tree, logits[:, 0], hidden[:, 0], expand, lambda ids: ids, context.target_cache,
                                 tree_lib.GrowGrammar.of(context, None))
        return _tree_proposal(grown), state
