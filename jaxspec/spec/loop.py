"""The on-device generation loop (docs/design.md, "One target forward per round; the loop on device").

Generation is two jitted programs, `prefill` then `decode` (the host times each): `decode` is a
`lax.while_loop` of rounds until every row is done (EOS or a stop sequence, max_new_tokens, cache
capacity), with no host round trip per round. A round is draft -> verify -> accept -> commit: the
proposer drafts a tree of N nodes (a chain of k is the tree whose node v follows v - 1), the
target scores `[pending] + N` in one forward (T = N + 1; a tree under its ancestor mask), each
row accepts a root-to-node path of n tokens (jaxspec.spec.verify, one rule for both), a tree's
path K/V are gathered into contiguous slots, the cache advances by n + 1 and the bonus token
becomes the next pending one. Plain decoding is the same round with no proposer (N = 0). The
streaming path calls `prefill` and then `stream_step` (a round plus the tokens it committed) from
a Python loop.

Under constrained decoding (`Request.grammar`, jaxspec.grammar) each row carries its automaton
state; a verify masks position i's logits by the state d_1 .. d_i reach (so greedy acceptance and
rejection sampling both see the masked target), prompt-lookup drafts are cut at the first token
the grammar forbids, and a row whose grammar is complete stops ("stop"). With `LoopSpec.logprobs`
every committed token's log-prob under that final distribution is kept beside the history.

Invariant for a running row, with h = prompt_length + num_generated tokens of context:
    tokens[:h] is the prompt then the generated tokens; tokens[h - 1] is `pending` (committed,
    not yet run through the target); cache.length == h - 1.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec import models
from jaxspec.compilation import full_precision_products
from jaxspec.cache import Cache, KVFormat
from jaxspec.grammar import DEAD, GrammarTable
from jaxspec.sampling import SamplerSpec, SamplingParams, distribution, log_probs, masked, repeat_rows, select
from jaxspec.sharding import Plan, to_host
from jaxspec.spec import tree as tree_lib
from jaxspec.spec.proposers import Context, Prefill, Proposal, Proposer, Verified
from jaxspec.spec.tree import DraftTree
from jaxspec.spec.verify import accepted_prefix_length, chain_parents, greedy_accept, positional_seen
from jaxspec.spec import verify

# Sampled acceptance, by name here so a test can swap in a broken verifier (tests/test_spec_sampling.py).
rejection_sample = verify.rejection_sample

# finish_reason codes (int32 on device); FINISH_NAMES maps them for the host.
RUNNING, FINISH_STOP, FINISH_LENGTH, FINISH_CAPACITY = 0, 1, 2, 3
FINISH_NAMES = {RUNNING: None, FINISH_STOP: "stop", FINISH_LENGTH: "length", FINISH_CAPACITY: "capacity"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoopSpec:
    """Everything static about a generation call: changing any of it recompiles."""

    cfg: Any  # the target trunk's config (any registered family)
    capacity: int  # S: cache slots and token-history length per row
    sampler: SamplerSpec
    stop_sequences: tuple[tuple[int, ...], ...] = ()  # multi-token stops, matched on device
    proposer: Proposer | None = None  # None: plain decoding
    kv_format: KVFormat | None = None  # the target's K/V storage; None: the trunk's default (float32)
    attention: str = "auto"  # jaxspec.pallas.Attention: "auto" | "reference" | "native" | "pallas" | "interpret"
    # Decode forwards carry a multiple of this many tokens, B * T (jaxspec.models.backends,
    # `Backend.token_lanes`): 1 for width-invariant products (float32, or the native CPU kernels);
    # under XLA's int8 / bf16 products every token then takes the same code path in a step and in
    # a verify, so its logits are bitwise the same in both.
    token_lanes: int = 1
    # The target's layout over a device mesh (jaxspec.sharding.Plan), and the draft's; None: one
    # device. With one, the loop state is pinned to the mesh after the prefill and every round.
    sharding: Plan | None = None
    draft_sharding: Plan | None = None
    # Log-probs of every committed token and its `logprobs` best alternatives (0: the token's
    # own only); None: not computed (nothing extra in the program).
    logprobs: int | None = None
    # The residual streams a prefill with no proposer returns (`target_prefill_spec`: the
    # target's half of a prefill, shared by every proposer that reads the same streams).
    prefill_hidden_layers: tuple[int, ...] = ()

    @property
    def cache_options(self) -> dict:  # for models.create_cache: nothing unless asked (other trunks)
        return {} if self.kv_format is None else {"kv_format": self.kv_format}

    @property
    def forward_options(self) -> dict:  # for models.forward
        return {} if self.attention == "auto" else {"attention": self.attention}

    @property
    def num_draft(self) -> int:  # k: the most drafts a round accepts (a tree's depth)
        return 0 if self.proposer is None else self.proposer.num_draft

    @property
    def tree(self) -> DraftTree | None:
        return None if self.proposer is None else self.proposer.tree

    @property
    def round_width(self) -> int:
        return round_width(self.proposer, self.token_lanes)

    @property
    def hidden_layers(self) -> tuple[int, ...]:  # what the proposer reads from each target forward
        return self.prefill_hidden_layers if self.proposer is None else self.proposer.target_hidden_layers

    @property
    def target_prefill_spec(self) -> "LoopSpec":
        """This spec less its proposer: what `prefill_target` depends on, so plain decoding, prompt
        lookup and a draft model (which read no stream of the target) share one compiled prefill."""
        return dataclasses.replace(self, proposer=None, draft_sharding=None,
                                   prefill_hidden_layers=self.hidden_layers)


@struct.dataclass
class Request:
    """Per-call numbers, as arrays so new values never recompile."""

    prompt: jax.Array  # int32[B, P]: right-padded to a bucketed P
    prompt_length: jax.Array  # int32[B]
    max_new_tokens: jax.Array  # int32[B]
    sampling: SamplingParams
    key: jax.Array  # PRNG key
    # int32[N]: EOS and the user's stop tokens, padded with -1 to a bucketed N (an array, so a new
    # stop set or ignore_eos does not recompile); None: no stop tokens.
    stop_token_ids: jax.Array | None = None
    # Constrained decoding (jaxspec.grammar): every row's automaton merged into one table, and
    # each row's start state (grammar.FREE for an unconstrained row). None: no grammar.
    grammar: GrammarTable | None = None
    grammar_start: jax.Array | None = None  # int32[B]


@struct.dataclass
class RoundStats:
    """Counters of the speculative rounds, summed on device."""

    rounds: jax.Array  # int32[B]: verify forwards this row took part in
    proposed: jax.Array  # int32[B]: real (not padding) draft tokens
    accepted: jax.Array  # int32[B]: accepted draft tokens
    multi_token_rounds: jax.Array  # int32[B]: rounds that accepted at least one draft
    proposed_at: jax.Array  # int32[k]: rows that proposed a draft at position i, over rounds
    accepted_at: jax.Array  # int32[k]: rows that accepted the draft at position i, over rounds
    accepted_hist: jax.Array  # int32[k+1]: rounds (summed over rows) that accepted exactly n drafts

    @classmethod
    def zeros(cls, batch: int, k: int) -> "RoundStats":
        per_row = jnp.zeros((batch,), jnp.int32)
        per_position = jnp.zeros((k,), jnp.int32)
        return cls(per_row, per_row, per_row, per_row, per_position, per_position, jnp.zeros((k + 1,), jnp.int32))


@struct.dataclass
class TokenLogprobs:
    """Log-probs of committed tokens under the target's final distribution (jaxspec.sampling.log_probs:
    processors and temperature, then the grammar's mask), and the best alternatives there.
    Per round [B, k+1]; in the loop state, over the token history [B, S] (prompt slots unused)."""

    chosen: jax.Array  # float32[B, T]: the committed token's
    top_ids: jax.Array  # int32[B, T, N]: the N most likely tokens, best first
    top_logprobs: jax.Array  # float32[B, T, N]

    @classmethod
    def zeros(cls, batch: int, steps: int, top: int) -> "TokenLogprobs":
        return cls(jnp.zeros((batch, steps), jnp.float32), jnp.zeros((batch, steps, top), jnp.int32),
                   jnp.zeros((batch, steps, top), jnp.float32))


@struct.dataclass
class DecodeState:
    cache: Cache  # the target's: a KVCache, or a hybrid trunk's cache (jaxspec.cache.Cache)
    tokens: jax.Array  # int32[B, S]: prompt then generated tokens (EOS included if it ended the row)
    prompt_length: jax.Array  # int32[B]
    num_generated: jax.Array  # int32[B]
    finish_reason: jax.Array  # int32[B]: RUNNING until the row is done
    seen: jax.Array | None  # bool[B, V]: prompt + output tokens, for the repetition penalty
    key: jax.Array
    proposer_state: object  # the proposer's own pytree (a draft KV cache, ...), or None
    stats: RoundStats
    target_forwards: jax.Array  # int32[]: decode forwards of the target (prefill excluded)
    grammar_state: jax.Array | None = None  # int32[B]: each row's automaton state after its committed tokens
    logprobs: TokenLogprobs | None = None  # over the history [B, S], when LoopSpec.logprobs is set

    @property
    def running(self) -> jax.Array:  # bool[B]
        return self.finish_reason == RUNNING

    @property
    def context(self) -> Context:
        return Context(tokens=self.tokens, length=self.prompt_length + self.num_generated)

    @property
    def pending(self) -> jax.Array:  # int32[B]: the last committed token, not yet in the cache
        last = self.prompt_length + self.num_generated - 1
        return jnp.take_along_axis(self.tokens, last[:, None], axis=1)[:, 0]


def _stop_hits(tokens: jax.Array, ends: jax.Array, first_generated: jax.Array, request: Request,
               spec: LoopSpec) -> jax.Array:
    """Whether a stop token or a stop sequence ends at each position `ends` int32[B, T].

    Sequences match generated tokens only (from `first_generated` int32[B] on). -> bool[B, T]
    """
    size = tokens.shape[1]
    last = jnp.take_along_axis(tokens, jnp.clip(ends, 0, size - 1), axis=1)  # [B, T]
    hit = jnp.zeros(ends.shape, bool)
    if request.stop_token_ids is not None:
        hit = jnp.any(last[..., None] == request.stop_token_ids, axis=-1)  # [B, T, N] -> [B, T]
    for sequence in spec.stop_sequences:
        match = ends - (len(sequence) - 1) >= first_generated[:, None]
        for back, token in enumerate(reversed(sequence)):
            at = jnp.clip(ends - back, 0, size - 1)
            match &= jnp.take_along_axis(tokens, at, axis=1) == token
        hit |= match
    return hit


def _scatter_row(row: jax.Array, at: jax.Array, values: jax.Array) -> jax.Array:
    """row[at] = values for one row ([S] <- [T]; positions past the end dropped). Vmapped over
    rows, the scatter's batch dimension is explicit, so on a mesh each "data" shard writes its own
    rows without gathering the others' indices."""
    return row.at[at].set(values, mode="drop")


