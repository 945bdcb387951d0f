"""Draft trees piece by piece (jaxspec.spec.tree), each against a plain-Python model of its contract.

DraftTree's validation; the ancestor structure and the target's verify mask; prompt lookup's
trie; greedy acceptance on hand-built trees and against the chain verifier; sampled acceptance
proven statistically (the committed tokens' exact distribution, enumerated, and a plausibly
broken verifier that must fail the same test); EAGLE-2 growth against a re-implementation with a
synthetic drafter. Pure functions on small arrays; trees through the whole loop are tested end to
end elsewhere.
"""

from __future__ import annotations

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.errors import InvalidRequestError
from jaxspec.spec import tree, verify
from jaxspec.spec.tree import MAX_TREE_NODES, DraftTree
from tests.test_spec_sampling import SIGNIFICANCE, chi_square_p_value

# Each function jitted whole: one compile per shape is several times faster here than dispatching
# its many small ops eagerly, each compiled on first use.
ancestor_mask = jax.jit(tree.ancestor_mask, static_argnums=1)
node_depths = jax.jit(tree.node_depths, static_argnums=1)
verify_mask = jax.jit(tree.verify_mask, static_argnums=(1, 3))
trie = jax.jit(tree.trie, static_argnums=2)
greedy_accept = jax.jit(verify.greedy_accept, static_argnames="depth")

# ----------------------------------------------------------------------------------------------
# DraftTree
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fields, field, why", [
    ((0, 2, 4), "depth", "integer >= 1"),
    ((3, -1, 4), "top_k", "integer >= 1"),
    ((3, 2, True), "num_nodes", "integer >= 1"),
    ((3.0, 2, 4), "depth", "integer >= 1"),
    ((3, 2, 2), "num_nodes", "must be >= depth"),
    ((2, 2, 7), "num_nodes", "exceeds the 6 candidates"),  # 2 + (2 - 1) * 2^2 = 6
    ((9, 4, MAX_TREE_NODES + 1), "num_nodes", f"must be <= {MAX_TREE_NODES}"),  # 4 + 8 * 16 = 132 grown
])
def test_draft_tree_names_the_field_it_refuses(fields, field, why):
    with pytest.raises(InvalidRequestError, match=rf"DraftTree {field}\b.*{why}"):
        DraftTree(*fields)


@pytest.mark.parametrize("value, expected", [
    ("3,2,6", DraftTree(3, 2, 6)),
    (" 5 , 3 , 20 ", DraftTree(5, 3, 20)),
    ((4, 1, 4), DraftTree(4, 1, 4)),  # a chain of 4
    ([1, 1, 1], DraftTree(1, 1, 1)),
    ((2, 2, 6), DraftTree(2, 2, 6)),  # every candidate grown
    (DraftTree(3, 2, 5), DraftTree(3, 2, 5)),
    (None, None),
])
def test_draft_tree_parse_accepts_triples_strings_and_trees(value, expected):
    parsed = DraftTree.parse(value)
    assert parsed == expected
    if parsed is not None:
        assert DraftTree.parse(str(parsed)) == parsed  # str is the format parse reads


@pytest.mark.parametrize("value", ["4,4", "a,b,c", "", "1,2,3,4", "3;2;4", (3, 2), 7, {"depth": 3}])
def test_draft_tree_parse_refuses_anything_else_naming_the_tree(value):
    with pytest.raises(InvalidRequestError, match="tree") as error:
        DraftTree.parse(value)
    assert repr(value) in str(error.value)


def test_draft_tree_takes_numpy_integers_as_python_ints():
    """Like every other count in a request (jaxspec.errors.is_integer); stored as Python ints, so
    the tree is the same static jit argument however it was given."""
    parsed = DraftTree.parse(tuple(np.array([3, 2, 6])))
    assert parsed == DraftTree(3, 2, 6) and hash(parsed) == hash(DraftTree(3, 2, 6))
    assert all(type(value) is int for value in dataclasses.astuple(parsed))
    assert str(parsed) == "3,2,6"


def test_parse_checks_the_fields_too():
    with pytest.raises(InvalidRequestError, match="DraftTree num_nodes"):
        DraftTree.parse("2,2,7")


