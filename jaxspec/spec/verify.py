"""Verification: which drafted tokens the target accepts, and the token it adds.

Greedy (this module): a draft token is accepted while it equals the target's argmax at its
position; the first mismatch (or the position after the last draft) yields the bonus token from
the same target logits. The committed tokens are therefore always the target's own argmaxes, which
is why speculative greedy equals plain greedy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


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
