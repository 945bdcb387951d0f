"""Acceptance: which drafted tokens the target keeps, and the token it adds. One rule for chains
and trees.

A round's draft is a tree over verify indices v in 0..N: v = 0 is the pending token (the root),
node v >= 1 carries `drafts[:, v - 1]`, its parent's verify index `parents[:, v - 1]` (< v), and
is real iff v <= num_proposed (padding is never accepted). A chain of k is the tree whose node v
has parent v - 1 (`chain_parents`); its depth is k. The target scored every verify index in one
forward, position v after the tokens on v's path.

Greedy (`greedy_accept`): the longest root-to-node path whose every token is the target's argmax
at its parent; the bonus is the argmax at the path's end. Only children carrying that one token
can match, so the committed tokens are the target's own argmaxes: speculative greedy equals plain
greedy. (A grafted lookup chain may repeat a sibling's token; either copy commits the same tokens.)

Sampled (`rejection_sample`): multi-draft speculative sampling (Leviathan et al. 2023, Chen et al.
2023; SpecInfer and EAGLE's `evaluate_posterior` for siblings). Walking down from the root with
the current node's target distribution p, its children x_1, x_2, ... are tried in order:
- point-mass children (q = one_hot(x_j): prompt lookup, argmax drafts, every tree): x_j is kept
  with probability p'(x_j), where p' is p with the siblings already rejected removed and
  renormalised; if all are rejected, the token is drawn from p without the children;
- a sampled child (q given: a chain drafter drawing from its own distribution; only chains carry
  q, one child per node): x is kept with probability min(1, p(x) / q(x)), else the token is drawn
  from norm(max(0, p - q)). A point mass is the case q = one_hot(x) of this rule.
Every step's token is then drawn exactly from p, so the output is distributed as the target's own
sampling. A sibling repeating an earlier sibling's token is tried with its p already removed:
never kept.

Both return `Accepted` in chain form: n, the path's n tokens then the bonus, and the path's verify
indices (a chain's is 0..n), which is all the loop keeps of the round.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.errors import InvalidRequestError
from jaxspec.spec.tree import ancestor_mask, depths_of, with_root

PROB_SUM_TOLERANCE = 1e-3


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Accepted:
    """One round's outcome in chain form."""

    accepted: jax.Array  # int32[B]: n, the drafts accepted (the path's depth)
    committed: jax.Array  # int32[B, depth+1]: the path's n tokens, then the bonus token
    path: jax.Array  # int32[B, depth+1]: verify indices root .. accepted node; padding past n


def chain_parents(batch: int, k: int) -> jax.Array:
    """int32[B, k]: a chain as a tree, node v's parent is v - 1."""
    return jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (batch, k))