def commit_tokens(state: DecodeState, new_tokens: jax.Array, counts: jax.Array,
                  request: Request, spec: LoopSpec, logprobs: TokenLogprobs | None = None) -> DecodeState:
    """Append the first `counts[b]` of `new_tokens` [B, T] to each running row (and their
    log-probs, when the loop keeps them).

    Stops are checked at every appended position and the earliest wins: a row whose second
    accepted token is EOS keeps two tokens however many were accepted, and max_new_tokens is
    never overshot. Under a grammar, a token after which the grammar is complete (nothing but
    EOS may follow, or EOS itself) is a stop too. Finished rows are left untouched.
    """
    batch, steps = new_tokens.shape
    size = state.tokens.shape[1]
    counts = jnp.where(state.running, counts, 0)
    offsets = jnp.arange(steps, dtype=jnp.int32)[None, :]  # [1, T]
    generated_index = state.num_generated[:, None] + offsets  # [B, T]: index among generated tokens
    at = state.prompt_length[:, None] + generated_index  # [B, T]: index in the history
    valid = offsets < counts[:, None]
    tokens = jax.vmap(_scatter_row)(state.tokens, jnp.where(valid, at, size), new_tokens)

    stop_hit = _stop_hits(tokens, at, state.prompt_length, request, spec) & valid
    grammar_after = None
    if request.grammar is not None:
        grammar_after = _walk(request.grammar, state.grammar_state, new_tokens)[:, 1:]  # [B, T]
        stop_hit |= request.grammar.ended(grammar_after) & valid
    length_hit = (generated_index + 1 >= request.max_new_tokens[:, None]) & valid
    ends = stop_hit | length_hit
    first_end = jnp.argmax(ends, axis=1)  # earliest ending position among the new ones
    ended = jnp.any(ends, axis=1)
    kept = jnp.where(ended, first_end + 1, counts)  # int32[B]
    stopped = jnp.take_along_axis(stop_hit, first_end[:, None], axis=1)[:, 0]
    finish_reason = jnp.where(ended, jnp.where(stopped, FINISH_STOP, FINISH_LENGTH), state.finish_reason)
    num_generated = state.num_generated + kept
    # Tokens written past an early stop are blanked so the history reads clean.
    tokens = jnp.where(jnp.arange(size)[None, :] < (state.prompt_length + num_generated)[:, None], tokens, 0)

    seen = state.seen
    if seen is not None:
        seen_at = jnp.where(offsets < kept[:, None], new_tokens, seen.shape[1])
        seen = jax.vmap(_scatter_row)(seen, seen_at, jnp.ones(seen_at.shape, bool))
    grammar_state = state.grammar_state
    if grammar_after is not None:
        last_kept = jnp.take_along_axis(grammar_after, jnp.maximum(kept - 1, 0)[:, None], axis=1)[:, 0]
        grammar_state = jnp.where(kept > 0, last_kept, grammar_state)
    history_logprobs = state.logprobs
    if logprobs is not None:
        write_at = jnp.where(offsets < kept[:, None], at, size)
        history_logprobs = jax.tree.map(lambda history, new: jax.vmap(_scatter_row)(history, write_at, new),
                                        history_logprobs, logprobs)
    return state.replace(tokens=tokens, num_generated=num_generated, finish_reason=finish_reason, seen=seen,
                         grammar_state=grammar_state, logprobs=history_logprobs)