def test_max_nodes_and_scratch_slots():
    assert DraftTree(4, 3, 10).max_nodes == 3 + 3 * 9
    assert DraftTree(4, 3, 10).scratch_slots == 3 * 3  # the frontier of each of depth - 1 expansions
    assert DraftTree(1, 5, 2).scratch_slots == 0  # depth 1: the root's children never run


# ----------------------------------------------------------------------------------------------
# Structure: ancestors, depths, the verify mask
# ----------------------------------------------------------------------------------------------


def random_parents(rng: np.random.Generator, batch: int, nodes: int) -> np.ndarray:
    """int32[B, N]: node v's parent uniform in [0, v), a different tree per row."""
    return np.stack([[rng.integers(0, v) for v in range(1, nodes + 1)] for _ in range(batch)]).astype(np.int32)


def brute_ancestors(parents: np.ndarray) -> np.ndarray:
    """bool[1+N, 1+N] for one row, by walking up from every verify index to the root."""
    size = len(parents) + 1
    mask = np.zeros((size, size), bool)
    for v in range(size):
        u = v
        mask[v, u] = True
        while u:
            u = parents[u - 1]
            mask[v, u] = True
    return mask


@pytest.mark.parametrize("nodes", [1, 6, 17])
def test_ancestor_mask_and_depths_match_a_brute_force(nodes):
    parents = random_parents(np.random.default_rng(nodes), batch=5, nodes=nodes)
    expected = np.stack([brute_ancestors(row) for row in parents])  # [B, 1+N, 1+N]
    depth = int(expected.sum(-1).max()) - 1  # the deepest node's depth: what the tree promises
    chex.assert_trees_all_equal(ancestor_mask(jnp.asarray(parents), depth), jnp.asarray(expected))
    chex.assert_trees_all_equal(node_depths(jnp.asarray(parents), depth),
                                jnp.asarray(expected.sum(-1) - 1, jnp.int32))
    # Following more generations than the tree has changes nothing.
    chex.assert_trees_all_equal(ancestor_mask(jnp.asarray(parents), depth + 3), jnp.asarray(expected))


def test_verify_mask_filler_tokens_see_only_themselves():
    parents = jnp.array([[0, 1, 0], [0, 0, 2]])  # [B, N = 3]
    start = jnp.array([4, 9])
    steps = 7  # [pending] + 3 nodes, then 3 filler tokens up to the token lanes
    mask = verify_mask(parents, 2, start, steps)
    chex.assert_shape(mask.visible, (2, steps, steps))
    chex.assert_trees_all_equal(mask.start, start)
    chex.assert_trees_all_equal(mask.visible[:, :4, :4], ancestor_mask(parents, 2))
    assert not jnp.any(mask.visible[:, :4, 4:])  # no tree node sees a filler
    filler = jnp.broadcast_to(jnp.eye(steps, dtype=bool)[4:], (2, 3, steps))
    chex.assert_trees_all_equal(mask.visible[:, 4:], filler)


def test_verify_mask_without_filler_is_the_ancestor_mask():
    parents = jnp.asarray(random_parents(np.random.default_rng(0), batch=2, nodes=5))
    mask = verify_mask(parents, 5, jnp.zeros((2,), jnp.int32), 6)
    chex.assert_trees_all_equal(mask.visible, ancestor_mask(parents, 5))


def test_positional_seen_adds_each_nodes_ancestors_and_itself():
    """The repetition-penalty context at verify index v: the committed tokens, the path's drafts
    down to v (the root's token, pending, is committed already)."""
    parents = random_parents(np.random.default_rng(3), batch=3, nodes=6)
    tokens = np.random.default_rng(4).integers(0, 10, (3, 7))  # [B, 1+N]
    seen = np.random.default_rng(5).random((3, 10)) < 0.2  # [B, V]
    ancestors = np.stack([brute_ancestors(row) for row in parents])
    got = np.asarray(verify.positional_seen(jnp.asarray(seen), jnp.asarray(tokens, jnp.int32), jnp.asarray(ancestors)))
    for row in range(3):
        for v in range(7):
            expected = seen[row].copy()
            expected[tokens[row, np.flatnonzero(ancestors[row, v])]] = True
            np.testing.assert_array_equal(got[row, v], expected)


