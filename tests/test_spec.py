"""Speculative greedy decoding is exact: every proposer, several k, ragged batches, stops.

Small random models (compiles stay cheap); the reference is the plain loop (k = 0), itself
checked against full recomputation in test_loop.py.
"""

from __future__ import annotations

import dataclasses

import jax
import pytest

import jaxspec
from jaxspec.models import llama
from tests.conftest import TINY, assert_plain_greedy

# Prompts with repeats, so prompt lookup finds matches; ragged lengths 13, 6 and 21.
PROMPTS = [
    [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7],
    [40, 41, 42, 40, 41, 42],
    [9, 8, 7, 6, 5, 4, 30, 31, 32, 33, 9, 8, 7, 6, 5, 4, 30, 31, 32, 33, 9],
]


@pytest.fixture(scope="module")
def draft_model(tiny_model):
    """An unrelated smaller model of the same vocabulary: low but nonzero acceptance."""
    cfg = dataclasses.replace(TINY, num_layers=1, dim=32, num_heads=2, num_kv_heads=1, ffn_dim=48)
    return jaxspec.Model(config=cfg, params=llama.init_params(cfg, jax.random.PRNGKey(7), scale=0.2))


def _plain(model, prompts, max_new, **kwargs):
    return jaxspec.generate(model, None, prompts, max_new_tokens=max_new, **kwargs)


def _method_kwargs(method, model, draft_model):
    if method == "draft":
        return dict(draft_params=draft_model)
    if method == "layer_skip":
        return dict(method="layer_skip", exit_layer=1)
    return dict(method="ngram")


@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("method", ["ngram", "draft", "layer_skip"])
def test_ragged_batch_matches_plain_greedy(tiny_model, draft_model, method, k):
    reference = _plain(tiny_model, PROMPTS, 30, ignore_eos=True)
    result = jaxspec.generate(tiny_model, prompt=PROMPTS, max_new_tokens=30, ignore_eos=True,
                              num_draft_tokens=k, **_method_kwargs(method, tiny_model, draft_model))
    assert_plain_greedy(tiny_model, PROMPTS, result, reference)
    stats = result.stats
    assert stats.method == method and stats.num_draft_tokens == k
    assert 0 <= stats.accepted <= stats.proposed <= k * stats.rounds
    # Every round commits accepted + 1 tokens, except a last round cut short by max_new_tokens.
    assert stats.rounds + stats.accepted - k * stats.rows <= stats.decode_tokens <= stats.rounds + stats.accepted


@pytest.mark.parametrize("method", ["ngram", "draft", "layer_skip"])
def test_batch_of_one_matches_plain_greedy(tiny_model, draft_model, method):
    for prompt in (PROMPTS[0], PROMPTS[2]):
        reference = _plain(tiny_model, prompt, 25, ignore_eos=True)
        result = jaxspec.generate(tiny_model, prompt=prompt, max_new_tokens=25, ignore_eos=True,
                                  num_draft_tokens=4, **_method_kwargs(method, tiny_model, draft_model))
        assert_plain_greedy(tiny_model, [prompt], result, reference)


def test_draft_identical_to_target_accepts_everything(tiny_model):
    k = 4
    result = jaxspec.generate(tiny_model, tiny_model, PROMPTS, max_new_tokens=31, ignore_eos=True,
                              num_draft_tokens=k)
    reference = _plain(tiny_model, PROMPTS, 31, ignore_eos=True)
    assert result.tokens == reference.tokens
    stats = result.stats
    assert stats.accepted == stats.proposed == k * stats.rounds
    assert stats.acceptance_by_position == (1.0,) * k
    # 30 decode tokens per row at k + 1 = 5 per round: exactly 6 rounds each, tau = k + 1.
    assert stats.rounds == 6 * 3 and stats.tau == k + 1
    assert stats.target_forwards == 6


def test_random_draft_is_still_exact_with_low_acceptance(tiny_model, draft_model):
    result = jaxspec.generate(tiny_model, draft_model, PROMPTS, max_new_tokens=30, ignore_eos=True,
                              num_draft_tokens=4)
    reference = _plain(tiny_model, PROMPTS, 30, ignore_eos=True)
    assert_plain_greedy(tiny_model, PROMPTS, result, reference)
    assert result.stats.acceptance_rate < 0.5
    assert result.stats.tau < 2.5


def test_stream_works_with_every_method(tiny_model, draft_model):
    reference = _plain(tiny_model, PROMPTS[0], 20, ignore_eos=True).tokens[0]
    for method in ("ngram", "draft", "layer_skip"):
        stream = jaxspec.stream(tiny_model, prompt=PROMPTS[0], max_new_tokens=20, ignore_eos=True, num_draft_tokens=3,
                                **_method_kwargs(method, tiny_model, draft_model))
        assert list(stream) == reference == stream.result.tokens[0]
        assert stream.result.stats.method == method