def _walk(grammar: GrammarTable, start: jax.Array, tokens: jax.Array, parents: jax.Array | None = None) -> jax.Array:
    """The automaton states along a draft: start int32[B] (the root's state), tokens int32[B, N]
    and their parents int32[B, N] (verify indices, parents first; None: a chain, each token after
    the one before) -> int32[B, 1+N], the root's state and each token's after its path (a
    forbidden token leads to DEAD)."""
    batch, size = tokens.shape
    if size == 0:  # a plain step's empty draft
        return start[:, None]
    parents = chain_parents(batch, size) if parents is None else parents
    states = jnp.zeros((batch, size + 1), jnp.int32).at[:, 0].set(start)

    def node(v, states):  # node v's parent has its state already
        parent = jax.lax.dynamic_index_in_dim(parents, v - 1, axis=1, keepdims=True)  # [B, 1]
        parent_state = jnp.take_along_axis(states, parent, axis=1)[:, 0]
        token = jax.lax.dynamic_index_in_dim(tokens, v - 1, axis=1, keepdims=False)  # [B]
        return states.at[:, v].set(grammar.advance(parent_state, token))

    return jax.lax.fori_loop(1, size + 1, node, states)


def _token_logprobs(logits: jax.Array, tokens: jax.Array, seen: jax.Array | None, request: Request,
                    spec: LoopSpec) -> TokenLogprobs:
    """Log-probs of `tokens` int32[B, T] and the best `spec.logprobs` alternatives, from each
    position's (grammar-masked) logits [B, T, V] and repetition-penalty context bool[B, T, V]."""
    batch, steps, vocab = logits.shape
    flat_seen = None if seen is None else seen.reshape(batch * steps, vocab)
    logprobs = log_probs(logits.reshape(batch * steps, vocab), repeat_rows(request.sampling, steps), spec.sampler,
                         flat_seen).reshape(batch, steps, vocab)
    chosen = jnp.take_along_axis(logprobs, tokens[..., None], axis=-1)[..., 0]
    if spec.logprobs == 0:
        return TokenLogprobs(chosen, jnp.zeros((batch, steps, 0), jnp.int32), jnp.zeros((batch, steps, 0)))
    top_logprobs, top_ids = jax.lax.top_k(logprobs, spec.logprobs)
    return TokenLogprobs(chosen, top_ids.astype(jnp.int32), top_logprobs)


