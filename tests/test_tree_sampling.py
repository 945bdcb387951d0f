"""Tree sampling is lossless: multi-draft verification through the real loop, proven
statistically against exact enumeration (test_spec_sampling's 12-token target, its first three
tokens, chi-square at 1e-3).

The trees branch (2, 3, 6): each node has up to three children, so a rejected child passes the
walk on to its siblings with their renormalised probabilities, and a node whose children are all
rejected draws from p with those children removed. A verifier that draws from p itself instead
fails the same test.
"""

from __future__ import annotations

import jax
import pytest

from jaxspec.spec import loop
from tests import test_spec_sampling
from tests.test_spec_sampling import (SIGNIFICANCE, _rejection_without_residual, assert_lossless, chi_square_p_value,
                                      exact_joint, sampled_joint)
from tests.test_spec_sampling import draft, target  # noqa: F401 (fixtures)

TREE = (2, 3, 6)  # depth 2, three children per node, six nodes verified

# Layer-skip is the draft-model proposer with the target's first layers as the draft: the draft
# case covers its tree path.
CASES = [
    ("draft-t0.7-topk5", dict(temperature=0.7, top_k=5), dict(method="draft")),
    ("ngram-t1.0-reppen1.2", dict(temperature=1.0, repetition_penalty=1.2), dict(method="ngram")),
]


@pytest.mark.parametrize("name, settings, method", CASES, ids=[c[0] for c in CASES])
def test_tree_sampling_matches_the_exact_distribution(target, draft, name, settings, method):
    draft_model = draft if method["method"] == "draft" else None
    stats = assert_lossless(target, draft_model, settings, tree=TREE, **method)
    assert stats.tree == "2,3,6" and sum(stats.accepted_depths) == stats.rounds
    assert stats.accepted > 0  # paths do get accepted: the walk below the root is exercised


def test_a_tree_verifier_that_keeps_the_rejected_children_fails_the_same_test(target, draft, monkeypatch):
    settings = dict(temperature=1.0)
    exact = exact_joint(target, settings)  # before the caches go: its programs are the case's above
    monkeypatch.setattr(loop, "rejection_sample", _rejection_without_residual)
    # One seed's 5000 samples are plenty: this bug scores p < 1e-36 on 2000.
    monkeypatch.setattr(test_spec_sampling, "SEEDS", 1)
    # The broken verifier must be traced into a fresh program, and not left behind for others.
    jax.clear_caches()
    try:
        counts, _ = sampled_joint(target, draft, settings, method="draft", tree=TREE)
    finally:
        jax.clear_caches()
    p_value = chi_square_p_value(counts, exact)
    assert p_value < SIGNIFICANCE, f"the broken verifier went undetected: p = {p_value:.2e}"
