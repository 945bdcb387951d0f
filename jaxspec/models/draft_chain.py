"""The training-time test's attention: every draft chain of a sequence at once, as inference runs it.

At inference a draft head (EAGLE-3, MTP) whose context ends at position c drafts a chain: its
depth-j step runs at slot c + j and attends to the committed slots 0..c, which hold entries made
from the target's own features (depth 0), and to its own chain's entries at slots c + 1 .. c + j
(depths 1..j, each made from the step before). Training unrolls depth j for every start c of a
sequence at once, one head forward per depth with the starts as its positions. A query of start
c at depth j >= 1 therefore attends to the depth-0 entries of starts 0..c (causal) and to its own
chain's entries of depths 1..j, which sit at the same index c of the deeper forwards: the
training-time-test mask of the EAGLE-3 paper. Letting each depth attend causally over its own
forward's entries instead would train on a context of depth-j features inference never builds,
and overstate the deeper drafts' agreement (bench/RESULTS.md, "The training-time test's mask:
the shipped head's held-out agreement by depth").

`DraftChain` is what `layers.self_attention` reads in place of a KV buffer when a head runs a
deeper step of the training-time test; `chain_attention` is that attention, in float32 jnp.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct

_MASKED = float(jnp.finfo(jnp.float32).min)


@struct.dataclass
class DraftChain:
    """The keys (or the values) of one head layer for every chain of a batch of sequences."""

    context: jax.Array  # [B, K, T, H]: depth 0, entry c made from the target's feature at c
    deeper: jax.Array  # [J, B, K, T, H]: entry [i, c] is depth i + 1 of the chain started at c
    depth: jax.Array  # int32 []: the depth the next forward runs, 1 <= depth <= J

    @classmethod
    def start(cls, context: jax.Array, max_depth: int) -> "DraftChain":
        """Chains over `context` [B, K, T, H] (a depth-0 forward's KV) with room for `max_depth`
        deeper steps; the next forward runs depth 1."""
        deeper = jnp.zeros((max_depth, *context.shape), context.dtype)
        return cls(context=context, deeper=deeper, depth=jnp.ones((), jnp.int32))

    def at_depth(self, depth: jax.Array) -> "DraftChain":
        return self.replace(depth=jnp.asarray(depth, jnp.int32))

    def written(self, entries: jax.Array) -> "DraftChain":
        """These chains with this depth's entries [B, K, T, H] in place."""
        deeper = jax.lax.dynamic_update_index_in_dim(self.deeper, entries.astype(self.deeper.dtype),
                                                     self.depth - 1, axis=0)
        return self.replace(deeper=deeper)


# Queries per block of the context's causal attention (as flash_decode.PREFILL_QUERY_BLOCK).
QUERY_BLOCK = 128


def chain_attention(q: jax.Array, keys: DraftChain, values: DraftChain, *, scale: float | None = None,
                    query_block: int | None = None) -> jax.Array:
    """Attention of depth `keys.depth`'s queries q [B, T, K, G, H] (query t: the chain started at
    t) over the context causally and over their own chain's depths 1..depth. `keys` and `values`
    hold this depth's entries already (`DraftChain.written`). Returns float32 [B, T, K, G, H].

    The queries go `query_block` (default QUERY_BLOCK) at a time, block [t0, t1) over context
    entries [0, t1) only: the causal half of the products is never computed, and each block's
    scores (and the probabilities the backward pass keeps) are [B, K, G, 128, t1], where the whole
    [B, K, G, T, T] of a 1,280-token batch of 8 is 0.5 GB per depth. The time this saves a depth's
    forward and backward: bench/RESULTS.md, "Prefill attention in query blocks"."""
    steps, head_dim = q.shape[1], q.shape[-1]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    q = q.astype(jnp.float32) * scale
    context_keys, context_values = keys.context.astype(jnp.float32), values.context.astype(jnp.float32)
    deeper_keys, deeper_values = keys.deeper.astype(jnp.float32), values.deeper.astype(jnp.float32)
    in_chain = jnp.arange(keys.deeper.shape[0]) < keys.depth  # [J]: depths 1..depth
    query_block = query_block or QUERY_BLOCK
    blocks = []
    for first in range(0, steps, query_block):
        last = min(steps, first + query_block)
        block = q[:, first:last]  # [B, Q, K, G, H]
        context_scores = jnp.einsum("btkgh,bksh->bkgts", block, context_keys[:, :, :last])  # [B, K, G, Q, S]
        causal = jnp.arange(last)[None, :] <= jnp.arange(first, last)[:, None]  # [Q, S]
        context_scores = jnp.where(causal, context_scores, _MASKED)
        chain_scores = jnp.einsum("btkgh,jbkth->bkgtj", block, deeper_keys[:, :, :, first:last])  # [B, K, G, Q, J]
        chain_scores = jnp.where(in_chain, chain_scores, _MASKED)
        probs = jax.nn.softmax(jnp.concatenate([context_scores, chain_scores], axis=-1), axis=-1)
        context_probs, chain_probs = probs[..., :last], probs[..., last:]
        out = jnp.einsum("bkgts,bksh->btkgh", context_probs, context_values[:, :, :last])
        blocks.append(out + jnp.einsum("bkgtj,jbkth->btkgh", chain_probs, deeper_values[:, :, :, first:last]))
    return jnp.concatenate(blocks, axis=1)