def padded_tokens(tokens: int, batch: int, lanes: int) -> int:
    """The fewest tokens per row, at least `tokens`, for which a forward's batch * T tokens fill
    whole groups of `lanes` (batch 8 needs no filler at T = 1)."""
    padded = tokens
    while batch * padded % lanes:
        padded += 1
    return padded


def round_width(proposer: Proposer | None, token_lanes: int) -> int:
    """Cache slots a round may write past a row's length: the verify's k + 1 (a tree's
    1 + num_nodes) padded to the token lanes at batch 1 (the most), or a tree drafter's scratch
    slots, whichever reaches further."""
    tree = None if proposer is None else proposer.tree
    if tree is None:
        return padded_tokens((0 if proposer is None else proposer.num_draft) + 1, 1, token_lanes)
    return max(padded_tokens(1 + tree.num_nodes, 1, token_lanes), 1 + tree.scratch_slots)


def _check_capacity(state: DecodeState, spec: LoopSpec) -> DecodeState:
    """A row whose next round (`round_width` cache slots) would not fit is done ("capacity")."""
    full = state.running & (state.cache.length + spec.round_width > spec.capacity)
    return state.replace(finish_reason=jnp.where(full, FINISH_CAPACITY, state.finish_reason))


def _laid_out(state: DecodeState, spec: LoopSpec) -> DecodeState:
    """The loop state pinned to the mesh (nothing on one device): the target's cache by its
    logical axes (rows over "data", kv heads over "model"), per-row arrays by rows, the
    proposer's state by the draft's plan. The while loop's carry then keeps one layout, which
    XLA would otherwise pick by propagation (and may replicate, gathering to every device)."""
    plan = spec.sharding
    if plan is None:
        return state
    rows, stats = plan.constrain_rows, state.stats
    return state.replace(
        cache=plan.constrain(state.cache, state.cache.logical_axes()),
        tokens=rows(state.tokens), prompt_length=rows(state.prompt_length), num_generated=rows(state.num_generated),
        finish_reason=rows(state.finish_reason), seen=rows(state.seen), grammar_state=rows(state.grammar_state),
        logprobs=rows(state.logprobs),
        proposer_state=(spec.draft_sharding or plan).constrain_state(state.proposer_state, state.num_generated.shape[0]),
        stats=stats.replace(rounds=rows(stats.rounds), proposed=rows(stats.proposed), accepted=rows(stats.accepted),
                            multi_token_rounds=rows(stats.multi_token_rounds)),
    )