def test_gather_path_picks_each_rows_verify_indices():
    values = jnp.arange(2 * 5 * 3, dtype=jnp.float32).reshape(2, 5, 3)  # [B, 1+N, D]
    path = jnp.array([[0, 2, 4], [0, 1, 0]])
    chex.assert_trees_all_equal(tree.gather_path(values, path), jnp.stack([values[0, [0, 2, 4]], values[1, [0, 1, 0]]]))


# ----------------------------------------------------------------------------------------------
# The trie of prompt lookup's continuations
# ----------------------------------------------------------------------------------------------


def reference_trie(continuations: np.ndarray, real: np.ndarray, num_nodes: int) -> tuple[list, list]:
    """One row: nodes numbered as they are first met, continuation by continuation; the first
    num_nodes kept. Returns the kept nodes' tokens and parents (verify indices)."""
    drafts, parents, index_of = [], [], {}  # index_of: token prefix -> verify index
    for chain, chain_real in zip(continuations, real):
        prefix, parent = (), 0
        for token, is_real in zip(chain.tolist(), chain_real.tolist()):
            if not is_real:
                break
            prefix += (token,)
            if prefix not in index_of:
                if len(drafts) == num_nodes:
                    break
                drafts.append(token)
                parents.append(parent)
                index_of[prefix] = len(drafts)
            parent = index_of[prefix]
    return drafts, parents


def random_continuations(seed: int, batch: int, count: int, span: int) -> tuple[np.ndarray, np.ndarray]:
    """Continuations over 3 tokens (so prefixes are often shared), some rows repeating their best
    one or sharing its first two tokens, each cut to a random real length (0 .. span): real is
    prefix-closed."""
    rng = np.random.default_rng(seed)
    continuations = rng.integers(0, 3, (batch, count, span)).astype(np.int32)
    if count > 1:
        continuations[::2, -1] = continuations[::2, 0]  # a duplicate continuation
        continuations[1::2, 1, :2] = continuations[1::2, 0, :2]  # a shared prefix of two, then they part
    real_lengths = rng.integers(0, span + 1, (batch, count))
    real = np.arange(span)[None, None, :] < real_lengths[:, :, None]
    continuations = np.where(real, continuations, 7)  # past the real length: junk that must be ignored
    return continuations, real


@pytest.mark.parametrize("count, span, num_nodes", [
    (4, 5, 20),  # every node kept (M * D)
    (4, 5, 6), (4, 5, 1),  # truncated
    (3, 1, 3),  # depth 1: the matches' first tokens, merged
    (1, 4, 4),  # one match: a chain
])
def test_trie_matches_a_plain_python_trie(count, span, num_nodes):
    continuations, real = random_continuations(num_nodes, batch=6, count=count, span=span)
    drafts, parents, num_proposed = trie(jnp.asarray(continuations), jnp.asarray(real), num_nodes)
    chex.assert_shape((drafts, parents), (6, num_nodes))
    drafts, parents, num_proposed = map(np.asarray, (drafts, parents, num_proposed))
    for row in range(6):
        expected_drafts, expected_parents = reference_trie(continuations[row], real[row], num_nodes)
        real_nodes = len(expected_drafts)
        assert num_proposed[row] == real_nodes
        np.testing.assert_array_equal(drafts[row, :real_nodes], expected_drafts)
        np.testing.assert_array_equal(parents[row, :real_nodes], expected_parents)
        # Padding keeps the structure valid: parents before children everywhere.
        assert np.all(parents[row] < np.arange(1, num_nodes + 1)) and np.all(parents[row] >= 0)
        siblings = {(int(p), int(t)) for p, t in zip(parents[row, :real_nodes], drafts[row, :real_nodes])}
        assert len(siblings) == real_nodes  # no two children of one node carry the same token


def test_trie_of_identical_continuations_is_one_chain():
    chain = jnp.array([[[4, 5, 6]] * 3])  # [B=1, M=3, D=3]
    drafts, parents, num_proposed = trie(chain, jnp.ones(chain.shape, bool), 9)
    assert num_proposed.tolist() == [3]
    assert drafts[0, :3].tolist() == [4, 5, 6] and parents[0, :3].tolist() == [0, 1, 2]


def test_trie_of_nothing_proposes_nothing():
    drafts, parents, num_proposed = trie(jnp.ones((2, 2, 3), jnp.int32), jnp.zeros((2, 2, 3), bool), 4)
    assert num_proposed.tolist() == [0, 0]


