"""Speculative sampling is lossless: proven statistically against exact enumeration.

A 12-token vocabulary makes the target's exact joint distribution of its first three generated
tokens enumerable (12^3 cells). Speculative sampling draws 20k sequences through the real loop
(batches of independent rows) and a chi-square test at significance 1e-3 compares the two, for
each proposer and sampling setting. The same test run with a verifier that skips the residual
distribution fails, so it has the power to catch a broken implementation.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec.config import ModelConfig
from jaxspec.cpu import kernels as cpu_kernels
from jaxspec import models
from jaxspec.models import eagle3, llama, mtp
from jaxspec.sampling import SamplingParams, distribution, spec_for
from jaxspec.spec import loop, verify

SMALL = ModelConfig(vocab_size=12, dim=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
                    ffn_dim=48, rotary_dim=16, max_position_embeddings=64)
PROMPT = [1, 2, 3, 1, 2, 4, 5, 1, 2]  # repeats, so prompt lookup has something to propose
ROWS, SEEDS = 5000, 4  # 20k samples per setting
SIGNIFICANCE = 1e-3


@pytest.fixture(scope="module")
def target():
    return jaxspec.Model(config=SMALL, params=llama.init_params(SMALL, jax.random.PRNGKey(0), scale=0.5))


@pytest.fixture(scope="module")
def draft():
    cfg = dataclasses.replace(SMALL, num_layers=1)
    return jaxspec.Model(config=cfg, params=llama.init_params(cfg, jax.random.PRNGKey(1), scale=0.5))


_any_forward = jax.jit(models.forward, static_argnums=1)  # any trunk family; one jit, so its programs are shared


def exact_joint(model, settings, prompt=PROMPT) -> np.ndarray:
    """p(t1, t2, t3 | prompt) under the processed distribution, by enumeration: [V, V, V]."""
    V = model.config.vocab_size
    spec = spec_for(**settings)
    forward = _any_forward

    def next_probs(sequences):  # -> [N, V], each sequence's processed next-token distribution
        tokens = jnp.asarray(sequences, jnp.int32)
        logits, _, _ = forward(model.params, model.config, tokens, models.create_cache(model.config, len(sequences), 16))
        seen = np.zeros((len(sequences), V), bool)
        for i, sequence in enumerate(sequences):
            seen[i, sequence] = True
        params = SamplingParams.create(len(sequences), **settings)
        return np.asarray(distribution(logits[:, -1], params, spec, jnp.asarray(seen)), np.float64)

    p1 = next_probs([prompt])[0]
    p2 = next_probs([prompt + [a] for a in range(V)])  # [V, V]
    p3 = next_probs([prompt + [a, b] for a in range(V) for b in range(V)]).reshape(V, V, V)
    return p1[:, None, None] * p2[:, :, None] * p3


def sampled_joint(model, draft_model, settings, prompt=PROMPT, **method) -> tuple[np.ndarray, jaxspec.SpecStats]:
    V = model.config.vocab_size
    counts = np.zeros((V, V, V), np.int64)
    length = {} if "tree" in method else dict(num_draft_tokens=2)  # a tree drafts to its depth
    for seed in range(SEEDS):
        result = jaxspec.generate(model, draft_model, [prompt] * ROWS, max_new_tokens=3, ignore_eos=True,
                                  seed=seed, **length, **settings, **method)
        tokens = np.asarray(result.tokens)
        np.add.at(counts, (tokens[:, 0], tokens[:, 1], tokens[:, 2]), 1)
    return counts, result.stats


def chi_square_p_value(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's test; cells expecting fewer than 5 samples are pooled into one."""
    counts, probs = counts.ravel().astype(np.float64), probs.ravel()
    expected = probs * counts.sum()
    big = expected >= 5
    observed = np.append(counts[big], counts[~big].sum())
    expected = np.append(expected[big], expected[~big].sum())
    keep = expected > 0
    statistic = float(np.sum((observed[keep] - expected[keep]) ** 2 / expected[keep]))
    dof = int(keep.sum()) - 1
    return float(jax.scipy.special.gammaincc(dof / 2.0, statistic / 2.0))


