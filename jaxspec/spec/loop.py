"""The on-device generation loop (DESIGN.md contracts 2, 4, 5, 6).

`run` is one jitted program: prefill, then a `lax.while_loop` of decode steps until every row is
done (EOS or stop sequence, max_new_tokens, cache capacity); no host round trip per step. The
streaming path calls the same jitted `prefill` and `decode_step` from a Python loop.

Invariant for a running row: the cache holds the prompt and every generated token but the last,
which is `pending` (sampled, not yet run through the trunk):
    cache.length == prompt_length + num_generated - 1.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
from flax import struct
from jax.experimental import io_callback

from jaxspec.cache import KVCache
from jaxspec.config import ModelConfig
from jaxspec.models import llama
from jaxspec.sampling import SamplerSpec, SamplingParams, select

# finish_reason codes (int32 on device); FINISH_NAMES maps them for the host.
RUNNING, FINISH_STOP, FINISH_LENGTH, FINISH_CAPACITY = 0, 1, 2, 3
FINISH_NAMES = {RUNNING: None, FINISH_STOP: "stop", FINISH_LENGTH: "length", FINISH_CAPACITY: "capacity"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoopSpec:
    """Everything static about a generation call: changing any of it recompiles."""

    cfg: ModelConfig
    capacity: int  # S: cache slots per row
    output_size: int  # N: generated-token buffer per row (bucketed max_new_tokens)
    sampler: SamplerSpec
    stop_token_ids: tuple[int, ...] = ()  # EOS and user stop tokens
    stop_sequences: tuple[tuple[int, ...], ...] = ()  # multi-token stops, matched on device


@struct.dataclass
class Request:
    """Per-call numbers, as arrays so new values never recompile."""

    prompt: jax.Array  # int32[B, P]: right-padded to a bucketed P
    prompt_length: jax.Array  # int32[B]
    max_new_tokens: jax.Array  # int32[B]
    sampling: SamplingParams
    key: jax.Array  # PRNG key


@struct.dataclass
class DecodeState:
    cache: KVCache
    output: jax.Array  # int32[B, N]: generated tokens (EOS included when it ended the row)
    num_generated: jax.Array  # int32[B]
    pending: jax.Array  # int32[B]: last generated token, not yet in the cache
    finish_reason: jax.Array  # int32[B]: RUNNING until the row is done
    seen: jax.Array | None  # bool[B, V]: prompt + output tokens, for the repetition penalty
    key: jax.Array
    target_forwards: jax.Array  # int32[]: decode forwards of the target (prefill excluded)

    @property
    def running(self) -> jax.Array:  # bool[B]
        return self.finish_reason == RUNNING


def _stop_index(window: jax.Array, ends: jax.Array, spec: LoopSpec) -> jax.Array:
    """Whether a stop token or stop sequence ends at each of the positions `ends`.

    window: int32[B, N] output buffer; ends: int32[B, T] candidate end positions -> bool[B, T].
    """
    last = jnp.take_along_axis(window, jnp.clip(ends, 0, window.shape[1] - 1), axis=1)
    hit = jnp.isin(last, jnp.asarray(spec.stop_token_ids, jnp.int32)) if spec.stop_token_ids else (
        jnp.zeros(ends.shape, bool)
    )
    for sequence in spec.stop_sequences:
        match = ends >= len(sequence) - 1
        for back, token in enumerate(reversed(sequence)):
            at = jnp.clip(ends - back, 0, window.shape[1] - 1)
            match &= jnp.take_along_axis(window, at, axis=1) == token
        hit |= match
    return hit


def commit_tokens(state: DecodeState, new_tokens: jax.Array, counts: jax.Array,
                  request: Request, spec: LoopSpec) -> DecodeState:
    """Append the first `counts[b]` of `new_tokens` [B, T] to each running row's output.

    Stops are checked at every appended position, and the earliest one wins: a row whose third
    accepted token is EOS keeps three tokens however many more were accepted. The last kept token
    becomes `pending`. Finished rows are left untouched.
    """
    batch, steps = new_tokens.shape
    counts = jnp.where(state.running, counts, 0)
    offsets = jnp.arange(steps, dtype=jnp.int32)[None, :]  # [1, T]
    positions = state.num_generated[:, None] + offsets  # [B, T]
    valid = offsets < counts[:, None]
    rows = jnp.arange(batch)[:, None]
    write_at = jnp.where(valid, positions, spec.output_size)  # out of range -> dropped
    output = state.output.at[rows, write_at].set(new_tokens, mode="drop")

    stop_hit = _stop_index(output, positions, spec) & valid
    length_hit = (positions + 1 >= request.max_new_tokens[:, None]) & valid
    any_end = stop_hit | length_hit
    first_end = jnp.argmax(any_end, axis=1)  # earliest ending position among the new ones
    ended = jnp.any(any_end, axis=1)
    kept = jnp.where(ended, first_end + 1, counts)  # int32[B]
    reason = jnp.where(jnp.take_along_axis(stop_hit, first_end[:, None], axis=1)[:, 0],
                       FINISH_STOP, FINISH_LENGTH)
    finish_reason = jnp.where(ended & state.running, reason, state.finish_reason)
    # Positions past an early stop were written above; blank them so the buffer reads clean.
    output = jnp.where(jnp.arange(spec.output_size)[None, :] < (state.num_generated + kept)[:, None],
                       output, 0)

    last_kept = jnp.take_along_axis(new_tokens, jnp.maximum(kept - 1, 0)[:, None], axis=1)[:, 0]
    pending = jnp.where(kept > 0, last_kept, state.pending)
    seen = state.seen
    if seen is not None:
        seen_at = jnp.where(offsets < kept[:, None], new_tokens, seen.shape[1])
        seen = seen.at[rows, seen_at].set(True, mode="drop")
    return state.replace(output=output, num_generated=state.num_generated + kept, pending=pending,
                         finish_reason=finish_reason, seen=seen)


def _check_capacity(state: DecodeState, spec: LoopSpec, next_write: int) -> DecodeState:
    """A row that cannot fit its next forward's `next_write` slots is done ("capacity")."""
    full = state.running & (state.cache.length + next_write > spec.capacity)
    return state.replace(finish_reason=jnp.where(full, FINISH_CAPACITY, state.finish_reason))