def accepted_prefix_length(matches: jax.Array) -> jax.Array:
    """Length of the leading run of True per row. matches: bool[B, k] -> int32[B]."""
    return jnp.sum(jnp.cumprod(matches.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)


def _accepted_at(node: jax.Array, bonus: jax.Array, tokens: jax.Array, ancestors: jax.Array,
                 depth: int) -> Accepted:
    """A round that accepted the path from the root down to `node` int32[B], then `bonus` int32[B].

    tokens: int32[B, 1+N] (the root's is pending); ancestors: bool[B, 1+N, 1+N]. The path's
    entries past the node's depth repeat the root (0) and are never read.
    """
    depths = depths_of(ancestors)  # [B, 1+N]
    accepted = jnp.take_along_axis(depths, node[:, None], axis=1)[:, 0]  # [B]
    on_path = jnp.take_along_axis(ancestors, node[:, None, None], axis=1)[:, 0]  # [B, 1+N]
    at_depth = on_path[:, None, :] & (depths[:, None, :] == jnp.arange(depth + 1)[None, :, None])
    path = jnp.argmax(at_depth, axis=-1).astype(jnp.int32)  # [B, depth+1]
    path_tokens = jnp.take_along_axis(tokens, path, axis=1)  # [B, depth+1]
    committed = jnp.concatenate([path_tokens[:, 1:], jnp.zeros_like(path_tokens[:, :1])], axis=1)
    committed = jnp.where(jnp.arange(depth + 1)[None, :] == accepted[:, None], bonus[:, None], committed)
    return Accepted(accepted=accepted, committed=committed, path=path)


def greedy_accept(pending: jax.Array, drafts: jax.Array, parents: jax.Array, num_proposed: jax.Array,
                  target_logits: jax.Array, depth: int) -> Accepted:
    """The longest path of target argmaxes.

    pending int32[B]; drafts, parents int32[B, N]; num_proposed int32[B]; target_logits
    [B, 1+N, V] at every verify index; depth: the longest path (a chain's k).
    """
    tokens = jnp.concatenate([pending[:, None], drafts], axis=1)  # [B, 1+N]
    argmax = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [B, 1+N]
    valid = jnp.arange(tokens.shape[1])[None, :] <= num_proposed[:, None]
    matches = valid & (tokens == jnp.take_along_axis(argmax, with_root(parents), axis=1))
    matches = matches.at[:, 0].set(True)
    ancestors = ancestor_mask(parents, depth)
    # A node is on an accepted path iff it and all its ancestors match.
    reachable = jnp.all(ancestors <= matches[:, None, :], axis=-1)  # [B, 1+N]
    deepest = jnp.argmax(jnp.where(reachable, depths_of(ancestors), -1), axis=1).astype(jnp.int32)  # [B]
    bonus = jnp.take_along_axis(argmax, deepest[:, None], axis=1)[:, 0]
    return _accepted_at(deepest, bonus, tokens, ancestors, depth)


def rejection_sample(pending: jax.Array, drafts: jax.Array, parents: jax.Array, num_proposed: jax.Array,
                     draft_probs: jax.Array | None, target_probs: jax.Array, key: jax.Array, depth: int) -> Accepted:
    """Lossless speculative sampling over a chain or a tree (see the module docstring).

    draft_probs: q [B, N, V], node v's distribution at [:, v - 1], for a chain whose drafts were
    sampled; None: point masses. target_probs: p [B, 1+N, V], the target's processed distribution
    at every verify index.
    """
    batch, size = pending.shape[0], drafts.shape[1] + 1
    if not any(isinstance(x, jax.core.Tracer) for x in (drafts, parents, draft_probs, target_probs)):
        check_distributions(drafts, parents, draft_probs, target_probs)  # called eagerly: validate first
    tokens = jnp.concatenate([pending[:, None], drafts], axis=1)  # [B, 1+N]
    all_parents = with_root(parents)
    valid = (jnp.arange(size)[None, :] <= num_proposed[:, None]) & (jnp.arange(size)[None, :] > 0)
    rows = jnp.arange(batch)
    current = jnp.zeros((batch,), jnp.int32)  # the accepted node the walk stands on
    active = jnp.ones((batch,), bool)  # no rejection yet
    final = jnp.zeros(target_probs[:, 0].shape, target_probs.dtype)  # [B, V]: where the bonus is drawn
    # [B, 1+N, 1+N]: node j precedes node i and drafts the same token.
    repeats = (tokens[:, :, None] == tokens[:, None, :]) & (jnp.arange(size)[:, None] > jnp.arange(size)[None, :])
    for level in range(depth):
        p = target_probs[rows, current]  # [B, V]
        children = valid & (all_parents == current[:, None]) & active[:, None]  # [B, 1+N]
        first_of_token = children & ~jnp.any(repeats & children[:, None, :], axis=-1)
        p_child = jnp.where(first_of_token, jnp.take_along_axis(p, tokens, axis=1), 0.0)  # [B, 1+N]
        uniform = jax.random.uniform(jax.random.fold_in(key, level), (batch, size))
        if draft_probs is None:
            rejected_mass = jnp.cumsum(p_child, axis=1) - p_child  # siblings tried before each child
            keep = children & (uniform * (1.0 - rejected_mass) < p_child)
            child_tokens = jnp.where(children, tokens, p.shape[-1])
            residual = p.at[rows[:, None], child_tokens].set(0.0, mode="drop")  # p without the children
        else:  # a chain: current's one child, node current + 1, was drawn from q
            q = draft_probs[rows, jnp.minimum(current, size - 2)]  # [B, V]
            q_child = jnp.take_along_axis(q, tokens, axis=1)  # [B, 1+N]
            # u < p / q, written without the division (q = 0 cannot be drawn; p = q = 0 rejects).
            keep = children & (uniform * q_child < p_child)
            residual = jnp.where(jnp.any(children, axis=1, keepdims=True), jnp.maximum(p - q, 0.0), p)
        kept_any = jnp.any(keep, axis=1)
        mass = jnp.sum(residual, axis=-1, keepdims=True)
        # mass is 0 only where the children held all of p: one was then kept with probability 1.
        residual = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), p)
        final = jnp.where((active & ~kept_any)[:, None], residual, final)
        active = active & kept_any
        current = jnp.where(active, jnp.argmax(keep, axis=1).astype(jnp.int32), current)
    final = jnp.where(active[:, None], target_probs[rows, current], final)  # every level accepted
    bonus = jax.random.categorical(jax.random.fold_in(key, depth), jnp.log(final), axis=-1).astype(jnp.int32)
    return _accepted_at(current, bonus, tokens, ancestor_mask(parents, depth), depth)