def prefill(params, draft_params, request: Request, spec: LoopSpec) -> DecodeState:
    """Run the prompts, sample each row's first token, set up the proposer and the loop state."""
    state, prefilled = prefill_target(params, request, spec)
    return start(draft_params, state, prefilled, spec)


def prefill_target(params, request: Request, spec: LoopSpec) -> tuple[DecodeState, Prefill]:
    """The target's half of `prefill`: the prompts through the trunk, each row's first token
    sampled and committed. The state has no proposer yet (`start` sets it up from the returned
    `Prefill`); nothing here reads `spec.proposer` beyond its hidden layers."""
    cfg = spec.cfg
    batch, prompt_size = request.prompt.shape
    cache = models.create_cache(cfg, batch, spec.capacity, **spec.cache_options)
    with jax.named_scope("prefill"):
        logits, hiddens, cache = models.forward(
            params, cfg, request.prompt, cache, logit_indices=(request.prompt_length - 1)[:, None],
            hidden_layers=spec.hidden_layers, **spec.forward_options)
    cache = cache.set_length(request.prompt_length)
    in_prompt = jnp.arange(prompt_size)[None, :] < request.prompt_length[:, None]
    seen = None
    if spec.sampler.repetition_penalty:
        seen_at = jnp.where(in_prompt, request.prompt, cfg.vocab_size)
        seen = jnp.zeros((batch, cfg.vocab_size), bool).at[jnp.arange(batch)[:, None], seen_at].set(
            True, mode="drop")
    key, step_key = jax.random.split(request.key)
    allowed = None if request.grammar is None else request.grammar.allowed(request.grammar_start)  # [B, V]
    first_logits = masked(logits[:, 0], allowed)
    first = select(first_logits, request.sampling, spec.sampler, step_key, seen)
    history = jnp.zeros((batch, spec.capacity), jnp.int32)
    history = history.at[:, :prompt_size].set(jnp.where(in_prompt, request.prompt, 0)[:, :spec.capacity])
    state = DecodeState(
        cache=cache,
        tokens=history,
        prompt_length=request.prompt_length,
        num_generated=jnp.zeros((batch,), jnp.int32),
        finish_reason=jnp.full((batch,), RUNNING, jnp.int32),
        seen=seen,
        key=key,
        proposer_state=None,
        stats=RoundStats.zeros(batch, 0),
        target_forwards=jnp.zeros((), jnp.int32),
        grammar_state=request.grammar_start,
        logprobs=None if spec.logprobs is None else TokenLogprobs.zeros(batch, spec.capacity, spec.logprobs),
    )
    first_logprobs = None
    if spec.logprobs is not None:
        first_logprobs = _token_logprobs(first_logits[:, None], first[:, None], None if seen is None else seen[:, None],
                                         request, spec)
    state = commit_tokens(state, first[:, None], jnp.ones((batch,), jnp.int32), request, spec, first_logprobs)
    return state, Prefill(prompt=request.prompt, prompt_length=request.prompt_length, first_token=first,
                          hiddens=hiddens)


def start(draft_params, state: DecodeState, prefilled: Prefill, spec: LoopSpec) -> DecodeState:
    """The proposer's half of `prefill`: its state from the target's prefill, the round counters
    sized to its k, and the loop state laid out for the rounds."""
    proposer_state = None
    if spec.proposer is not None:
        with jax.named_scope("proposer_init"):
            proposer_state = spec.proposer.init(draft_params, prefilled, spec.capacity)
    state = state.replace(proposer_state=proposer_state,
                          stats=RoundStats.zeros(state.prompt_length.shape[0], spec.num_draft))
    return _laid_out(_check_capacity(state, spec), spec)


def _count_round(stats: RoundStats, running: jax.Array, num_proposed: jax.Array, reach: jax.Array,
                 accepted: jax.Array, k: int) -> RoundStats:
    """Add one round: `num_proposed` real drafts per row, reaching `reach` positions deep (a
    chain's num_proposed, a tree's deepest node), of which `accepted` were accepted."""
    live = running.astype(jnp.int32)
    num_proposed, reach, accepted = num_proposed * live, reach * live, accepted * live
    positions = jnp.arange(k)[None, :]
    return RoundStats(
        rounds=stats.rounds + live,
        proposed=stats.proposed + num_proposed,
        accepted=stats.accepted + accepted,
        multi_token_rounds=stats.multi_token_rounds + (accepted > 0),
        proposed_at=stats.proposed_at + jnp.sum(positions < reach[:, None], axis=0),
        accepted_at=stats.accepted_at + jnp.sum(positions < accepted[:, None], axis=0),
        accepted_hist=stats.accepted_hist + jnp.sum(
            (jnp.arange(k + 1)[None, :] == accepted[:, None]) & running[:, None], axis=0),
    )


