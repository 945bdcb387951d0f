"""Token selection: greedy, temperature, top-k, top-p, min-p, repetition penalty.

The processed distribution is one function, `processed_logits`, so plain sampling and (later)
lossless speculative verification draw from exactly the same distribution. Which filters run is
static (`SamplerSpec`, part of the compiled program); their values are per-row arrays
(`SamplingParams`), so a new temperature or top-p never recompiles. The order follows HF
transformers: repetition penalty, temperature, top-k, top-p, min-p.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

NEG_INF = -jnp.inf


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplerSpec:
    """Which stages are compiled in. Hashable: static under jit."""

    greedy: bool = True  # every row has temperature 0: argmax, no PRNG
    top_k: bool = False
    top_p: bool = False
    min_p: bool = False
    repetition_penalty: bool = False


@struct.dataclass
class SamplingParams:
    temperature: jax.Array  # float32[B]; 0 selects greedy for that row
    top_k: jax.Array  # int32[B]; 0 disables
    top_p: jax.Array  # float32[B]; 1 disables
    min_p: jax.Array  # float32[B]; 0 disables
    repetition_penalty: jax.Array  # float32[B]; 1 disables

    @classmethod
    def create(cls, batch: int, *, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0):
        def full(value, dtype):
            return jnp.broadcast_to(jnp.asarray(value, dtype), (batch,))

        return cls(
            temperature=full(temperature, jnp.float32),
            top_k=full(top_k, jnp.int32),
            top_p=full(top_p, jnp.float32),
            min_p=full(min_p, jnp.float32),
            repetition_penalty=full(repetition_penalty, jnp.float32),
        )


def spec_for(*, temperature, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0) -> SamplerSpec:
    """The smallest program that serves these (host-side, scalar or per-row) values."""
    import numpy as np

    greedy = bool(np.all(np.asarray(temperature) == 0))
    return SamplerSpec(
        greedy=greedy,
        top_k=bool(np.any(np.asarray(top_k) > 0)),
        top_p=bool(np.any(np.asarray(top_p) < 1)),
        # min-p costs one max and one compare over V: always in a sampled program, so turning it
        # on or off does not recompile (rows with min_p = 0 skip it by value).
        min_p=not greedy or bool(np.any(np.asarray(min_p) > 0)),
        repetition_penalty=bool(np.any(np.asarray(repetition_penalty) != 1)),
    )


def apply_repetition_penalty(logits: jax.Array, seen: jax.Array, penalty: jax.Array) -> jax.Array:
    """HF's rule: a seen token's logit is divided by `penalty` if positive, multiplied if negative.

    logits: [B, V]; seen: bool[B, V] (prompt and generated tokens); penalty: [B].
    """
    penalty = penalty[:, None]
    penalized = jnp.where(logits > 0, logits / penalty, logits * penalty)
    return jnp.where(seen, penalized, logits)


def _order_key(x: jax.Array) -> jax.Array:
    """uint32 with the order of the float32 values (-inf lowest; -0.0 and 0.0 equal)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    signed = jnp.where(bits < 0, jnp.int32(-(2**31)) - bits, bits)  # negatives' bit order reversed
    return jax.lax.bitcast_convert_type(signed ^ jnp.int32(-(2**31)), jnp.uint32)  # shift by 2^31


def _largest_key_where(keys: jax.Array, holds) -> jax.Array:
    """uint32[B]: per row, the largest t in [min key, max key] where `holds(t)` (bool[B]), which
    must be monotone (true up to some t, false after) and true at the row's min key."""
    low, high = jnp.min(keys, axis=-1), jnp.max(keys, axis=-1)

    def halve(_, bounds):
        low, high = bounds
        gap = high - low
        mid = low + gap // 2 + (gap & 1)  # the upper middle: ceil without overflowing uint32
        ok = holds(mid)
        return jnp.where(ok, mid, low), jnp.where(ok, high, mid - 1)

    low, _ = jax.lax.fori_loop(0, 32, halve, (low, high))
    return low


def _smallest_key_where(keys: jax.Array, holds) -> jax.Array:
    """uint32[B]: per row, the smallest t in [min key, max key] where `holds(t)`, which must be
    monotone (false up to some t, true after) and true at the row's max key."""
    low, high = jnp.min(keys, axis=-1), jnp.max(keys, axis=-1)

    def halve(_, bounds):
        low, high = bounds
        mid = low + (high - low) // 2
        ok = holds(mid)
        return jnp.where(ok, low, mid + 1), jnp.where(ok, mid, high)

    _, high = jax.lax.fori_loop(0, 32, halve, (low, high))
    return high


