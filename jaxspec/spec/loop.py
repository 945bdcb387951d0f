"""The on-device generation loop (DESIGN.md contracts 2-6).

`run` is one jitted program: prefill, then a `lax.while_loop` of rounds until every row is done
(EOS or a stop sequence, max_new_tokens, cache capacity); no host round trip per round. A round
is draft -> verify -> accept -> commit: the proposer drafts k tokens, the target scores
`[pending, d_1 .. d_k]` in one forward (T = k+1), each row accepts its own n, the cache advances
by n + 1 and the bonus token becomes the next pending one. Plain decoding is the same round with
no proposer (k = 0). `generate` runs `prefill` and `decode` as two jitted calls (the host
times each); the streaming path calls `prefill` and then `stream_step` (a round plus the tokens it
committed) from a Python loop.

Invariant for a running row, with h = prompt_length + num_generated tokens of context:
    tokens[:h] is the prompt then the generated tokens; tokens[h - 1] is `pending` (committed,
    not yet run through the target); cache.length == h - 1.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxspec import models
from jaxspec.cache import Cache, KVFormat
from jaxspec.config import ModelConfig
from jaxspec.models.qwen35 import Qwen35Config
from jaxspec.sampling import SamplerSpec, SamplingParams, distribution, repeat_rows, select
from jaxspec.spec.proposers import Context, Prefill, Proposer, Verified
from jaxspec.spec.verify import greedy_accept, positional_seen, rejection_sample

# finish_reason codes (int32 on device); FINISH_NAMES maps them for the host.
RUNNING, FINISH_STOP, FINISH_LENGTH, FINISH_CAPACITY = 0, 1, 2, 3
FINISH_NAMES = {RUNNING: None, FINISH_STOP: "stop", FINISH_LENGTH: "length", FINISH_CAPACITY: "capacity"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoopSpec:
    """Everything static about a generation call: changing any of it recompiles."""

    cfg: ModelConfig | Qwen35Config  # the target trunk's config (any registered family)
    capacity: int  # S: cache slots and token-history length per row
    sampler: SamplerSpec
    stop_sequences: tuple[tuple[int, ...], ...] = ()  # multi-token stops, matched on device
    proposer: Proposer | None = None  # None: plain decoding
    kv_format: KVFormat | None = None  # the target's K/V storage; None: the trunk's default (float32)
    attention: str = "auto"  # jaxspec.pallas.Attention: "auto" | "reference" | "pallas" | "interpret"
    # Decode forwards carry a multiple of this many tokens, B * T (jaxspec.models.quant.token_lanes):
    # 1 for float32 weights; under int8 / bf16 every token then takes the same code path in a
    # step and in a verify, so its logits are bitwise the same in both.
    token_lanes: int = 1

    @property
    def cache_options(self) -> dict:  # for models.create_cache: nothing unless asked (other trunks)
        return {} if self.kv_format is None else {"kv_format": self.kv_format}

    @property
    def forward_options(self) -> dict:  # for models.forward
        return {} if self.attention == "auto" else {"attention": self.attention}

    @property
    def num_draft(self) -> int:  # k
        return 0 if self.proposer is None else self.proposer.num_draft

    @property
    def round_width(self) -> int:  # cache slots a round may write: k + 1 padded, at batch 1 (the most)
        return padded_tokens(self.num_draft + 1, 1, self.token_lanes)

    @property
    def hidden_layers(self) -> tuple[int, ...]:  # what the proposer reads from each target forward
        return () if self.proposer is None else self.proposer.target_hidden_layers


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


@struct.dataclass
class RoundStats:
    """Counters of the speculative rounds, summed on device."""

    rounds: jax.Array  # int32[B]: verify forwards this row took part in
    proposed: jax.Array  # int32[B]: real (not padding) draft tokens
    accepted: jax.Array  # int32[B]: accepted draft tokens
    multi_token_rounds: jax.Array  # int32[B]: rounds that accepted at least one draft
    proposed_at: jax.Array  # int32[k]: rows that proposed a draft at position i, over rounds
    accepted_at: jax.Array  # int32[k]: rows that accepted the draft at position i, over rounds

    @classmethod
    def zeros(cls, batch: int, k: int) -> "RoundStats":
        per_row = jnp.zeros((batch,), jnp.int32)
        per_position = jnp.zeros((k,), jnp.int32)
        return cls(per_row, per_row, per_row, per_row, per_position, per_position)


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


def commit_tokens(state: DecodeState, new_tokens: jax.Array, counts: jax.Array,
                  request: Request, spec: LoopSpec) -> DecodeState:
    """Append the first `counts[b]` of `new_tokens` [B, T] to each running row.

    Stops are checked at every appended position and the earliest wins: a row whose second
    accepted token is EOS keeps two tokens however many were accepted, and max_new_tokens is
    never overshot. Finished rows are left untouched.
    """
    batch, steps = new_tokens.shape
    size = state.tokens.shape[1]
    counts = jnp.where(state.running, counts, 0)
    offsets = jnp.arange(steps, dtype=jnp.int32)[None, :]  # [1, T]
    generated_index = state.num_generated[:, None] + offsets  # [B, T]: index among generated tokens
    at = state.prompt_length[:, None] + generated_index  # [B, T]: index in the history
    valid = offsets < counts[:, None]
    rows = jnp.arange(batch)[:, None]
    tokens = state.tokens.at[rows, jnp.where(valid, at, size)].set(new_tokens, mode="drop")

    stop_hit = _stop_hits(tokens, at, state.prompt_length, request, spec) & valid
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
        seen = seen.at[rows, seen_at].set(True, mode="drop")
    return state.replace(tokens=tokens, num_generated=num_generated, finish_reason=finish_reason, seen=seen)


def padded_tokens(tokens: int, batch: int, lanes: int) -> int:
    """The fewest tokens per row, at least `tokens`, for which a forward's batch * T tokens fill
    whole groups of `lanes` (batch 8 needs no filler at T = 1)."""
    padded = tokens
    while batch * padded % lanes:
        padded += 1
    return padded


def _check_capacity(state: DecodeState, spec: LoopSpec) -> DecodeState:
    """A row whose next round (`round_width` cache slots) would not fit is done ("capacity")."""
    full = state.running & (state.cache.length + spec.round_width > spec.capacity)
    return state.replace(finish_reason=jnp.where(full, FINISH_CAPACITY, state.finish_reason))


def prefill(params, draft_params, request: Request, spec: LoopSpec) -> DecodeState:
    """Run the prompts, sample each row's first token, set up the proposer and the loop state."""
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
    first = select(logits[:, 0], request.sampling, spec.sampler, step_key, seen)
    history = jnp.zeros((batch, spec.capacity), jnp.int32)
    history = history.at[:, :prompt_size].set(jnp.where(in_prompt, request.prompt, 0)[:, :spec.capacity])
    proposer_state = None
    if spec.proposer is not None:
        with jax.named_scope("proposer_init"):
            prefilled = Prefill(prompt=request.prompt, prompt_length=request.prompt_length,
                                first_token=first, hiddens=hiddens)
            proposer_state = spec.proposer.init(draft_params, prefilled, spec.capacity)
    state = DecodeState(
        cache=cache,
        tokens=history,
        prompt_length=request.prompt_length,
        num_generated=jnp.zeros((batch,), jnp.int32),
        finish_reason=jnp.full((batch,), RUNNING, jnp.int32),
        seen=seen,
        key=key,
        proposer_state=proposer_state,
        stats=RoundStats.zeros(batch, spec.num_draft),
        target_forwards=jnp.zeros((), jnp.int32),
    )
    state = commit_tokens(state, first[:, None], jnp.ones((batch,), jnp.int32), request, spec)
    return _check_capacity(state, spec)