# ----------------------------------------------------------------------------------------------
# Greedy acceptance
# ----------------------------------------------------------------------------------------------

VOCAB = 8


def logits_with_argmax(argmax) -> jax.Array:
    """[B, 1+N, V] logits whose argmax at each verify index is `argmax` [B, 1+N]."""
    noise = np.random.default_rng(0).random(np.shape(argmax) + (VOCAB,))
    return jnp.asarray(np.eye(VOCAB)[np.asarray(argmax)] * 5.0 + noise, jnp.float32)


@dataclasses.dataclass(frozen=True)
class GreedyCase:
    pending: int
    drafts: tuple[int, ...]
    parents: tuple[int, ...]
    num_proposed: int
    argmax: tuple[int, ...]  # the target's argmax at each verify index 0 .. N
    accepted: int
    path: tuple[int, ...]  # the accepted verify indices, root first
    committed: tuple[int, ...]  # the path's tokens, then the bonus


# By the depth they run under (a row's tree may be shallower than the DraftTree's depth).
GREEDY_CASES = {
    1: {
        "depth-1": GreedyCase(
            pending=0, drafts=(4, 6, 1), parents=(0, 0, 0), num_proposed=3, argmax=(6, 0, 2, 0),
            accepted=1, path=(0, 2), committed=(6, 2)),
        "nothing-matches": GreedyCase(
            pending=0, drafts=(4, 6, 1), parents=(0, 0, 0), num_proposed=3, argmax=(3, 4, 6, 1),
            accepted=0, path=(0,), committed=(3,)),
    },
    3: {
        # root 7 -> {1: 2 -> {2: 4}, 3: 5 -> {4: 1, 5: 3}}. The root's argmax is 5 (node 3, the
        # second branch; node 1's child would match too, but node 1 does not), node 3's is 3
        # (node 5), node 5's, the bonus, 6.
        "best-path-not-the-first-branch": GreedyCase(
            pending=7, drafts=(2, 4, 5, 1, 3), parents=(0, 1, 0, 3, 3), num_proposed=5, argmax=(5, 4, 0, 3, 0, 6),
            accepted=2, path=(0, 3, 5), committed=(5, 3, 6)),
        # root -> {1: 2 -> {3: 0}, 2: 5 -> {4: 3}}, node 4 is padding (num_proposed 3). It matches
        # node 2's argmax 3 but is never accepted: 3 is the bonus instead.
        "padding-never-accepted": GreedyCase(
            pending=1, drafts=(2, 5, 0, 3), parents=(0, 0, 1, 2), num_proposed=3, argmax=(5, 0, 3, 1, 1),
            accepted=1, path=(0, 2), committed=(5, 3)),
        # A chain accepted to its end: the bonus is the last node's argmax.
        "whole-chain": GreedyCase(
            pending=0, drafts=(1, 2, 3), parents=(0, 1, 2), num_proposed=3, argmax=(1, 2, 3, 4),
            accepted=3, path=(0, 1, 2, 3), committed=(1, 2, 3, 4)),
    },
}


def test_greedy_accept_on_hand_built_trees():
    for depth, cases in GREEDY_CASES.items():
        # One batch per depth, every row padded to the same N with padding nodes (token 0 under
        # the root, argmax 0 there): never accepted, whatever they match.
        nodes = max(len(case.drafts) for case in cases.values())

        def padded(values, size=nodes):
            return list(values) + [0] * (size - len(values))

        outcome = jax.device_get(greedy_accept(jnp.array([case.pending for case in cases.values()]),
                                jnp.array([padded(case.drafts) for case in cases.values()]),
                                jnp.array([padded(case.parents) for case in cases.values()]),
                                jnp.array([case.num_proposed for case in cases.values()]),
                                logits_with_argmax([padded(case.argmax, nodes + 1) for case in cases.values()]),
                                depth=depth))
        chex.assert_shape((outcome.path, outcome.committed), (len(cases), depth + 1))
        for row, (name, case) in enumerate(cases.items()):
            # Past the accepted node, path and committed are padding: only the first n + 1 count.
            accepted = int(outcome.accepted[row])
            assert accepted == case.accepted, name
            assert outcome.path[row, :accepted + 1].tolist() == list(case.path), name
            assert outcome.committed[row, :accepted + 1].tolist() == list(case.committed), name


