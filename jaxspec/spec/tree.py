"""Draft trees (EAGLE-2): the tree a proposer grows and the mask a verify runs under.

A round with a tree verifies `[pending] + N` tokens in one target forward. Tokens are addressed
by their verify index v in 0..N: v = 0 is the pending token (the root), v >= 1 is tree node v,
the proposal's `drafts[:, v - 1]`. Every row has the same N (fixed shapes) and grows its own tree:

    drafts   int32[B, N]  node v's token
    parents  int32[B, N]  node v's parent's verify index, in [0, v): parents come before children
    valid    node v is real iff v <= num_proposed[b]; padding nodes are never accepted

A chain of k is the tree whose node v has parent v - 1. Node v sits in cache slot `length + v`
with RoPE position `length + depth(v)`, and attends to the committed context and to its
ancestors and itself (`ancestor_mask`, `verify_mask`). Siblings grown by a drafter carry distinct
tokens; a lookup chain grafted onto the tree (`graft_chain`) may rarely repeat one (a sibling it
did not follow may survive the graft), which acceptance (`jaxspec.spec.verify`, one rule for
chains and trees) allows for. Tree drafts are deterministic: a drafter's top_k children, never
samples, as multi-draft verification needs point masses.

After acceptance the path (at most depth + 1 verify indices) is all the loop keeps: its tokens are
committed, its hiddens feed the proposer, and its K/V are gathered into contiguous slots
(`jaxspec.cache.KVCache.commit_path`), so the next round sees an ordinary cache.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxspec.errors import InvalidRequestError, is_integer
from jaxspec.sampling import masked
from jaxspec.pallas.flash_decode import TreeMask

MAX_TREE_NODES = 128  # a verify over more than this many tokens costs more than any tree repays
TREE_FORMAT = "DEPTH,TOPK,NODES"


@dataclasses.dataclass(frozen=True)
class DraftTree:
    """The shape of an EAGLE-2 dynamic draft tree, the same for every round and row.

    depth: the longest path (the most drafts a round can accept); top_k: children expanded per
    frontier node and frontier nodes kept per depth; num_nodes: the tree nodes verified (the best
    by cumulative draft log-probability). depth=k, top_k=1, num_nodes=k is a chain of k.
    """

    depth: int
    top_k: int
    num_nodes: int

    def __post_init__(self):
        for name in ("depth", "top_k", "num_nodes"):
            value = getattr(self, name)
            if not is_integer(value) or value < 1:
                raise InvalidRequestError(f"DraftTree {name} must be an integer >= 1; got {value!r}",
                                          flag="--tree")
            # A numpy integer becomes a Python int: the tree is a static jit argument, hashed and
            # compared as the same tree however its fields were given.
            object.__setattr__(self, name, int(value))
        if self.num_nodes < self.depth:
            raise InvalidRequestError(
                f"DraftTree num_nodes ({self.num_nodes}) must be >= depth ({self.depth}): a tree of depth "
                f"{self.depth} has at least {self.depth} nodes", flag="--tree")
        if self.num_nodes > self.max_nodes:
            raise InvalidRequestError(
                f"DraftTree num_nodes ({self.num_nodes}) exceeds the {self.max_nodes} candidates a depth-"
                f"{self.depth}, top_k-{self.top_k} tree grows (top_k + (depth - 1) * top_k^2)", flag="--tree")
        if self.num_nodes > MAX_TREE_NODES:
            raise InvalidRequestError(f"DraftTree num_nodes ({self.num_nodes}) must be <= {MAX_TREE_NODES}",
                                      flag="--tree")

    @property
    def max_nodes(self) -> int:
        """Candidates the growth records: the root's top_k children, then top_k^2 per later depth."""
        return self.top_k + (self.depth - 1) * self.top_k**2

    @property
    def scratch_slots(self) -> int:
        """Cache slots a drafter writes past its committed length while growing: top_k frontier
        nodes at each of depth - 1 expansions."""
        return (self.depth - 1) * self.top_k

    @classmethod
    def parse(cls, value: "DraftTree | str | tuple | list | None") -> "DraftTree | None":
        """None, a DraftTree, a (depth, top_k, num_nodes) triple or "DEPTH,TOPK,NODES"."""
        if value is None or isinstance(value, DraftTree):
            return value
        parts = value
        if isinstance(value, str):
            parts = value.split(",")
            try:
                parts = [int(part) for part in parts]
            except ValueError:
                raise InvalidRequestError(f"a tree is {TREE_FORMAT} (three integers); got {value!r}",
                                          flag="--tree") from None
        if not isinstance(parts, (tuple, list)) or len(parts) != 3:
            raise InvalidRequestError(f"tree must be a DraftTree, a (depth, top_k, num_nodes) triple or "
                                      f"{TREE_FORMAT!r}; got {value!r}", flag="--tree")
        return cls(*parts)

    def __str__(self) -> str:
        return f"{self.depth},{self.top_k},{self.num_nodes}"