def _count_round(stats: RoundStats, running: jax.Array, num_proposed: jax.Array,
                 accepted: jax.Array, k: int) -> RoundStats:
    live = running.astype(jnp.int32)
    num_proposed, accepted = num_proposed * live, accepted * live
    positions = jnp.arange(k)[None, :]
    return RoundStats(
        rounds=stats.rounds + live,
        proposed=stats.proposed + num_proposed,
        accepted=stats.accepted + accepted,
        multi_token_rounds=stats.multi_token_rounds + (accepted > 0),
        proposed_at=stats.proposed_at + jnp.sum(positions < num_proposed[:, None], axis=0),
        accepted_at=stats.accepted_at + jnp.sum(positions < accepted[:, None], axis=0),
    )


def _verify(params, state: DecodeState, request: Request, spec: LoopSpec, drafts: jax.Array,
            num_proposed: jax.Array, draft_probs: jax.Array | None, key: jax.Array):
    """Score [pending, d_1 .. d_w] in one target forward (T = w + 1) and accept per row.

    Returns accepted int32[B], committed int32[B, w+1], the proposer's hiddens [B, w+1, D] each,
    and the cache advanced by each running row's accepted + 1 (the rest rolled back by length;
    a hybrid cache selects its recorded state). w = 0 is a plain step.
    """
    batch, width = drafts.shape
    verify_tokens = jnp.concatenate([state.pending[:, None], drafts], axis=1)  # [B, w+1]
    # Filler tokens after the real ones (LoopSpec.token_lanes). Their K/V land past every row's
    # length, where the next round overwrites them; only the real tokens get logits.
    filler = padded_tokens(width + 1, batch, spec.token_lanes) - (width + 1)
    logit_indices = None
    if filler:
        verify_tokens = jnp.pad(verify_tokens, ((0, 0), (0, filler)))
        logit_indices = jnp.broadcast_to(jnp.arange(width + 1, dtype=jnp.int32), (batch, width + 1))
    logits, hiddens, cache = models.forward(params, spec.cfg, verify_tokens, state.cache, logit_indices=logit_indices,
                                            hidden_layers=spec.hidden_layers, **spec.forward_options)
    hiddens = tuple(h[:, :width + 1] for h in hiddens)
    if width == 0:
        committed = select(logits[:, 0], request.sampling, spec.sampler, key, state.seen)[:, None]
        accepted = jnp.zeros((batch,), jnp.int32)
    elif spec.sampler.greedy and not spec.sampler.repetition_penalty:
        accepted, committed = greedy_accept(drafts, num_proposed, logits)
    else:
        # p at every position, each with the drafts before it counted as context (a
        # repetition penalty sees them). Greedy rows are point masses: the same rule is exact.
        seen = None if state.seen is None else positional_seen(state.seen, drafts).reshape(batch * (width + 1), -1)
        target_probs = distribution(logits.reshape(batch * (width + 1), -1),
                                    repeat_rows(request.sampling, width + 1), spec.sampler, seen)
        accepted, committed = rejection_sample(drafts, num_proposed, draft_probs,
                                               target_probs.reshape(batch, width + 1, -1), key)
    return accepted, committed, hiddens, cache.advance(jnp.where(state.running, accepted + 1, 0))