def assert_lossless(target, draft_model, settings, **method):
    counts, stats = sampled_joint(target, draft_model, settings, **method)
    p_value = chi_square_p_value(counts, exact_joint(target, settings))
    assert p_value > SIGNIFICANCE, f"speculative samples differ from the target's distribution: p = {p_value:.2e}"
    assert stats.rounds > 0 and 0 <= stats.accepted <= stats.proposed
    return stats


CASES = [
    ("draft-sample-t1.0", dict(temperature=1.0), dict(method="draft")),
    ("draft-sample-t0.7-topk5", dict(temperature=0.7, top_k=5), dict(method="draft")),
    ("draft-argmax-t1.5-topp0.8", dict(temperature=1.5, top_p=0.8), dict(method="draft", draft_sampling="argmax")),
    ("draft-sample-t0.7-reppen1.3-topp0.9", dict(temperature=0.7, top_p=0.9, repetition_penalty=1.3),
     dict(method="draft")),
    ("layer-skip-sample-t1.0-minp0.1", dict(temperature=1.0, min_p=0.1), dict(method="layer_skip", exit_layer=1)),
    ("ngram-t1.0-reppen1.2", dict(temperature=1.0, repetition_penalty=1.2), dict(method="ngram")),
]


@pytest.mark.parametrize("name, settings, method", CASES, ids=[c[0] for c in CASES])
def test_speculative_sampling_matches_the_exact_distribution(target, draft, name, settings, method):
    draft_model = draft if method["method"] == "draft" else None
    stats = assert_lossless(target, draft_model, settings, **method)
    assert stats.accepted > 0  # drafts do get accepted: the acceptance path is exercised


# The same proof on the native CPU kernels (the product backend is data: the draft in AUTO follows
# its target onto it), int8 and q4 weights: one drafting method and one lookup each.
NATIVE_CASES = [("int8-draft-sample-t1.0", "int8", dict(temperature=1.0), dict(method="draft")),
                ("q4-ngram-t0.7-topk5", "q4", dict(temperature=0.7, top_k=5), dict(method="ngram"))]


@pytest.mark.skipif(not cpu_kernels.available(notice=False), reason="native CPU kernels unavailable")
@pytest.mark.parametrize("name, fmt, settings, method", NATIVE_CASES, ids=[c[0] for c in NATIVE_CASES])
def test_speculative_sampling_on_native_products_matches_the_exact_distribution(target, draft, name, fmt, settings,
                                                                                method):
    native = jaxspec.convert_weights(target, fmt, products="native")
    assert native.products.name.value == "native"
    draft_model = draft if method["method"] == "draft" else None
    stats = assert_lossless(native, draft_model, settings, **method)
    assert stats.accepted > 0


def small_eagle3_head(draft_vocab_size: int) -> jaxspec.Model:
    """An EAGLE-3 head for SMALL whose d2t maps its `draft_vocab_size` ids onto shuffled target
    ids (eagle3.init_params): all 12 (a permutation), or a reduced vocabulary."""
    cfg = eagle3.Eagle3Config(dim=SMALL.dim, num_heads=2, num_kv_heads=1, head_dim=16, ffn_dim=48,
                              draft_vocab_size=draft_vocab_size, vocab_size=SMALL.vocab_size, rope_theta=10000.0,
                              rotary_dim=16, norm_eps=1e-5, max_position_embeddings=64, aux_layer_ids=(0, 1, 1))
    return jaxspec.Model(config=cfg, params=eagle3.init_params(cfg, jax.random.PRNGKey(2), scale=0.5))


def small_mtp_head() -> jaxspec.Model:
    """An MTP head whose block is SMALL (it speaks the target's ids through the target's lm_head)."""
    cfg = mtp.MtpConfig(block=SMALL)
    return jaxspec.Model(config=cfg, params=mtp.init_params(cfg, jax.random.PRNGKey(3)))


HEADS = {
    # A permutation of the whole vocabulary: q must follow d2t even when the sizes agree.
    "eagle3-permuted-vocab": lambda: small_eagle3_head(SMALL.vocab_size),
    "mtp": small_mtp_head,
}