@struct.dataclass
class Outcome:
    """What a verify decided, in chain form: a tree's accepted path is already gathered."""

    accepted: jax.Array  # int32[B]: n
    committed: jax.Array  # int32[B, k+1]: n drafts, the bonus token, padding
    hiddens: tuple[jax.Array, ...]  # the proposer's target features at the committed positions, [B, k+1, D]
    cache: Cache  # advanced by each running row's n + 1
    path: jax.Array  # int32[B, k+1]: the accepted verify indices (root first; a chain's are 0 .. n)
    logprobs: TokenLogprobs | None = None  # of the committed tokens [B, k+1], when LoopSpec.logprobs is set

    def padded_to(self, steps: int) -> "Outcome":
        """Every per-position array [B, T, ...] padded along T to `steps` (a plain step's one
        position, as a round of k + 1); the cache is the round's already."""
        committed, hiddens, path, logprobs = jax.tree.map(
            lambda x: jnp.pad(x, ((0, 0), (0, steps - x.shape[1])) + ((0, 0),) * (x.ndim - 2)),
            (self.committed, self.hiddens, self.path, self.logprobs))
        return self.replace(committed=committed, hiddens=hiddens, path=path, logprobs=logprobs)


def _filler(tokens: jax.Array, spec: LoopSpec) -> tuple[jax.Array, jax.Array | None]:
    """Filler tokens after the real ones (LoopSpec.token_lanes). Their K/V land past every row's
    length, where the next round overwrites them; only the real tokens get logits.
    tokens int32[B, T] -> (int32[B, T'] padded, logit_indices int32[B, T] or None)."""
    batch, steps = tokens.shape
    filler = padded_tokens(steps, batch, spec.token_lanes) - steps
    if not filler:
        return tokens, None
    return jnp.pad(tokens, ((0, 0), (0, filler))), jnp.broadcast_to(jnp.arange(steps, dtype=jnp.int32), (batch, steps))


def _verify(params, state: DecodeState, request: Request, spec: LoopSpec, proposal: Proposal,
            key: jax.Array) -> Outcome:
    """Score the pending token and the draft in one target forward and accept per row.

    A proposer that can abstain (prompt lookup without a match) may leave every running row
    without a draft: that round scores the pending token alone (width 0, a plain step), since a
    forward over nothing but filler costs several times a T = 1 step. Both commit the same token:
    with no draft the bonus is the target's own next token, from the same p. The outputs are padded
    to the full round's shape; the caches match because both commit them (a hybrid cache's pending
    per-position states differ in shape with T; committed, they do not).
    """
    if not (spec.proposer is not None and spec.proposer.can_abstain and spec.num_draft):
        return _score(params, state, request, spec, proposal, key)

    def nothing_to_verify(_):
        empty = Proposal(drafts=proposal.drafts[:, :0], num_proposed=jnp.zeros_like(proposal.num_proposed))
        return _score(params, state, request, spec, empty, key).padded_to(spec.num_draft + 1)

    anything_to_verify = jnp.any((proposal.num_proposed > 0) & state.running)
    return jax.lax.cond(anything_to_verify, lambda _: _score(params, state, request, spec, proposal, key),
                        nothing_to_verify, None)