def _verify_or_step(params, state: DecodeState, request: Request, spec: LoopSpec, drafts, num_proposed,
                    draft_probs, key):
    """`_verify` at T = k + 1, or, in a round where no running row has a draft, a plain T = 1
    step: a verify with nothing to verify costs up to 2-3x a T = 1 forward on a CPU (see
    bench/RESULTS.md), and a proposer that can abstain (prompt lookup without a match) would
    pay it every such round. Both branches commit the same token: with no drafts the bonus is
    the target's own next token, drawn from the same p. Outputs are padded to the k + 1 shape;
    the caches match because `_verify` commits them (a hybrid cache's pending per-position
    states differ in shape with T; committed, they do not)."""
    k = drafts.shape[1]

    def full(_):
        return _verify(params, state, request, spec, drafts, num_proposed, draft_probs, key)

    def single(_):
        accepted, committed, hiddens, cache = _verify(params, state, request, spec, drafts[:, :0],
                                                      num_proposed, None, key)
        committed = jnp.pad(committed, ((0, 0), (0, k)))
        hiddens = tuple(jnp.pad(h, ((0, 0), (0, k), (0, 0))) for h in hiddens)
        return accepted, committed, hiddens, cache

    anything_to_verify = jnp.any((num_proposed > 0) & state.running)
    return jax.lax.cond(anything_to_verify, full, single, None)