def test_greedy_accept_on_a_chain_is_the_longest_prefix_of_argmaxes():
    """A chain (node v's parent v - 1) against a plain-Python model: the drafts kept are the
    leading run that equals the argmax before each, then the argmax after the last one kept."""
    batch, k = 32, 4
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(batch, k + 1, VOCAB)), jnp.float32)
    argmax = np.asarray(jnp.argmax(logits, -1))
    # Drafts are the argmaxes but for one corrupted position per row (or none, past k).
    wrong_at = rng.integers(0, k + 1, batch)
    drafts = np.where(np.arange(k)[None] == wrong_at[:, None], (argmax[:, :k] + 1) % VOCAB, argmax[:, :k])
    num_proposed = rng.integers(0, k + 1, batch)
    pending = jnp.asarray(rng.integers(0, VOCAB, batch), jnp.int32)
    outcome = jax.device_get(greedy_accept(pending, jnp.asarray(drafts, jnp.int32), verify.chain_parents(batch, k),
                                           jnp.asarray(num_proposed, jnp.int32), logits, depth=k))
    for row in range(batch):
        n = 0
        while n < num_proposed[row] and drafts[row, n] == argmax[row, n]:
            n += 1
        assert int(outcome.accepted[row]) == n
        assert outcome.committed[row, :n + 1].tolist() == drafts[row, :n].tolist() + [argmax[row, n]]
        assert outcome.path[row, :n + 1].tolist() == list(range(n + 1))
    assert len(set(outcome.accepted.tolist())) > 2  # the rows cover several outcomes


# ----------------------------------------------------------------------------------------------
# Sampled acceptance: the committed tokens are distributed as the target's own sampling
# ----------------------------------------------------------------------------------------------

SAMPLED_VOCAB = 6
END = SAMPLED_VOCAB  # marks the committed positions past the round's last token
SAMPLES = 40_000
# root -> {1: 0 -> {3: 1 -> {6: 5}, 4: 4 -> {7: 0}}, 2: 3 -> {5: 2}, 8: 2 (padding)}: siblings at
# every depth; the padding node would make token 2 at the root continue if it were ever considered.
SAMPLED_DRAFTS = (0, 3, 1, 4, 2, 5, 0, 2)
SAMPLED_PARENTS = (0, 0, 1, 1, 2, 3, 4, 0)
SAMPLED_NUM_PROPOSED = 7
SAMPLED_DEPTH = 3


def sampled_target_probs() -> np.ndarray:
    """p [1+N, V]: a different random distribution at every verify index, none of them tiny."""
    return np.random.default_rng(1).dirichlet(np.full(SAMPLED_VOCAB, 2.0), len(SAMPLED_DRAFTS) + 1)


def exact_committed_distribution(probs: np.ndarray) -> np.ndarray:
    """[V+1] * (depth+1): P(committed tokens, END-padded past the round's last one), by walking the
    tree: at a node the next token x ~ p_node; if x is a real child's token the walk goes on at
    that child, else x was the bonus and the round ends."""
    table = np.zeros((SAMPLED_VOCAB + 1,) * (SAMPLED_DEPTH + 1))

    def walk(node: int, prefix: tuple[int, ...], mass: float):
        for token in range(SAMPLED_VOCAB):
            children = [v for v in range(1, SAMPLED_NUM_PROPOSED + 1)
                        if SAMPLED_PARENTS[v - 1] == node and SAMPLED_DRAFTS[v - 1] == token]
            if children:
                walk(children[0], prefix + (token,), mass * probs[node, token])
            else:
                table[prefix + (token,) + (END,) * (SAMPLED_DEPTH - len(prefix))] += mass * probs[node, token]

    walk(0, (), 1.0)
    return table


@functools.partial(jax.jit, static_argnums=6)
def rejection_sample(pending, drafts, parents, num_proposed, target_probs, key, depth):
    return verify.rejection_sample(pending, drafts, parents, num_proposed, None, target_probs, key, depth)


