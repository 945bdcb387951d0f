"""Sampling: the processed distribution against HF's own logits processors, and seeded draws."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.sampling import SamplingParams, processed_logits, select, spec_for


def _hf_processed(logits, seen_ids, *, temperature, top_k, top_p, min_p, repetition_penalty):
    import torch
    from transformers.generation.logits_process import (
        LogitsProcessorList, MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
    )

    processors = LogitsProcessorList()
    if repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(repetition_penalty))
    processors.append(TemperatureLogitsWarper(temperature))
    if top_k:
        processors.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        processors.append(TopPLogitsWarper(top_p))
    if min_p:
        processors.append(MinPLogitsWarper(min_p))
    return processors(torch.tensor(seen_ids), torch.tensor(logits)).numpy()


SETTINGS = [
    dict(temperature=0.7, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0),
    dict(temperature=1.0, top_k=5, top_p=1.0, min_p=0.0, repetition_penalty=1.0),
    dict(temperature=1.3, top_k=0, top_p=0.8, min_p=0.0, repetition_penalty=1.0),
    dict(temperature=0.9, top_k=10, top_p=0.6, min_p=0.0, repetition_penalty=1.0),
    dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.1, repetition_penalty=1.0),
    dict(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.2),
]


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_processed_distribution_matches_transformers(setting):
    rng = np.random.RandomState(0)
    logits = (rng.randn(4, 64) * 3).astype(np.float32)
    seen_ids = rng.randint(0, 64, (4, 6))
    seen = np.zeros((4, 64), bool)
    np.put_along_axis(seen, seen_ids, True, axis=1)

    params = SamplingParams.create(4, **setting)
    spec = spec_for(**setting)
    ours = np.asarray(logits)
    if spec.repetition_penalty:
        from jaxspec.sampling import apply_repetition_penalty
        ours = apply_repetition_penalty(jnp.asarray(ours), jnp.asarray(seen), params.repetition_penalty)
    ours = np.asarray(processed_logits(jnp.asarray(ours), params, spec))
    reference = _hf_processed(logits, seen_ids, **setting)
    np.testing.assert_array_equal(np.isfinite(ours), np.isfinite(reference))  # same kept set
    np.testing.assert_allclose(jax.nn.softmax(ours), jax.nn.softmax(reference), atol=1e-6)


def _kept_by_sorting(row: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """The kept set as a sort defines it (numpy, float64): the top_k largest (ties at the k-th
    included), then the smallest descending prefix of their mass reaching top_p (ties with its
    last token included)."""
    finite = np.isfinite(row)
    order = np.argsort(-row, kind="stable")
    keep = finite.copy()
    if top_k:
        kth = row[order[min(top_k, row.size) - 1]]
        keep &= row >= kth
    if top_p < 1:
        probs = np.where(keep, np.exp(row - row[keep].max()), 0.0)
        probs /= probs.sum()
        ordered = probs[order]
        before = np.cumsum(ordered) - ordered
        last = row[order[np.flatnonzero(before < top_p)[-1]]]
        keep &= row >= last
    return keep


def test_top_k_and_top_p_keep_what_a_sort_keeps_with_ties_and_masked_tokens():
    """Thresholds found by bisection over the float bits, not by sorting: the same kept set on
    rows full of ties (rounded logits, a block of zeros) and of -inf (masked) tokens."""
    rng = np.random.default_rng(7)
    # Three widths (a row narrower than top_k, a mid one, an odd wide one) under one jit each:
    # every trial of a width reuses its program instead of dispatching op by op at a new shape.
    keep = jax.jit(processed_logits, static_argnums=2)
    for trial in range(40):
        rows, vocab = 4, (3, 37, 199)[trial % 3]
        logits = (rng.normal(size=(rows, vocab)) * rng.uniform(0.5, 6)).astype(np.float32)
        if trial % 2:
            logits = np.round(logits)
        logits[:, rng.integers(0, vocab, vocab // 4)] = -np.inf
        logits[0, : vocab // 2] = 0.0
        logits[:, 0] = 1.0  # one finite token at least
        top_k = [int(k) for k in rng.integers(0, vocab + 2, rows)]
        top_p = [float(p) for p in rng.choice([0.05, 0.5, 0.9, 1.0], rows)]
        settings = dict(temperature=1.0, top_k=top_k, top_p=top_p)
        out = np.asarray(keep(jnp.asarray(logits), SamplingParams.create(rows, **settings), spec_for(**settings)))
        for row in range(rows):
            expected = _kept_by_sorting(logits[row].astype(np.float64), top_k[row], top_p[row])
            np.testing.assert_array_equal(np.isfinite(out[row]), expected, err_msg=f"trial {trial} row {row}")


def test_greedy_is_argmax_and_needs_no_key():
    logits = jnp.array([[0.1, 2.0, -1.0], [3.0, 0.0, 2.9]])
    params = SamplingParams.create(2)
    np.testing.assert_array_equal(select(logits, params, spec_for(temperature=0.0), None), [1, 0])


def test_repetition_penalty_can_change_the_greedy_choice():
    logits = jnp.array([[2.0, 1.9, -1.0]])
    seen = jnp.array([[True, False, False]])
    params = SamplingParams.create(1, repetition_penalty=1.5)
    spec = spec_for(temperature=0.0, repetition_penalty=1.5)
    assert int(select(logits, params, spec, None, seen)[0]) == 1  # 2.0 / 1.5 < 1.9


def test_draws_follow_the_processed_distribution():
    """Exact enumeration: 40k seeded draws over 6 tokens against softmax(processed logits)."""
    logits = jnp.log(jnp.array([[0.05, 0.1, 0.15, 0.2, 0.2, 0.3]]))
    setting = dict(temperature=0.8, top_k=4, top_p=0.95)
    params = SamplingParams.create(1, **setting)
    spec = spec_for(**setting)
    keys = jax.random.split(jax.random.PRNGKey(0), 40_000)
    draws = jax.vmap(lambda k: select(logits, params, spec, k)[0])(keys)
    counts = np.bincount(np.asarray(draws), minlength=6)
    expected = np.asarray(jax.nn.softmax(processed_logits(logits, params, spec)))[0]
    assert counts[:2].sum() == 0  # filtered by top-k
    total_variation = 0.5 * np.abs(counts / counts.sum() - expected).sum()
    assert total_variation < 0.01, (counts, expected)


def test_mixed_rows_greedy_and_sampled():
    logits = jnp.tile(jnp.array([[0.0, 0.5, 0.4, 0.3]]), (2, 1))
    params = SamplingParams.create(2, temperature=jnp.array([0.0, 5.0]))
    spec = spec_for(temperature=[0.0, 5.0])
    draws = jax.vmap(lambda k: select(logits, params, spec, k))(jax.random.split(jax.random.PRNGKey(1), 500))
    assert set(np.asarray(draws[:, 0]).tolist()) == {1}  # the greedy row never moves
    assert len(set(np.asarray(draws[:, 1]).tolist())) == 4  # the hot row visits every token