def round_step(params, draft_params, state: DecodeState, request: Request, spec: LoopSpec) -> DecodeState:
    """One round: draft k tokens, verify them in one target forward, commit n + 1 per row."""
    batch = state.num_generated.shape[0]
    k = spec.num_draft
    proposer_state = state.proposer_state
    key, propose_key, verify_key = jax.random.split(state.key, 3)
    draft_probs = None
    if spec.proposer is not None:
        with jax.named_scope("propose"):
            context = state.context.replace(key=propose_key, sampling=request.sampling)
            proposal, proposer_state = spec.proposer.propose(draft_params, proposer_state, context)
        drafts, num_proposed, draft_probs = proposal.drafts, proposal.num_proposed, proposal.probs
    else:
        drafts, num_proposed = jnp.zeros((batch, 0), jnp.int32), jnp.zeros((batch,), jnp.int32)

    running = state.running
    with jax.named_scope("verify"):
        if k > 0 and getattr(spec.proposer, "can_abstain", False):
            accepted, committed, hiddens, cache = _verify_or_step(params, state, request, spec, drafts,
                                                                  num_proposed, draft_probs, verify_key)
        else:
            accepted, committed, hiddens, cache = _verify(params, state, request, spec, drafts, num_proposed,
                                                          draft_probs, verify_key)
    num_committed = jnp.where(running, accepted + 1, 0)
    if spec.proposer is not None:
        verified = Verified(accepted=accepted, committed=committed, num_committed=num_committed, hiddens=hiddens)
        proposer_state = spec.proposer.update(draft_params, proposer_state, verified)
    state = state.replace(
        cache=cache, key=key, proposer_state=proposer_state,
        stats=_count_round(state.stats, running, num_proposed, accepted, k),
        target_forwards=state.target_forwards + 1,
    )
    state = commit_tokens(state, committed, accepted + 1, request, spec)
    return _check_capacity(state, spec)


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


def run(params, draft_params, request: Request, spec: LoopSpec) -> DecodeState:
    """Prefill and decode to completion as one program (`generate` runs the two as two jitted
    calls, so the host can time each)."""
    return decode(params, draft_params, prefill(params, draft_params, request, spec), request, spec)


def generated_tokens(state: DecodeState, rows: int) -> list[list[int]]:
    """Each of the first `rows` rows' generated ids, copied to the host."""
    history = np.asarray(state.tokens)
    starts, counts = np.asarray(state.prompt_length), np.asarray(state.num_generated)
    return [history[row, starts[row]: starts[row] + counts[row]].tolist() for row in range(rows)]


# The jitted entry points. `spec` is static (hashable); jit's own cache keeps one program per
# (spec, argument shapes), and XLA's persistent cache (jaxspec.compilation) keeps it across runs.
prefill_jit = jax.jit(prefill, static_argnames=("spec",))
decode_jit = jax.jit(decode, static_argnames=("spec",), donate_argnames=("state",))
run_jit = jax.jit(run, static_argnames=("spec",))
stream_step_jit = jax.jit(stream_step, static_argnames=("spec",), donate_argnames=("state",))