def sampled_counts(breakage=None) -> np.ndarray:
    """Counts of the committed sequences (END-padded) over SAMPLES rows of one vectorized call;
    `breakage(outcome, target_probs, key)` turns the verifier into a broken one."""
    probs = sampled_target_probs()
    key = jax.random.PRNGKey(0)
    target_probs = jnp.broadcast_to(jnp.asarray(probs, jnp.float32), (SAMPLES,) + probs.shape)
    drafts = jnp.broadcast_to(jnp.array(SAMPLED_DRAFTS, jnp.int32), (SAMPLES, len(SAMPLED_DRAFTS)))
    parents = jnp.broadcast_to(jnp.array(SAMPLED_PARENTS, jnp.int32), (SAMPLES, len(SAMPLED_PARENTS)))
    outcome = rejection_sample(jnp.zeros((SAMPLES,), jnp.int32), drafts, parents,
                               jnp.full((SAMPLES,), SAMPLED_NUM_PROPOSED, jnp.int32), target_probs, key, SAMPLED_DEPTH)
    if breakage is not None:
        outcome = breakage(outcome, target_probs, key)
    accepted, committed, path = map(np.asarray, (outcome.accepted, outcome.committed, outcome.path))
    # The path's nodes carry the accepted tokens.
    tokens = np.array((0,) + SAMPLED_DRAFTS)
    accepted_part = np.arange(SAMPLED_DEPTH)[None, :] < accepted[:, None]
    np.testing.assert_array_equal(np.where(accepted_part, tokens[path[:, 1:]], 0),
                                  np.where(accepted_part, committed[:, :SAMPLED_DEPTH], 0))
    padded = np.where(np.arange(SAMPLED_DEPTH + 1)[None, :] <= accepted[:, None], committed, END)
    counts = np.zeros((SAMPLED_VOCAB + 1,) * (SAMPLED_DEPTH + 1), np.int64)
    np.add.at(counts, tuple(padded.T), 1)
    return counts


def test_rejection_sample_commits_the_targets_distribution():
    counts = sampled_counts()
    expected = exact_committed_distribution(sampled_target_probs())
    assert counts[..., END].sum() < SAMPLES  # some rows accept all the way down
    p_value = chi_square_p_value(counts, expected)
    assert p_value > SIGNIFICANCE, f"tree sampling differs from the target's distribution: p = {p_value:.2e}"


def test_rejection_sample_corner_cases_are_certain():
    """Point-mass and all-children targets, no draws left to chance. The tree: root -> {1: token 1,
    2: token 2 -> {3: token 4}}, depth 2; 100 rows of each case."""
    one_hot = np.eye(SAMPLED_VOCAB)
    cases = [  # (num_proposed, p at verify indices 0 .. 3, the committed tokens every row must get)
        # p puts nothing on node 1 and everything on node 2: node 2 always; its child 4 has p = 0,
        # so the bonus comes from p at node 2 without 4: token 5.
        (3, [one_hot[2], one_hot[0], one_hot[5], one_hot[3]], {(2, 5)}),
        # The root's children hold all of p: one is always accepted (the residual is never drawn
        # from nothing), then node 2's only child is certain too.
        (3, [(one_hot[1] + one_hot[2]) / 2, one_hot[0], one_hot[4], one_hot[3]], {(1, 0), (2, 4, 3)}),
        # Nothing proposed: p's certain token 1 is the bonus, though node 1 carries it.
        (0, [one_hot[1], one_hot[0], one_hot[0], one_hot[0]], {(1,)}),
    ]
    rows = 100
    num_proposed = jnp.repeat(jnp.array([case[0] for case in cases], jnp.int32), rows)
    target_probs = jnp.repeat(jnp.asarray([case[1] for case in cases], jnp.float32), rows, axis=0)
    batch = len(cases) * rows
    outcome = rejection_sample(jnp.zeros((batch,), jnp.int32), jnp.broadcast_to(jnp.array([1, 2, 4]), (batch, 3)),
                               jnp.broadcast_to(jnp.array([0, 0, 2]), (batch, 3)), num_proposed, target_probs,
                               jax.random.PRNGKey(1), 2)
    accepted, committed = np.asarray(outcome.accepted), np.asarray(outcome.committed)
    for index, (_, _, allowed) in enumerate(cases):
        got = {tuple(committed[row, :accepted[row] + 1].tolist()) for row in range(index * rows, (index + 1) * rows)}
        assert got == allowed, index