def positional_seen(seen: jax.Array, tokens: jax.Array, ancestors: jax.Array) -> jax.Array:
    """The repetition-penalty context at each verify index: the committed tokens plus the node's
    ancestors' and its own tokens (the root's is pending, already committed).
    seen: bool[B, V]; tokens: int32[B, 1+N]; ancestors: bool[B, 1+N, 1+N] -> bool[B, 1+N, V]."""
    vocab = seen.shape[-1]
    drafted = jnp.einsum("bvu,buw->bvw", ancestors.astype(jnp.float32),
                         jax.nn.one_hot(tokens, vocab, dtype=jnp.float32)) > 0
    return seen[:, None] | drafted


def check_distributions(drafts, parents, draft_probs, target_probs) -> None:
    """Host-side validation for callers bringing their own q (a custom proposer calling the
    verifier eagerly). Inside the loop our proposers build q by construction, so this is skipped
    under jit. Raises InvalidRequestError naming the problem."""
    drafts, parents, target_probs = np.asarray(drafts), np.asarray(parents), np.asarray(target_probs)
    batch, nodes = drafts.shape
    if target_probs.shape[:2] != (batch, nodes + 1):
        raise InvalidRequestError(
            f"target_probs must be [B, 1+N, V] = [{batch}, {nodes + 1}, V]; got {target_probs.shape}")
    if parents.shape != drafts.shape or (parents.size and not np.all(
            (0 <= parents) & (parents < np.arange(1, nodes + 1)[None, :]))):
        raise InvalidRequestError(f"parents must be [B, N] = [{batch}, {nodes}] verify indices, node v's in [0, v)")
    vocab = target_probs.shape[-1]
    if drafts.size and not (0 <= drafts.min() and drafts.max() < vocab):
        raise InvalidRequestError(f"draft token ids must be in [0, {vocab}); got {drafts.min()}..{drafts.max()}")
    named = [("target_probs", target_probs)]
    if draft_probs is not None:
        draft_probs = np.asarray(draft_probs)
        if draft_probs.shape != (batch, nodes, vocab):
            raise InvalidRequestError(
                f"draft probabilities must be [B, k, V] = [{batch}, {nodes}, {vocab}] (the target's vocabulary); "
                f"got {draft_probs.shape}")
        if not np.array_equal(parents, np.broadcast_to(np.arange(nodes), parents.shape)):
            raise InvalidRequestError("draft probabilities come with a chain (node v's parent v - 1): tree nodes are "
                                      "point masses")
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
