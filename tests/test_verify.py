"""Verification (jaxspec.spec.verify) of chains on hand-made inputs: greedy acceptance, rejection
sampling's corner cases with a sampled q, and the eager check of caller-supplied distributions.
Trees, and the statistical proof over exact enumeration, are in test_tree.py; through the whole
loop in test_spec_sampling.py."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec.spec import verify


def accept_chain(drafts, num_proposed, logits):
    """Greedy acceptance of a chain (pending token 0: a chain's root token is never compared)."""
    batch, k = drafts.shape
    outcome = verify.greedy_accept(jnp.zeros((batch,), jnp.int32), drafts, verify.chain_parents(batch, k),
                                   num_proposed, logits, k)
    return outcome.accepted, outcome.committed


def sample_chain(drafts, num_proposed, q, p, key):
    batch, k = np.shape(drafts)
    outcome = verify.rejection_sample(jnp.zeros((batch,), jnp.int32), jnp.asarray(drafts),
                                      verify.chain_parents(batch, k), jnp.asarray(num_proposed), q, p, key, k)
    return outcome.accepted, outcome.committed


class AcceptedPrefixTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_accepted_prefix_length_counts_the_leading_run(self):
        matches = jnp.array([[True, True, False, True], [False, True, True, True], [True, True, True, True]])
        lengths = self.variant(verify.accepted_prefix_length)(matches)
        chex.assert_trees_all_equal(lengths, jnp.array([2, 0, 4], jnp.int32))


def test_greedy_accept_by_hand():
    # Target argmaxes per verify position: row 0 -> 1 2 3 (drafts 1 2 match, bonus 3);
    # row 1 -> 0 2 1 (first draft 1 != 0: none accepted, bonus 0); row 2 proposes only one draft.
    target_tokens = jnp.array([[1, 2, 3], [0, 2, 1], [1, 2, 3]])
    logits = jax.nn.one_hot(target_tokens, 4) * 5.0  # [B, k+1, V]
    drafts = jnp.array([[1, 2], [1, 2], [1, 2]])
    accepted, committed = accept_chain(drafts, jnp.array([2, 2, 1]), logits)
    chex.assert_trees_all_equal(accepted, jnp.array([2, 0, 1], jnp.int32))
    # The first n + 1 are the round's: the accepted drafts, then the target's own token after them.
    assert [row[:n + 1] for row, n in zip(committed.tolist(), accepted.tolist())] == [[1, 2, 3], [0], [1, 2]]


def test_rejection_sample_keeps_drafts_that_p_and_q_agree_on():
    """p == q: every draft is kept (u * q < p for u < 1), and the bonus comes from p at k."""
    drafts = jnp.array([[2, 0]])
    q = jnp.asarray([[[0.1, 0.2, 0.7], [0.5, 0.25, 0.25]]])
    p = jnp.concatenate([q, jnp.asarray([[[0.0, 0.0, 1.0]]])], axis=1)  # the bonus is certain: token 2
    accepted, committed = sample_chain(drafts, jnp.array([2]), q, p, jax.random.PRNGKey(0))
    assert accepted.tolist() == [2] and committed.tolist() == [[2, 0, 2]]


def test_a_draft_the_target_cannot_produce_is_replaced_from_the_residual():
    """p(x) = 0: the point-mass draft is always rejected; the residual is p itself."""
    drafts = jnp.array([[1]])
    p = jnp.asarray([[[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]])
    accepted, committed = sample_chain(drafts, jnp.array([1]), None, p, jax.random.PRNGKey(3))
    assert accepted.tolist() == [0] and committed.tolist() == [[2, 0]]


def test_a_sampled_draft_is_replaced_from_the_residual_of_p_and_q():
    """q puts 0.9 on the draft, p 0.5: rejected half... of the time, then drawn from
    norm(max(0, p - q)), which here is token 2 alone."""
    drafts = jnp.array([[0]] * 2000)
    q = jnp.broadcast_to(jnp.asarray([0.9, 0.1, 0.0]), (2000, 1, 3))
    p = jnp.broadcast_to(jnp.asarray([[0.45, 0.1, 0.45], [1.0, 0.0, 0.0]]), (2000, 2, 3))
    accepted, committed = sample_chain(drafts, jnp.full((2000,), 1), q, p, jax.random.PRNGKey(5))
    accepted, committed = np.asarray(accepted), np.asarray(committed)
    assert set(committed[accepted == 0, 0].tolist()) == {2}  # the residual: p - q is left on 2 only
    assert abs(accepted.mean() - 0.5) < 0.05  # kept with p(x) / q(x) = 0.5


def _valid_inputs(batch=2, k=2, vocab=5):
    rng = np.random.RandomState(0)
    drafts = rng.randint(0, vocab, (batch, k))
    q = rng.dirichlet(np.ones(vocab), (batch, k)).astype(np.float32)
    p = rng.dirichlet(np.ones(vocab), (batch, k + 1)).astype(np.float32)
    return drafts, q, p


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda d, q, p: (d, q * 0.5, p), "draft probabilities must sum to 1"),
        (lambda d, q, p: (d, np.where(np.arange(5) == 0, np.nan, q), p), "NaN"),
        (lambda d, q, p: (d, q[..., :4] / q[..., :4].sum(-1, keepdims=True), p), "target's vocabulary"),
        (lambda d, q, p: (d + 5, q, p), "draft token ids"),
        (lambda d, q, p: (d, q, p[:, :2]), "target_probs must be"),
    ],
)
def test_bad_distributions_are_refused_with_a_clear_error(corrupt, message):
    drafts, q, p = corrupt(*_valid_inputs())
    with pytest.raises(jaxspec.InvalidRequestError, match=message):
        sample_chain(jnp.asarray(drafts), jnp.full((2,), 2), q, p, jax.random.PRNGKey(0))


def test_valid_distributions_pass_the_eager_check():
    drafts, q, p = _valid_inputs()
    accepted, committed = sample_chain(jnp.asarray(drafts), jnp.full((2,), 2), q, p,
                                                  jax.random.PRNGKey(0))
    assert accepted.shape == (2,) and committed.shape == (2, 3)