def prefill(params, request: Request, spec: LoopSpec) -> DecodeState:
    """Run the prompts, sample each row's first token, and set up the loop state."""
    cfg = spec.cfg
    batch = request.prompt.shape[0]
    cache = KVCache.create(cfg, batch, spec.capacity)
    with jax.named_scope("prefill"):
        logits, _, cache = llama.forward(
            params, cfg, request.prompt, cache, logit_indices=(request.prompt_length - 1)[:, None]
        )
    cache = cache.set_length(request.prompt_length)
    seen = None
    if spec.sampler.repetition_penalty:
        in_prompt = jnp.arange(request.prompt.shape[1])[None, :] < request.prompt_length[:, None]
        seen_at = jnp.where(in_prompt, request.prompt, cfg.vocab_size)
        seen = jnp.zeros((batch, cfg.vocab_size), bool).at[jnp.arange(batch)[:, None], seen_at].set(
            True, mode="drop")
    key, step_key = jax.random.split(request.key)
    first = select(logits[:, 0], request.sampling, spec.sampler, step_key, seen)
    state = DecodeState(
        cache=cache,
        output=jnp.zeros((batch, spec.output_size), jnp.int32),
        num_generated=jnp.zeros((batch,), jnp.int32),
        pending=first,
        finish_reason=jnp.full((batch,), RUNNING, jnp.int32),
        seen=seen,
        key=key,
        target_forwards=jnp.zeros((), jnp.int32),
    )
    state = commit_tokens(state, first[:, None], jnp.ones((batch,), jnp.int32), request, spec)
    return _check_capacity(state, spec, next_write=1)


def decode_step(params, state: DecodeState, request: Request, spec: LoopSpec) -> DecodeState:
    """One plain decode step: run `pending` through the trunk, commit it, sample the next."""
    with jax.named_scope("decode_step"):
        logits, _, cache = llama.forward(params, spec.cfg, state.pending[:, None], state.cache)
        cache = cache.advance(state.running.astype(jnp.int32))
        key, step_key = jax.random.split(state.key)
        token = select(logits[:, 0], request.sampling, spec.sampler, step_key, state.seen)
        state = state.replace(cache=cache, key=key, target_forwards=state.target_forwards + 1)
        state = commit_tokens(state, token[:, None], jnp.ones_like(token), request, spec)
        return _check_capacity(state, spec, next_write=1)


# Host timestamps taken from inside the jitted program (see `run`); reset per call by the caller.
_prefill_done_at: list[float] = []


def _mark_prefill_done(_):
    _prefill_done_at.append(time.perf_counter())


def run(params, request: Request, spec: LoopSpec) -> DecodeState:
    """Prefill and decode to completion, on device, as one program."""
    state = prefill(params, request, spec)
    # One ordered host callback after prefill, so stats can split prefill and decode time
    # without splitting the program in two.
    io_callback(_mark_prefill_done, None, state.pending, ordered=True)
    return jax.lax.while_loop(
        lambda s: jnp.any(s.running),
        lambda s: decode_step(params, s, request, spec),
        state,
    )


run_jit = jax.jit(run, static_argnames=("spec",))
prefill_jit = jax.jit(prefill, static_argnames=("spec",))
decode_step_jit = jax.jit(decode_step, static_argnames=("spec",), donate_argnames=("state",))