# ----------------------------------------------------------------------------------------------
# Structure: depths and ancestors
# ----------------------------------------------------------------------------------------------


def with_root(parents: jax.Array) -> jax.Array:
    """int32[B, N] node parents -> int32[B, 1+N] over verify indices (the root is its own parent)."""
    return jnp.pad(parents, ((0, 0), (1, 0)))


def ancestor_mask(parents: jax.Array, depth: int) -> jax.Array:
    """bool[B, 1+N, 1+N]: [b, v, u] iff u is v or an ancestor of v (the root is everyone's).

    parents: int32[B, N] (verify indices); depth: the tree's depth, the longest chain to follow.
    """
    all_parents = with_root(parents)  # [B, 1+N]
    size = all_parents.shape[1]
    own = jnp.broadcast_to(jnp.eye(size, dtype=bool), all_parents.shape + (size,))
    mask = own
    for _ in range(depth):  # each pass adds one more generation of ancestors
        mask = own | jnp.take_along_axis(mask, all_parents[:, :, None], axis=1)
    return mask


def node_depths(parents: jax.Array, depth: int) -> jax.Array:
    """int32[B, 1+N]: each verify index's depth (the root 0)."""
    return depths_of(ancestor_mask(parents, depth))


def depths_of(ancestors: jax.Array) -> jax.Array:
    """int32[B, 1+N] depths from an ancestor mask: a node's ancestors-or-self, less itself."""
    return jnp.sum(ancestors, axis=-1).astype(jnp.int32) - 1


def verify_mask(parents: jax.Array, depth: int, start: jax.Array, steps: int) -> TreeMask:
    """The target's TreeMask for a verify of `steps` >= 1 + N tokens written from slot `start`:
    tree nodes see their ancestors; filler tokens past the tree (token lanes) see only themselves."""
    ancestors = ancestor_mask(parents, depth)  # [B, 1+N, 1+N]
    filler = steps - ancestors.shape[1]
    visible = jnp.pad(ancestors, ((0, 0), (0, filler), (0, filler)))
    own = jnp.eye(steps, dtype=bool)[None] & (jnp.arange(steps) >= ancestors.shape[1])[None, :, None]
    return TreeMask(start=start, visible=visible | own)


def gather_path(values: jax.Array, path: jax.Array) -> jax.Array:
    """values [B, 1+N, ...] at the path's verify indices int32[B, P] -> [B, P, ...]."""
    index = path.reshape(path.shape + (1,) * (values.ndim - 2))
    return jnp.take_along_axis(values, index, axis=1)


