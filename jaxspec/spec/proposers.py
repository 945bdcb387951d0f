"""Proposers: where draft tokens come from. One protocol, many sources (DESIGN.md contract 7).

A proposer is a frozen, hashable dataclass (static under jit: its fields shape the program) with
three pure methods over its own state pytree:

    init(draft_params, prompt [B, P], prompt_length [B], capacity) -> state   at prefill
    propose(draft_params, state, context) -> (Proposal, state)
    update(draft_params, state, accepted [B]) -> state       after verification

`context` is the loop's token history: `tokens` int32[B, S] holds each row's prompt and committed
tokens, `length` int32[B] how many (the last one is the pending token the target has not run);
plus the round's PRNG key and the request's sampling parameters, for proposers that sample.
A proposal's `probs` is the distribution q each draft was drawn from, which lossless rejection
sampling needs; None means point masses on the drafts (prompt lookup, argmax drafts).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec import models
from jaxspec.cache import KVCache
from jaxspec.config import ModelConfig
from jaxspec.sampling import SamplerSpec, SamplingParams, distribution


@struct.dataclass
class Context:
    tokens: jax.Array  # int32[B, S]: prompt then committed tokens, zero past `length`
    length: jax.Array  # int32[B]: valid tokens per row; tokens[b, length[b] - 1] is pending
    key: jax.Array | None = None  # PRNG key for this round's draft sampling
    sampling: SamplingParams | None = None


@struct.dataclass
class Proposal:
    drafts: jax.Array  # int32[B, k]: entries past num_proposed are padding
    num_proposed: jax.Array  # int32[B]
    probs: jax.Array | None = None  # float32[B, k, V]: q of each draft; None = point masses


class Proposer(Protocol):
    num_draft: int  # k: drafts per round (fixed shape; rows may propose fewer)
    name: str

    def init(self, draft_params: Any, prompt: jax.Array, prompt_length: jax.Array, capacity: int) -> Any: ...

    def propose(self, draft_params: Any, state: Any, context: Context) -> tuple[Proposal, Any]: ...

    def update(self, draft_params: Any, state: Any, accepted: jax.Array) -> Any: ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class PromptLookup:
    """Prompt lookup (n-gram) drafting, model-free.

    Match the context's last `n` tokens, for n from `ngram_max` down to `ngram_min`, against
    earlier context (most recent occurrence first) and propose up to k tokens that followed it.
    Strong on summarization, RAG and code editing, where the output copies the input.
    """

    num_draft: int
    ngram_max: int = 3
    ngram_min: int = 1
    name: str = "ngram"

    def init(self, draft_params, prompt, prompt_length, capacity):
        return None

    def update(self, draft_params, state, accepted):
        return state

    def propose(self, draft_params, state, context: Context):
        tokens, length = context.tokens, context.length
        batch, size = tokens.shape
        k = self.num_draft
        starts = jnp.arange(size)[None, :]  # [1, S]: candidate match start j
        best_start = jnp.full((batch,), -1, jnp.int32)
        best_n = jnp.zeros((batch,), jnp.int32)
        # Longer n-grams are tried first; a longer match, when there is one, wins.
        for n in range(self.ngram_min, self.ngram_max + 1):
            suffix_at = length - n  # [B]: where the context's own last n tokens start
            match = jnp.ones((batch, size), bool)
            for i in range(n):
                suffix_token = jnp.take_along_axis(tokens, jnp.maximum(suffix_at + i, 0)[:, None], axis=1)
                shifted = jnp.roll(tokens, -i, axis=1)  # shifted[:, j] = tokens[:, j + i]
                match &= shifted == suffix_token
            # A usable match ends before the suffix itself, so something follows it.
            match &= (starts < suffix_at[:, None]) & (suffix_at[:, None] >= 0)
            latest = jnp.max(jnp.where(match, starts, -1), axis=1).astype(jnp.int32)
            found = latest >= 0
            best_start = jnp.where(found, latest, best_start)
            best_n = jnp.where(found, n, best_n)
        follow = best_start + best_n  # [B]: first proposed token's index
        num_proposed = jnp.where(best_start >= 0, jnp.clip(length - follow, 0, k), 0).astype(jnp.int32)
        take = jnp.clip(follow[:, None] + jnp.arange(k)[None, :], 0, size - 1)
        drafts = jnp.take_along_axis(tokens, take, axis=1)
        drafts = jnp.where(jnp.arange(k)[None, :] < num_proposed[:, None], drafts, 0)
        return Proposal(drafts=drafts, num_proposed=num_proposed), state


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
    """

    num_draft: int
    config: ModelConfig
    sample: bool = False
    sampler: SamplerSpec | None = None
    name: str = "draft"

    def _next(self, logits: jax.Array, context: Context, step: int) -> tuple[jax.Array, jax.Array | None]:
        """The next draft token [B] and, when sampling, its distribution q [B, V]."""
        if not self.sample:
            return jnp.argmax(logits, axis=-1).astype(jnp.int32), None
        # The draft's q needs no repetition penalty: any q is exact as long as drafts are drawn from it.
        spec = dataclasses.replace(self.sampler, repetition_penalty=False)
        probs = distribution(logits, context.sampling, spec)
        key = jax.random.fold_in(context.key, step)
        token = jax.random.categorical(key, jnp.log(probs), axis=-1).astype(jnp.int32)
        return token, probs

    def init(self, draft_params, prompt: jax.Array, prompt_length: jax.Array, capacity: int) -> KVCache:
        cache = models.create_cache(self.config, prompt.shape[0], capacity)
        _, _, cache = models.forward(draft_params, self.config, prompt, cache,
                                    logit_indices=jnp.zeros((prompt.shape[0], 1), jnp.int32))
        # The context is prompt + first token; valid for all but its last two is prompt_length - 1.
        return cache.set_length(prompt_length - 1)

    def update(self, draft_params, state, accepted):
        return state

    def propose(self, draft_params, cache: KVCache, context: Context):
        last_two_at = jnp.maximum(context.length - 2, 0)[:, None] + jnp.arange(2)[None, :]  # [B, 2]
        last_two = jnp.take_along_axis(context.tokens, last_two_at, axis=1)
        cache = cache.set_length(last_two_at[:, 0])
        logits, _, cache = models.forward(draft_params, self.config, last_two, cache,
                                         logit_indices=jnp.ones((last_two.shape[0], 1), jnp.int32))
        cache = cache.advance(jnp.full_like(cache.length, 2))
        first, first_probs = self._next(logits[:, 0], context, 0)

        def step(carry, index):
            token, cache = carry
            logits, _, cache = models.forward(draft_params, self.config, token[:, None], cache)
            cache = cache.advance(jnp.ones_like(cache.length))
            following, probs = self._next(logits[:, 0], context, index)
            return (following, cache), (following, probs)

        # A scan, not an unrolled loop: compile time stays flat in k.
        (_, cache), (rest, rest_probs) = jax.lax.scan(
            step, (first, cache), jnp.arange(1, self.num_draft))
        drafts = jnp.concatenate([first[:, None], rest.T], axis=1)  # [B, k]
        probs = None
        if self.sample:
            probs = jnp.concatenate([first_probs[:, None], jnp.swapaxes(rest_probs, 0, 1)], axis=1)  # [B, k, V]
        proposal = Proposal(drafts=drafts, num_proposed=jnp.full(first.shape, self.num_draft, jnp.int32),
                            probs=probs)
        return proposal, cache