def _score(params, state: DecodeState, request: Request, spec: LoopSpec, proposal: Proposal,
           key: jax.Array) -> Outcome:
    """One verify forward over [pending] + the draft's N nodes, and acceptance (jaxspec.spec.verify).

    A chain (`proposal.parents` None: node v's parent is v - 1) runs under the trunk's own causal
    mask. A tree runs under its ancestor mask (node v at slot length + v, RoPE position
    length + depth(v)), and its accepted path's K/V are then gathered into slots length ..
    length + n. The cache comes back advanced by each running row's n + 1 (the rest rolled back by
    length; a hybrid cache selects its recorded state).
    """
    drafts, num_proposed = proposal.drafts, proposal.num_proposed
    batch, width = drafts.shape
    is_tree = proposal.parents is not None
    if is_tree and proposal.probs is not None:  # verify.rejection_sample's q is a chain's
        raise RuntimeError(f"{spec.proposer.name} proposed a tree with draft probabilities: tree nodes are "
                           "point masses")
    parents = proposal.parents if is_tree else chain_parents(batch, width)
    depth = spec.tree.depth if is_tree else width
    size = width + 1
    tokens = jnp.concatenate([state.pending[:, None], drafts], axis=1)  # [B, 1+N]
    verify_tokens, logit_indices = _filler(tokens, spec)
    tree_inputs = {}
    if is_tree:
        steps = verify_tokens.shape[1]
        depths = jnp.pad(tree_lib.node_depths(parents, depth), ((0, 0), (0, steps - size)))
        tree_inputs = dict(positions=state.cache.length[:, None] + depths,
                           tree_mask=tree_lib.verify_mask(parents, depth, state.cache.length, steps))
    logits, hiddens, cache = models.forward(params, spec.cfg, verify_tokens, state.cache, logit_indices=logit_indices,
                                            hidden_layers=spec.hidden_layers, **tree_inputs, **spec.forward_options)
    logits = logits[:, :size]  # [B, 1+N, V]
    if request.grammar is not None:
        # Node v is scored after its path: masked by the state the path reaches. A node the
        # grammar forbids is never accepted (the masked target gives it p = 0), nor anything below it.
        logits = masked(logits, request.grammar.allowed(_walk(request.grammar, state.grammar_state, drafts, parents)))
    # Each position's repetition-penalty context counts the drafts on its path.
    seen = None if state.seen is None else positional_seen(state.seen, tokens,
                                                           tree_lib.ancestor_mask(parents, depth))  # [B, 1+N, V]
    if spec.sampler.greedy and not spec.sampler.repetition_penalty:
        outcome = greedy_accept(state.pending, drafts, parents, num_proposed, logits, depth)
    else:  # greedy rows are point masses: the same rule is exact
        outcome = rejection_sample(state.pending, drafts, parents, num_proposed, proposal.probs,
                                   _target_probs(logits, seen, request, spec), key, depth)
    hiddens = tuple(tree_lib.gather_path(h[:, :size], outcome.path) for h in hiddens)
    if is_tree:  # a chain's path is its first n + 1 slots already
        cache = cache.commit_path(outcome.path)
    logprobs = None
    if spec.logprobs is not None:  # each committed token's distribution is its parent's on the path
        logprobs = _token_logprobs(tree_lib.gather_path(logits, outcome.path), outcome.committed,
                                   None if seen is None else tree_lib.gather_path(seen, outcome.path), request, spec)
    return Outcome(accepted=outcome.accepted, committed=outcome.committed, hiddens=hiddens, path=outcome.path,
                   cache=cache.advance(jnp.where(state.running, outcome.accepted + 1, 0)), logprobs=logprobs)


def _target_probs(logits: jax.Array, seen: jax.Array | None, request: Request, spec: LoopSpec) -> jax.Array:
    """The target's processed distribution p at every verify position: logits [B, T, V] and
    each position's repetition-penalty context bool[B, T, V] (or None) -> [B, T, V]."""
    batch, steps, vocab = logits.shape
    seen = None if seen is None else seen.reshape(batch * steps, vocab)
    probs = distribution(logits.reshape(batch * steps, vocab), repeat_rows(request.sampling, steps), spec.sampler, seen)
    return probs.reshape(batch, steps, vocab)


def round_step(params, draft_params, state: DecodeState, request: Request, spec: LoopSpec) -> DecodeState:
    """One round: draft (a chain of k, or a tree), verify in one target forward, commit n + 1 per row."""
    batch = state.num_generated.shape[0]
    k = spec.num_draft
    proposer_state = state.proposer_state
    key, propose_key, verify_key = jax.random.split(state.key, 3)
    if spec.proposer is not None:
        with jax.named_scope("propose"):
            context = state.context.replace(key=propose_key, sampling=request.sampling, grammar=request.grammar,
                                            grammar_state=state.grammar_state, target_cache=state.cache)
            proposal, proposer_state = spec.proposer.propose(draft_params, proposer_state, context)
    else:
        proposal = Proposal(drafts=jnp.zeros((batch, 0), jnp.int32), num_proposed=jnp.zeros((batch,), jnp.int32))

    if request.grammar is not None and proposal.parents is None and proposal.probs is None:
        proposal = _cut_to_grammar(proposal, state, request)
    running = state.running
    with jax.named_scope("verify"):
        outcome = _verify(params, state, request, spec, proposal, verify_key)
    accepted = outcome.accepted
    num_committed = jnp.where(running, accepted + 1, 0)
    if spec.proposer is not None:
        verified = Verified(accepted=accepted, committed=outcome.committed, num_committed=num_committed,
                            hiddens=outcome.hiddens, path=outcome.path)
        proposer_state = spec.proposer.update(draft_params, proposer_state, verified)
    num_proposed = proposal.num_proposed
    reach = num_proposed  # a chain's deepest real node; a tree's:
    if proposal.parents is not None:
        depths = tree_lib.node_depths(proposal.parents, spec.tree.depth)[:, 1:]
        reach = jnp.max(jnp.where(jnp.arange(depths.shape[1])[None, :] < num_proposed[:, None], depths, 0),
                        axis=1, initial=0)
    state = state.replace(
        cache=outcome.cache, key=key, proposer_state=proposer_state,
        stats=_count_round(state.stats, running, num_proposed, reach, accepted, k),
        target_forwards=state.target_forwards + 1,
    )
    state = commit_tokens(state, outcome.committed, accepted + 1, request, spec, outcome.logprobs)
    return _laid_out(_check_capacity(state, spec), spec)