@jax.jit
def _bonus_from_p_with_the_children_left_in(outcome: verify.Accepted, target_probs, key) -> verify.Accepted:
    """A plausible bug: when every child is rejected, draw the next token from p itself instead of
    p without the children (so a child's token can come back as the bonus)."""
    rows = jnp.arange(target_probs.shape[0])
    last_node = outcome.path[rows, outcome.accepted]
    p = target_probs[rows, last_node]  # [B, V]
    redrawn = jax.random.categorical(jax.random.fold_in(key, 99), jnp.log(p), axis=-1).astype(jnp.int32)
    return dataclasses.replace(outcome, committed=outcome.committed.at[rows, outcome.accepted].set(redrawn))


def test_a_verifier_that_keeps_the_rejected_children_fails_the_same_test():
    counts = sampled_counts(breakage=_bonus_from_p_with_the_children_left_in)
    p_value = chi_square_p_value(counts, exact_committed_distribution(sampled_target_probs()))
    assert p_value < SIGNIFICANCE, f"the broken verifier went undetected: p = {p_value:.2e}"


# ----------------------------------------------------------------------------------------------
# EAGLE-2 growth
# ----------------------------------------------------------------------------------------------

DRAFT_VOCAB = 7


def to_target(ids):
    """Drafter ids -> target ids: an injective map that is not the identity."""
    return 2 * ids + 1


TARGET_VOCAB = 2 * DRAFT_VOCAB + 1


@dataclasses.dataclass
class Candidate:
    score: float
    draft_id: int
    parent: int  # candidate index, -1 for the root
    slot: int = -1  # scratch slot, if the candidate ran as a frontier node


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """In float32, as grow scores: ties a drafter makes (a uniform or a certain distribution)
    stay exact ties in both."""
    shifted = logits.astype(np.float32) - logits.max()
    return shifted - np.log(np.sum(np.exp(shifted)))


def best(scores, count: int) -> list[int]:
    """Indices of the `count` highest scores, highest first, ties to the lower index (as top_k)."""
    return np.argsort(-np.asarray(scores), kind="stable")[:count].tolist()


def reference_grow(shape: DraftTree, root_logits: np.ndarray, table: np.ndarray, root_carry: int):
    """One row of EAGLE-2 in plain Python: the kept nodes (tokens, parents, scratch slots) and each
    expansion's frontier as the drafter must see it (tokens, carries, visible scratch slots)."""
    K = shape.top_k
    root = log_softmax(root_logits)
    candidates = [Candidate(root[i], i, -1, j if shape.depth > 1 else -1) for j, i in enumerate(best(root, K))]
    frontier = list(range(K))
    expansions = []
    for level in range(1, shape.depth):
        def seen_slots(c):  # the scratch slots of c and its ancestors
            return {candidates[c].slot} | (seen_slots(candidates[c].parent) if candidates[c].parent >= 0 else set())
        expansions.append(dict(
            tokens=[to_target(candidates[f].draft_id) for f in frontier],
            carry=[root_carry if level == 1 else to_target(candidates[candidates[f].parent].draft_id)
                   for f in frontier],
            mask=[[m in seen_slots(f) for m in range(shape.scratch_slots)] for f in frontier]))
        start, children = len(candidates), []
        for f in frontier:
            child = log_softmax(table[level, to_target(candidates[f].draft_id)])
            children += [Candidate(candidates[f].score + child[i], i, f) for i in best(child, K)]
        candidates += children
        next_frontier = best([c.score for c in children], K)
        if level + 1 < shape.depth:
            for j, b in enumerate(next_frontier):
                children[b].slot = level * K + j
        frontier = [start + b for b in next_frontier]
    kept = sorted(best([c.score for c in candidates], shape.num_nodes))
    verify_index = {c: v for v, c in enumerate(kept, start=1)}
    drafts = [to_target(candidates[c].draft_id) for c in kept]
    parents = [verify_index[candidates[c].parent] if candidates[c].parent >= 0 else 0 for c in kept]
    return drafts, parents, [candidates[c].slot for c in kept], expansions