def processed_logits(logits: jax.Array, params: SamplingParams, spec: SamplerSpec) -> jax.Array:
    """Temperature-scaled logits [B, V] with filtered tokens at -inf (after repetition penalty).

    Rows with temperature 0 are scaled by 1 (they are decoded greedily by `select`).
    """
    temperature = jnp.where(params.temperature > 0, params.temperature, 1.0)[:, None]
    scaled = logits.astype(jnp.float32) / temperature
    vocab = scaled.shape[-1]
    # Top-k and top-p keep every logit at or above a threshold, one of the row's own values. It is
    # found by bisection over the float bits (32 halvings, each a masked sum over the row), not by
    # sorting the row: on XLA's CPU the bisection is far cheaper than a sort of the whole row
    # (bench/RESULTS.md, "Sampling filters").
    keys = _order_key(scaled) if spec.top_k or spec.top_p else None  # uint32[B, V]
    if spec.top_k:
        k = jnp.clip(jnp.where(params.top_k > 0, params.top_k, vocab), 1, vocab)
        kth = _largest_key_where(keys, lambda t: jnp.sum(keys >= t[:, None], axis=-1) >= k)
        scaled = jnp.where(keys >= kth[:, None], scaled, NEG_INF)
    if spec.top_p:
        # The smallest prefix of the descending order whose mass reaches top_p, ties with its
        # last token included: every logit v with mass(logits > v) < top_p (the top one always).
        probs = jax.nn.softmax(scaled, axis=-1)  # over what top-k kept
        last = _smallest_key_where(keys, lambda t: jnp.sum(jnp.where(keys > t[:, None], probs, 0.0), axis=-1)
                                   < params.top_p)
        keep_all = params.top_p >= 1
        scaled = jnp.where(keep_all[:, None] | (keys >= last[:, None]), scaled, NEG_INF)
    if spec.min_p:
        # p >= min_p * p_max  <=>  logit >= max_logit + log(min_p): no softmax needed.
        floor = jnp.max(scaled, axis=-1) + jnp.log(jnp.maximum(params.min_p, 1e-30))
        scaled = jnp.where((params.min_p[:, None] > 0) & (scaled < floor[:, None]), NEG_INF, scaled)
    return scaled


def select(
    logits: jax.Array,
    params: SamplingParams,
    spec: SamplerSpec,
    key: jax.Array | None,
    seen: jax.Array | None = None,
) -> jax.Array:
    """Pick one token per row from logits [B, V]: argmax for temperature-0 rows, else a draw.

    seen: bool[B, V], required when `spec.repetition_penalty`.
    """
    logits = logits.astype(jnp.float32)
    if spec.repetition_penalty:
        logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    greedy_tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if spec.greedy:
        return greedy_tokens
    sampled = jax.random.categorical(key, processed_logits(logits, params, spec), axis=-1)
    return jnp.where(params.temperature > 0, sampled.astype(jnp.int32), greedy_tokens)


def distribution(
    logits: jax.Array,
    params: SamplingParams,
    spec: SamplerSpec,
    seen: jax.Array | None = None,
) -> jax.Array:
    """The processed distribution `select` draws from, as probabilities [B, V].

    Temperature-0 rows get a point mass on their argmax, so one verifier serves greedy and
    sampled rows alike. seen: bool[B, V], required when `spec.repetition_penalty`.
    """
    logits = logits.astype(jnp.float32)
    if spec.repetition_penalty:
        logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    greedy = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
    if spec.greedy:
        return greedy
    probs = jax.nn.softmax(processed_logits(logits, params, spec), axis=-1)
    return jnp.where((params.temperature > 0)[:, None], probs, greedy)


def masked(logits: jax.Array, allowed: jax.Array | None) -> jax.Array:
    """Logits [..., V] with the tokens `allowed` (bool, same shape; a grammar's mask) forbids at
    -inf; None: unchanged. A row that allows nothing is left unmasked rather than made all -inf
    (a draft head's small vocabulary may lack every allowed token; the verify then rejects it)."""
    if allowed is None:
        return logits
    allowed = allowed | ~jnp.any(allowed, axis=-1, keepdims=True)
    return jnp.where(allowed, logits, NEG_INF)


def log_probs(
    logits: jax.Array,
    params: SamplingParams,
    spec: SamplerSpec,
    seen: jax.Array | None = None,
) -> jax.Array:
    """Log-probabilities [B, V] of the processed distribution: repetition penalty, temperature,
    top-k / top-p / min-p (filtered tokens at -inf), then a log-softmax. What a sampled row draws
    from; a greedy row (temperature 0) is scaled by 1, so with no processors this is the model's
    own log-softmax (what `jaxspec.score` reports). seen: bool[B, V] when `spec.repetition_penalty`."""
    logits = logits.astype(jnp.float32)
    if spec.repetition_penalty:
        logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    return jax.nn.log_softmax(processed_logits(logits, params, spec), axis=-1)


def repeat_rows(params: SamplingParams, times: int) -> SamplingParams:
    """Each row's parameters repeated `times` times: for [B * T, V] logits flattened row-major."""
    return jax.tree.map(lambda value: jnp.repeat(value, times, axis=0), params)