def _cut_to_grammar(proposal: Proposal, state: DecodeState, request: Request) -> Proposal:
    """Point-mass drafts (prompt lookup, argmax drafts) end at the first token the grammar forbids,
    before the verify: a round left with no draft in any row runs as a T = 1 step. Exact:
    rejecting such a draft would draw the same (p(x) = 0 under the mask, and p without x is p).
    Sampled drafts are left to rejection, exact for any q (model drafters draw from masked q)."""
    after = _walk(request.grammar, state.grammar_state, proposal.drafts)[:, 1:]  # [B, k]: DEAD once forbidden
    stands = accepted_prefix_length(after != DEAD)
    return proposal.replace(num_proposed=jnp.minimum(proposal.num_proposed, stands))


@struct.dataclass
class Committed:
    """What one round committed, for a host that streams: only these cross to the host."""

    tokens: jax.Array  # int32[B, k+1]: the round's tokens per row, padding past `count`
    count: jax.Array  # int32[B]: how many of them each row committed (0 for finished rows)
    running: jax.Array  # bool[B]: rows still running after the round


def stream_step(params, draft_params, state: DecodeState, request: Request,
                spec: LoopSpec) -> tuple[DecodeState, Committed]:
    """`round_step`, plus the tokens it committed, so a streaming host copies k + 1 tokens per
    row each round rather than the whole [B, S] history."""
    before = state.prompt_length + state.num_generated  # [B]: where this round's tokens start
    state = round_step(params, draft_params, state, request, spec)
    size = state.tokens.shape[1]
    at = jnp.clip(before[:, None] + jnp.arange(spec.num_draft + 1)[None, :], 0, size - 1)  # [B, k+1]
    committed = Committed(tokens=jnp.take_along_axis(state.tokens, at, axis=1),
                          count=state.prompt_length + state.num_generated - before, running=state.running)
    return state, committed


def decode(params, draft_params, state: DecodeState, request: Request, spec: LoopSpec) -> DecodeState:
    """Rounds until every row is done, on device: one `lax.while_loop`, no host round trip."""
    return jax.lax.while_loop(
        lambda s: jnp.any(s.running),
        lambda s: round_step(params, draft_params, s, request, spec),
        state,
    )


def generated_tokens(state: DecodeState, rows: int) -> list[list[int]]:
    """Each of the first `rows` rows' generated ids, copied to the host (gathered from every
    process under a multi-host mesh)."""
    history, starts, counts = to_host((state.tokens, state.prompt_length, state.num_generated))
    return [history[row, starts[row]: starts[row] + counts[row]].tolist() for row in range(rows)]


# The jitted entry points. `spec` is static (hashable); jit's own cache keeps one program per
# (spec, argument shapes), and XLA's persistent cache (jaxspec.compilation) keeps it across runs.
# Each traces with float32 products at full precision (jaxspec.compilation, Numerics).
prefill_jit = jax.jit(full_precision_products(prefill), static_argnames=("spec",))
# The same prefill as two programs (`prefill_target` with `spec.target_prefill_spec`, then
# `start`), so methods that differ only in their proposer compile the trunk's prefill once.
prefill_target_jit = jax.jit(full_precision_products(prefill_target), static_argnames=("spec",))
start_jit = jax.jit(full_precision_products(start), static_argnames=("spec",), donate_argnames=("state",))
decode_jit = jax.jit(full_precision_products(decode), static_argnames=("spec",), donate_argnames=("state",))
stream_step_jit = jax.jit(full_precision_products(stream_step), static_argnames=("spec",), donate_argnames=("state",))


def prefill_in_two(params, draft_params, request: Request, spec: LoopSpec) -> DecodeState:
    """`prefill_jit`'s result from `prefill_target_jit` (shared across proposers) and `start_jit`."""
    state, prefilled = prefill_target_jit(params, request, spec=spec.target_prefill_spec)
    return start_jit(draft_params, state, prefilled, spec=spec)