def drafter_logits(drafter: str, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """random: no ties; uniform: every candidate of a depth ties (top_k takes the lower index);
    certain: each node's best child scores exactly its parent (log-probability 0 in float32)."""
    if drafter == "random":
        return rng.normal(size=shape).astype(np.float32) * 2
    if drafter == "uniform":
        return np.zeros(shape, np.float32)
    return np.eye(shape[-1], dtype=np.float32)[rng.integers(0, shape[-1], shape[:-1])] * 100


@pytest.mark.parametrize("depth, top_k, num_nodes, drafter", [
    (1, 3, 2, "random"), (3, 1, 3, "random"), (3, 2, 7, "random"), (2, 2, 6, "random"), (4, 3, 12, "random"),
    (3, 2, 10, "uniform"), (4, 3, 12, "certain"),
])
def test_grow_matches_a_plain_python_eagle2(depth, top_k, num_nodes, drafter):
    shape = DraftTree(depth, top_k, num_nodes)
    batch = 3
    rng = np.random.default_rng(depth * 10 + top_k)
    root_logits = drafter_logits(drafter, rng, (batch, DRAFT_VOCAB))
    # The drafter's next-token logits depend only on the frontier token and the level.
    table = drafter_logits(drafter, rng, (depth, TARGET_VOCAB, DRAFT_VOCAB))
    root_carry = 1000 + np.arange(batch)

    def expand(calls, tokens, carry, level, mask):
        chex.assert_shape((tokens, carry), (batch, top_k))
        chex.assert_shape(mask, (batch, top_k, shape.scratch_slots))
        calls = calls + (dict(tokens=tokens, carry=carry, level=level, mask=mask),)
        return jnp.asarray(table)[level, tokens], tokens, calls  # each node's children carry its token

    grow = jax.jit(lambda root_logits, root_carry: tree.grow(shape, root_logits, root_carry, expand, to_target, ()))
    grown, calls = jax.device_get(grow(jnp.asarray(root_logits), jnp.asarray(root_carry)))
    chex.assert_shape((grown.drafts, grown.parents, grown.scratch_slot), (batch, num_nodes))
    assert [int(call["level"]) for call in calls] == list(range(1, depth))
    for row in range(batch):
        drafts, parents, slots, expansions = reference_grow(shape, root_logits[row], table, int(root_carry[row]))
        assert grown.drafts[row].tolist() == drafts
        assert grown.parents[row].tolist() == parents
        assert grown.scratch_slot[row].tolist() == slots
        for call, expected in zip(calls, expansions):
            assert call["tokens"][row].tolist() == expected["tokens"]
            assert call["carry"][row].tolist() == expected["carry"]
            assert call["mask"][row].tolist() == expected["mask"]

    # The contract's invariants, on the tree itself.
    parents, slots = np.asarray(grown.parents), np.asarray(grown.scratch_slot)
    assert np.all((parents >= 0) & (parents < np.arange(1, num_nodes + 1)))  # kept parents, earlier
    depths = np.asarray(node_depths(grown.parents, depth))[:, 1:]
    assert depths.max() <= depth
    for row in range(batch):
        siblings = {(p, t) for p, t in zip(parents[row].tolist(), grown.drafts[row].tolist())}
        assert len(siblings) == num_nodes
        ran = slots[row][slots[row] >= 0]
        assert len(set(ran.tolist())) == len(ran) and np.all(ran < shape.scratch_slots)
        assert np.all(slots[row][depths[row] == depth] == -1)  # the deepest level never runs


def test_grow_with_top_k_1_is_the_drafters_greedy_chain():
    shape = DraftTree(4, 1, 4)
    rng = np.random.default_rng(5)
    root_logits = rng.normal(size=(2, DRAFT_VOCAB)).astype(np.float32)
    table = rng.normal(size=(4, TARGET_VOCAB, DRAFT_VOCAB)).astype(np.float32)

    def expand(state, tokens, carry, level, mask):
        return jnp.asarray(table)[level, tokens], carry, state

    grown, _ = jax.device_get(jax.jit(lambda root_logits: tree.grow(shape, root_logits, None, expand, to_target, None))(
        jnp.asarray(root_logits)))
    for row in range(2):
        chain = [to_target(int(np.argmax(root_logits[row])))]
        for level in range(1, 4):
            chain.append(to_target(int(np.argmax(table[level, chain[-1]]))))
        assert grown.drafts[row].tolist() == chain
        assert grown.parents[row].tolist() == [0, 1, 2, 3]
        assert grown.scratch_slot[row].tolist() == [0, 1, 2, -1]