@pytest.mark.parametrize("head", sorted(HEADS))
def test_sampled_head_drafts_match_the_exact_distribution(target, head):
    settings = dict(temperature=1.0)
    stats = assert_lossless(target, HEADS[head](), settings, method=head.split("-")[0])
    assert stats.accepted > 0


def test_plain_sampling_matches_the_exact_distribution(target):
    """The reference itself: the plain loop samples the enumerated distribution."""
    assert_lossless(target, None, dict(temperature=1.0, top_k=6))


def test_rounds_where_no_row_drafts_sample_the_exact_distribution(target):
    """Prompt lookup restricted to 3-gram matches on a prompt without repeats finds nothing in any
    row, so every round takes the loop's T = 1 branch (no verify of nothing): still lossless."""
    distinct = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    settings = dict(temperature=0.7, top_p=0.9)
    counts, stats = sampled_joint(target, None, settings, prompt=distinct, method="ngram", ngram_min=3, ngram_max=3)
    p_value = chi_square_p_value(counts, exact_joint(target, settings, prompt=distinct))
    assert p_value > SIGNIFICANCE, f"abstaining rounds changed the distribution: p = {p_value:.2e}"
    assert stats.proposed == 0 and stats.rounds > 0


def _rejection_without_residual(pending, drafts, parents, num_proposed, draft_probs, target_probs, key, depth):
    """A classic bug: after a rejection, draw from p itself instead of the residual
    (norm(max(0, p - q)), or p without the rejected children)."""
    outcome = verify.rejection_sample(pending, drafts, parents, num_proposed, draft_probs, target_probs, key, depth)
    rows = jnp.arange(drafts.shape[0])
    stop_node = jnp.take_along_axis(outcome.path, outcome.accepted[:, None], axis=1)[:, 0]  # [B]: the path's end
    p = target_probs[rows, stop_node]  # [B, V]
    redrawn = jax.random.categorical(jax.random.fold_in(key, 7), jnp.log(p), axis=-1).astype(jnp.int32)
    return dataclasses.replace(outcome, committed=outcome.committed.at[rows, outcome.accepted].set(redrawn))


def assert_broken_run_detected(run, exact: np.ndarray) -> None:
    """`run()` -> counts, under a monkeypatched (broken) loop: traced into a fresh program, and
    not left behind for other tests; its samples must fail the chi-square test against `exact`."""
    jax.clear_caches()
    try:
        counts, _ = run()
    finally:
        jax.clear_caches()
    p_value = chi_square_p_value(counts, exact)
    assert p_value < SIGNIFICANCE, f"the broken implementation went undetected: p = {p_value:.2e}"


def test_a_verifier_that_skips_the_residual_fails_the_same_test(target, draft, monkeypatch):
    monkeypatch.setattr(loop, "rejection_sample", _rejection_without_residual)
    settings = dict(temperature=1.0)
    assert_broken_run_detected(lambda: sampled_joint(target, draft, settings, method="draft"),
                               exact_joint(target, settings))


@pytest.mark.parametrize("temperature", [0.7, 1.5])
def test_draft_equal_to_target_accepts_every_token(target, temperature):
    result = jaxspec.generate(target, target, [PROMPT] * 64, max_new_tokens=20, ignore_eos=True,
                              num_draft_tokens=3, temperature=temperature, seed=3)
    stats = result.stats
    assert stats.accepted == stats.proposed == 3 * stats.rounds
    # 19 decode tokens per row at k + 1 = 4 per round: 5 rounds, the last cut to 3 tokens by max_new.
    assert stats.decode_tokens == 64 * 19 and stats.rounds == 64 * 5


def test_greedy_with_repetition_penalty_is_exact_through_the_sampling_verifier(target, draft):
    """Temperature 0 + a repetition penalty verifies via point masses; output equals plain greedy."""
    kwargs = dict(max_new_tokens=24, ignore_eos=True, repetition_penalty=1.4)
    plain = jaxspec.generate(target, None, [PROMPT, PROMPT[:4]], **kwargs)
    for method in (dict(method="ngram"), dict(method="draft")):
        spec = jaxspec.generate(target, draft if method["method"] == "draft" else None, [PROMPT, PROMPT[:4]],
                                num_draft_tokens=3, **kwargs, **method)
        assert spec.tokens == plain.tokens