def trie(continuations: jax.Array, real: jax.Array, num_nodes: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Several candidate continuations merged into one tree (prompt lookup's matches).

    continuations: int32[B, M, D], each a chain of up to D tokens, best first; real: bool[B, M, D],
    prefix-closed along D. Continuations that agree on a prefix share its nodes, so siblings are
    distinct. Nodes are numbered continuation by continuation (the best one's chain first), and
    the first `num_nodes` kept: a node's parent is on an earlier-or-same continuation, one token
    shorter, so it is numbered first. Returns drafts int32[B, N], parents int32[B, N] (verify
    indices) and num_proposed int32[B]; nodes past num_proposed are padding.
    """
    batch, count, span = continuations.shape
    rows = jnp.arange(batch)[:, None]
    # same[b, m, m2, d]: continuation m2 is real through d and agrees with m on tokens 0..d
    agree = continuations[:, :, None, :] == continuations[:, None, :, :]  # [B, M, M, D]
    same = (jnp.cumprod(agree.astype(jnp.int32), axis=-1) > 0) & real[:, None, :, :]
    owner = jnp.argmax(same, axis=2).astype(jnp.int32)  # [B, M, D]: the first continuation with this prefix
    new = real & (owner == jnp.arange(count)[None, :, None])  # [B, M, D]: this (m, d) is a node of its own
    flat_new = new.reshape(batch, count * span)  # continuation-major: m, then d
    rank = jnp.cumsum(flat_new, axis=1, dtype=jnp.int32)  # a new node's verify index, 1-based
    kept = flat_new & (rank <= num_nodes)
    verify_index = jnp.where(kept, rank, 0)  # [B, M*D]
    # The parent of (m, d) is the node owning m's prefix through d - 1; the root for d = 0.
    parent_flat = owner[:, :, :-1] * span + jnp.arange(span - 1)[None, None, :]  # [B, M, D-1]
    parents = jnp.concatenate([jnp.zeros((batch, count, 1), jnp.int32),
                               jnp.take_along_axis(verify_index, parent_flat.reshape(batch, -1), axis=1).reshape(
                                   batch, count, span - 1)], axis=2).reshape(batch, count * span)
    slot = jnp.where(kept, rank - 1, num_nodes)  # dropped past the end
    drafts = jnp.zeros((batch, num_nodes), jnp.int32).at[rows, slot].set(
        continuations.reshape(batch, -1), mode="drop")
    node_parents = jnp.zeros((batch, num_nodes), jnp.int32).at[rows, slot].set(parents, mode="drop")
    return drafts, node_parents, jnp.sum(kept, axis=1).astype(jnp.int32)


def graft_chain(drafts: jax.Array, parents: jax.Array, chain: jax.Array,
                chain_length: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A chain grafted onto a grown tree from the root, in place of the tree's last nodes.

    drafts, parents: int32[B, N], a tree in grown order (`grow`: parents first, level by level);
    chain: int32[B, D], of which the first chain_length int32[B] (at most N) are real. The chain
    first follows the tree down as far as the tree already holds its tokens (among the first
    N - chain_length nodes, which stay whatever happens); the rest of it, m tokens, hangs off the
    deepest node it reached (the root if none) and takes the tree's last m nodes. Dropping a
    suffix of grown order drops every descendant of a dropped node with it (a child follows its
    parent), and the deepest candidates, the least likely to be reached, go first.
    -> drafts, parents int32[B, N]."""
    nodes, span = drafts.shape[1], chain.shape[1]
    index = jnp.arange(nodes)[None, :]  # [1, N]: node j, verify index j + 1
    surely_kept = index < (nodes - chain_length)[:, None]  # [B, N]
    at = jnp.zeros_like(chain_length)  # [B]: verify index of the deepest node the chain followed
    followed = jnp.zeros_like(chain_length)  # [B]: chain tokens already in the tree
    on_tree = jnp.ones(chain_length.shape, bool)
    for i in range(span):
        holds = (parents == at[:, None]) & (drafts == chain[:, i:i + 1]) & surely_kept  # [B, N]
        found = on_tree & (i < chain_length) & jnp.any(holds, axis=1)
        at = jnp.where(found, jnp.argmax(holds, axis=1).astype(at.dtype) + 1, at)
        followed = followed + found
        on_tree = found
    first = (nodes - (chain_length - followed))[:, None]  # [B, 1]: where the new chain nodes start
    step = jnp.clip(followed[:, None] + index - first, 0, span - 1)  # [B, N]: the chain token a new node holds
    grafted = index >= first
    chain_parents = jnp.where(index == first, at[:, None], index)  # node j's predecessor has verify index j
    return (jnp.where(grafted, jnp.take_along_axis(chain, step, axis=1), drafts),
            jnp.where(grafted, chain_parents, parents))


# ----------------------------------------------------------------------------------------------
# Growth (EAGLE-2)
# ----------------------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Grown:
    """A grown tree: what the verify needs, plus where each node ran in the drafter's cache."""

    drafts: jax.Array  # int32[B, N]: target token ids
    parents: jax.Array  # int32[B, N]: verify indices
    # int32[B, N]: the node's slot among the drafter's scratch slots (offset from its committed
    # length), or -1 for a node the drafter never ran (a leaf of the growth)
    scratch_slot: jax.Array


def frontier_inputs(base: jax.Array, level: int, top_k: int, sees: jax.Array) -> tuple[jax.Array, jax.Array, TreeMask]:
    """How a drafter whose committed length is `base` int32[B] runs growth level `level`'s
    frontier (top_k nodes per row, at depth `level`): the cache offset it writes at (its scratch
    slots), the nodes' positions int32[B, K] (base + level - 1, as a chain's depth-`level`
    draft), and the TreeMask over the scratch slots from `sees` bool[B, K, M]."""
    positions = jnp.broadcast_to((base + level - 1)[:, None], (base.shape[0], top_k))
    return base + (level - 1) * top_k, positions, TreeMask(start=base, visible=sees)


# expand(state, tokens int32[B, K], carry [B, K, ...], level, mask bool[B, K, M])
#     -> (logits [B, K, V'], carry, state)
Expand = Callable[[Any, jax.Array, Any, int, jax.Array], tuple[jax.Array, Any, Any]]


@dataclasses.dataclass(frozen=True)
class GrowGrammar:
    """A request's grammar as a tree drafter sees it (trace-time only, not a pytree): children are
    chosen among the tokens the grammar allows after their path, so a tree's nodes stand."""

    table: Any  # jaxspec.grammar.GrammarTable
    start: jax.Array  # int32[B]: each row's state after its committed tokens (the root's)
    vocab_map: jax.Array | None = None  # int32[V']: drafter id -> target id; None: the same vocabulary

    @classmethod
    def of(cls, context, vocab_map: jax.Array | None = None) -> "GrowGrammar | None":
        """From a proposer's `Context`; None when the request has no grammar."""
        return None if context.grammar is None else cls(context.grammar, context.grammar_state, vocab_map)

    def mask(self, logits: jax.Array, states: jax.Array) -> jax.Array:
        """Drafter logits [B, ..., V'] masked by the states [B, ...] their tokens would follow."""
        allowed = self.table.allowed(states)  # [B, ..., V]
        if self.vocab_map is not None:
            allowed = allowed[..., self.vocab_map]  # [B, ..., V']
        return masked(logits, allowed)

    def advance(self, states: jax.Array, target_ids: jax.Array) -> jax.Array:
        return self.table.advance(states, target_ids)


def grow(tree: DraftTree, root_logits: jax.Array, root_carry: Any, expand: Expand,
         to_target: Callable[[jax.Array], jax.Array], state: Any,
         grammar: GrowGrammar | None = None) -> tuple[Grown, Any]:
    """EAGLE-2's dynamic tree from a drafter's next-token logits at the root [B, V'].

    The root's top_k children are the first frontier. Each of depth - 1 expansions runs the
    frontier (top_k nodes per row) through the drafter in one forward: `expand` writes their K/V
    at scratch slots (level - 1) * top_k + j past the drafter's committed length and attends
    under `mask` (bool[B, K, M], M = tree.scratch_slots: a frontier node sees the scratch slots
    of its ancestors and itself). Each frontier node proposes its top_k children, scored by
    cumulative log-probability, and the best top_k of those k^2 become the next frontier. Finally
    the best `num_nodes` of all candidates are kept, in the order they were grown: since a child
    scores at most its parent and top_k breaks ties to the lower index, every kept node's parent
    is kept and comes before it. `root_carry` ([B, ...]) is what the root's children run with
    (a feature head's g); `expand` returns each frontier node's carry for its children, and
    threads the drafter's `state` (its cache), returned beside the tree. `to_target` maps drafter
    ids to target ids. Under a `grammar`, each node's children are the best among the tokens it
    allows after the node's path (a forbidden candidate scores -inf and is kept only when fewer
    than num_nodes candidates are allowed; the target never accepts it).
    """
    K, M = tree.top_k, tree.scratch_slots
    batch = root_logits.shape[0]
    rows = jnp.arange(batch)[:, None]
    root_logits = root_logits.astype(jnp.float32)
    if grammar is not None:
        root_logits = grammar.mask(root_logits, grammar.start)
    scores, ids = jax.lax.top_k(jax.nn.log_softmax(root_logits, axis=-1), K)  # [B, K]
    all_scores, all_ids = [scores], [ids]
    all_parents = [jnp.full((batch, K), -1, jnp.int32)]  # candidate index of the parent; -1: the root
    all_slots = [jnp.arange(K, dtype=jnp.int32)[None, :].repeat(batch, 0) if tree.depth > 1
                 else jnp.full((batch, K), -1, jnp.int32)]
    frontier = jnp.arange(K, dtype=jnp.int32)[None, :].repeat(batch, 0)  # [B, K]: candidate indices
    frontier_ids, frontier_scores = ids, scores  # [B, K] each: the frontier's drafter ids and scores
    if grammar is not None:  # [B, K]: each frontier node's automaton state after its path
        frontier_states = grammar.advance(jnp.repeat(grammar.start[:, None], K, axis=1), to_target(ids))
    carry = jax.tree.map(lambda x: jnp.repeat(x[:, None], K, axis=1), root_carry)
    sees = jnp.eye(K, M, dtype=bool)[None].repeat(batch, 0)  # [B, K, M]: first frontier at slots 0..K-1
    count = K
    for level in range(1, tree.depth):
        logits, carry, state = expand(state, to_target(frontier_ids), carry, level, sees)  # logits [B, K, V']
        logits = logits.astype(jnp.float32)
        if grammar is not None:
            logits = grammar.mask(logits, frontier_states)
        child_scores, child_ids = jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), K)
        child_scores = (frontier_scores[:, :, None] + child_scores).reshape(batch, K * K)  # [B, K*K]
        child_ids = child_ids.reshape(batch, K * K)
        all_scores.append(child_scores)
        all_ids.append(child_ids)
        all_parents.append(jnp.repeat(frontier, K, axis=1))
        frontier_scores, best = jax.lax.top_k(child_scores, K)  # [B, K]: the next frontier among the children
        frontier_ids = jnp.take_along_axis(child_ids, best, axis=1)
        if grammar is not None:
            parent_states = jnp.take_along_axis(frontier_states, best // K, axis=1)
            frontier_states = grammar.advance(parent_states, to_target(frontier_ids))
        slots = jnp.full((batch, K * K), -1, jnp.int32)
        if level + 1 < tree.depth:  # the next frontier will run, at these scratch slots
            slots = slots.at[rows, best].set(level * K + jnp.arange(K, dtype=jnp.int32)[None, :])
            sees = jnp.take_along_axis(sees, (best // K)[:, :, None], axis=1)  # inherit the parent's
            sees = sees | (jnp.arange(M)[None, None, :] == (level * K + jnp.arange(K))[None, :, None])
        all_slots.append(slots)
        carry = jax.tree.map(lambda x: jnp.take_along_axis(
            x, (best // K).reshape((batch, K) + (1,) * (x.ndim - 2)), axis=1), carry)
        frontier = count + best
        count += K * K

    scores, ids = jnp.concatenate(all_scores, axis=1), jnp.concatenate(all_ids, axis=1)  # [B, C]
    parents, slots = jnp.concatenate(all_parents, axis=1), jnp.concatenate(all_slots, axis=1)
    _, kept = jax.lax.top_k(scores, tree.num_nodes)
    kept = jnp.sort(kept, axis=1)  # [B, N]: grown order, parents first
    # A candidate's verify index is its rank among the kept (1-based); the root's is 0.
    verify_index = jnp.zeros(scores.shape, jnp.int32).at[rows, kept].set(
        jnp.arange(1, tree.num_nodes + 1, dtype=jnp.int32)[None, :])
    kept_parents = jnp.take_along_axis(parents, kept, axis=1)
    node_parents = jnp.where(kept_parents < 0, 0,
                             jnp.take_along_axis(verify_index, jnp.maximum(kept_parents, 0), axis=1))
    grown = Grown(drafts=to_target(jnp.take_along_axis(ids, kept, axis=1)), parents=node_parents,
                  scratch_slot=jnp.take_along_axis(slots, kept, axis=1))
    return grown, state
