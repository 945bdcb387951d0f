"""Verification: which drafted tokens the target accepts, and the token it adds.

Greedy (`greedy_accept`): a draft is accepted while it equals the target's argmax at its
position; the first mismatch (or the position after the last draft) yields the bonus token from
the same logits. The committed tokens are the target's own argmaxes: speculative greedy equals
plain greedy.

Sampled (`rejection_sample`, Leviathan et al. 2023 section 2.3; Chen et al. 2023): draft x_i,
drawn from q_i, is kept with probability min(1, p_i(x) / q_i(x)); at the first rejection the
token is drawn from norm(max(0, p_i - q_i)) instead; if all drafts are kept the bonus is drawn
from p_{k}. Every committed token is then distributed exactly as the target's own sampling would
draw it. A deterministic proposer (prompt lookup, argmax drafts) is the point mass q = one_hot(x),
for which the rule becomes: keep x with probability p(x), else draw from p with x removed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.errors import InvalidRequestError

PROB_SUM_TOLERANCE = 1e-3


def accepted_prefix_length(matches: jax.Array) -> jax.Array:
    """Length of the leading run of True per row. matches: bool[B, k] -> int32[B]."""
    return jnp.sum(jnp.cumprod(matches.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)


def greedy_accept(drafts: jax.Array, num_proposed: jax.Array,
                  target_logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Longest-prefix greedy acceptance.

    drafts: int32[B, k]; num_proposed: int32[B] (drafts past it are padding and never accepted);
    target_logits: [B, k+1, V], position i scored after [pending, d_1 .. d_i].
    Returns accepted int32[B] (n in [0, k]) and committed int32[B, k+1], of which the first n+1
    are the round's output: d_1 .. d_n and then the bonus token.
    """
    target_tokens = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [B, k+1]
    k = drafts.shape[1]
    matches = (drafts == target_tokens[:, :k]) & (jnp.arange(k)[None, :] < num_proposed[:, None])
    return accepted_prefix_length(matches), target_tokens


def rejection_sample(
    drafts: jax.Array,
    num_proposed: jax.Array,
    draft_probs: jax.Array | None,
    target_probs: jax.Array,
    key: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Lossless speculative sampling.

    drafts: int32[B, k]; num_proposed: int32[B]; draft_probs: q [B, k, V] that each draft was
    drawn from, or None for point masses on the drafts; target_probs: p [B, k+1, V], the
    target's processed distribution at each verify position. Returns (accepted int32[B],
    committed int32[B, k+1]) as `greedy_accept` does.
    """
    batch, k = drafts.shape
    vocab = target_probs.shape[-1]
    if not isinstance(draft_probs, jax.core.Tracer) and not isinstance(target_probs, jax.core.Tracer):
        check_distributions(drafts, draft_probs, target_probs)  # called eagerly: validate first
    if draft_probs is None:
        draft_probs = jax.nn.one_hot(drafts, vocab, dtype=target_probs.dtype)
    accept_key, residual_key = jax.random.split(key)

    p_of_draft = jnp.take_along_axis(target_probs[:, :k], drafts[..., None], axis=-1)[..., 0]  # [B, k]
    q_of_draft = jnp.take_along_axis(draft_probs, drafts[..., None], axis=-1)[..., 0]  # [B, k]
    uniform = jax.random.uniform(accept_key, (batch, k))  # fresh per row and position
    # u < p / q, written without the division (q = 0 cannot be drawn; p = q = 0 rejects).
    keep = (uniform * q_of_draft < p_of_draft) & (jnp.arange(k)[None, :] < num_proposed[:, None])
    accepted = accepted_prefix_length(keep)  # [B]

    # The token at position n: from the residual after a rejection, from p after all kept.
    p_next = jnp.take_along_axis(target_probs, accepted[:, None, None], axis=1)[:, 0]  # [B, V]
    rejected = accepted < num_proposed
    q_next = jnp.take_along_axis(draft_probs, jnp.minimum(accepted, k - 1)[:, None, None], axis=1)[:, 0]
    residual = jnp.where(rejected[:, None], jnp.maximum(p_next - q_next, 0.0), p_next)
    mass = jnp.sum(residual, axis=-1, keepdims=True)
    # mass is 0 only where p == q up to rounding, in which case rejection had probability ~0.
    residual = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), p_next)
    bonus = jax.random.categorical(residual_key, jnp.log(residual), axis=-1).astype(jnp.int32)

    committed = jnp.concatenate([drafts, jnp.zeros((batch, 1), jnp.int32)], axis=1)  # [B, k+1]
    committed = jnp.where(jnp.arange(k + 1)[None, :] == accepted[:, None], bonus[:, None], committed)
    return accepted, committed


def positional_seen(seen: jax.Array, drafts: jax.Array) -> jax.Array:
    """The repetition-penalty context at each verify position: position i has seen the committed
    tokens and d_1 .. d_i. seen: bool[B, V]; drafts: int32[B, k] -> bool[B, k+1, V]."""
    vocab = seen.shape[-1]
    drafted = jnp.cumsum(jax.nn.one_hot(drafts, vocab, dtype=jnp.int32), axis=1) > 0  # [B, k, V]
    return jnp.concatenate([seen[:, None], seen[:, None] | drafted], axis=1)


def check_distributions(drafts, draft_probs, target_probs) -> None:
    """Host-side validation for callers bringing their own q (a custom proposer calling the
    verifier eagerly). Inside the loop our proposers build q by construction, so this is skipped
    under jit. Raises InvalidRequestError naming the problem."""
    drafts, target_probs = np.asarray(drafts), np.asarray(target_probs)
    batch, k = drafts.shape
    if target_probs.shape[:2] != (batch, k + 1):
        raise InvalidRequestError(f"target_probs must be [B, k+1, V] = [{batch}, {k + 1}, V]; got {target_probs.shape}")
    vocab = target_probs.shape[-1]
    if drafts.size and not (0 <= drafts.min() and drafts.max() < vocab):
        raise InvalidRequestError(f"draft token ids must be in [0, {vocab}); got {drafts.min()}..{drafts.max()}")
    named = [("target_probs", target_probs)]
    if draft_probs is not None:
        draft_probs = np.asarray(draft_probs)
        if draft_probs.shape != (batch, k, vocab):
            raise InvalidRequestError(
                f"draft probabilities must be [B, k, V] = [{batch}, {k}, {vocab}] (the target's vocabulary); "
                f"got {draft_probs.shape}")
        named.append(("draft probabilities", draft_probs))
    for name, probs in named:
        if not np.all(np.isfinite(probs)):
            raise InvalidRequestError(f"{name} contain NaN or infinite values")
        if np.any(probs < 0):
            raise InvalidRequestError(f"{name} contain negative values")
        sums = probs.sum(-1)
        worst = float(np.abs(sums - 1).max()) if sums.size else 0.0
        if worst > PROB_SUM_TOLERANCE:
            raise InvalidRequestError(f"{name} must sum to 1 over the vocabulary; off by up to {worst:.3g}")
