"""`generate(..., logprobs=N)`: each committed token's log-prob under the target's final
distribution and its N best alternatives (jaxspec.spec.loop, jaxspec.api.TokenLogprob).

The numbers are checked against independent references: one fresh full forward per step (the
logits a plain decode step would see) processed in numpy (temperature, top-k, repetition
penalty), and `jaxspec.score` of the produced text at temperature 1. Speculative runs (chains,
trees, sampled) give the plain run's numbers within 1e-5.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

import jaxspec
from jaxspec import cli
from jaxspec.models import llama
from jaxspec.cache import KVCache
from tests.conftest import TINY, requires_default_model


PROMPTS = [
    [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7],
    [40, 41, 42, 40, 41, 42],
    [9, 8, 7, 6, 5, 4, 30, 31, 32, 33, 9],
]
NEW = 20
# Log-probs of the same token from a T = k + 1 verify and a T = 1 step differ by float32
# rounding of the logits (measured up to 1.1e-5 absolute on the default model, at |log p| ~ 5).
TOLERANCE = dict(rtol=1e-5, atol=1e-5)



@pytest.fixture(scope="module")
def draft_model():
    cfg = dataclasses.replace(TINY, num_layers=1, dim=32, num_heads=2, num_kv_heads=1, ffn_dim=48)
    return jaxspec.Model(config=cfg, params=llama.init_params(cfg, jax.random.PRNGKey(7), scale=0.2))


@pytest.fixture(scope="module")
def plain(tiny_model):
    return jaxspec.generate(tiny_model, None, PROMPTS, max_new_tokens=NEW, ignore_eos=True, logprobs=4)


_forward = jax.jit(llama.forward, static_argnums=1)
REFERENCE_LENGTH = 64  # one forward shape for every row: right padding never reaches earlier positions


def step_logits(model, prompt: list[int], generated: list[int]) -> np.ndarray:
    """[len(generated), V]: the logits each generated token was chosen from, from one fresh causal
    forward over prompt + generated (position len(prompt) - 1 + i produced generated[i])."""
    sequence = prompt + generated
    tokens = np.zeros((1, REFERENCE_LENGTH), np.int32)
    tokens[0, : len(sequence)] = sequence
    logits, _, _ = _forward(model.params, model.config, jax.numpy.asarray(tokens),
                            KVCache.create(model.config, 1, REFERENCE_LENGTH))
    return np.asarray(logits[0, len(prompt) - 1: len(sequence) - 1])


def _chosen(result, row) -> np.ndarray:
    return np.array([entry.logprob for entry in result.logprobs[row]])


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    top = x[np.isfinite(x)].max()
    return x - top - np.log(np.sum(np.exp(x - top)))


def test_plain_logprobs_are_the_models_log_softmax_with_sorted_alternatives(tiny_model, plain):
    for row, prompt in enumerate(PROMPTS):
        logits = step_logits(tiny_model, prompt, plain.tokens[row])
        assert len(plain.logprobs[row]) == len(plain.tokens[row]) == NEW
        for step, entry in enumerate(plain.logprobs[row]):
            reference = _log_softmax(logits[step])
            assert entry.token == plain.tokens[row][step]
            np.testing.assert_allclose(entry.logprob, reference[entry.token], rtol=1e-5, atol=1e-5)
            best = np.argsort(-reference)[:4]
            assert [token for token, _ in entry.top] == best.tolist()
            np.testing.assert_allclose([value for _, value in entry.top], reference[best], rtol=1e-5, atol=1e-5)
            assert entry.top[0][0] == entry.token  # greedy: the chosen token is the best


def test_logprobs_equal_score_of_the_same_text(tiny_model, plain):
    scored = jaxspec.score(tiny_model, [prompt + plain.tokens[row] for row, prompt in enumerate(PROMPTS)])
    for row, prompt in enumerate(PROMPTS):
        np.testing.assert_allclose(_chosen(plain, row), scored.logprobs[row][len(prompt) - 1:], **TOLERANCE)


@pytest.mark.parametrize("how", ["ngram", "draft", "layer_skip", "tree"])
def test_speculative_greedy_logprobs_equal_plain(tiny_model, draft_model, plain, how):
    kwargs = {"ngram": dict(method="ngram"), "draft": dict(draft_params=draft_model),
              "layer_skip": dict(method="layer_skip", exit_layer=1),
              "tree": dict(draft_params=draft_model, tree=(3, 2, 6))}[how]
    draft = kwargs.pop("draft_params", None)
    result = jaxspec.generate(tiny_model, draft, PROMPTS, max_new_tokens=NEW, ignore_eos=True, logprobs=4, **kwargs)
    assert result.tokens == plain.tokens
    for row in range(len(PROMPTS)):
        np.testing.assert_allclose(_chosen(result, row), _chosen(plain, row), **TOLERANCE)
        for ours, reference in zip(result.logprobs[row], plain.logprobs[row]):
            assert [t for t, _ in ours.top] == [t for t, _ in reference.top]
            np.testing.assert_allclose([v for _, v in ours.top], [v for _, v in reference.top], **TOLERANCE)


@pytest.mark.parametrize("method", ["plain", "draft"])
def test_sampled_logprobs_at_temperature_1_equal_score(tiny_model, draft_model, method):
    draft = draft_model if method == "draft" else None
    result = jaxspec.generate(tiny_model, draft, PROMPTS, max_new_tokens=NEW, ignore_eos=True, logprobs=0,
                              temperature=1.0, seed=5)
    scored = jaxspec.score(tiny_model, [prompt + result.tokens[row] for row, prompt in enumerate(PROMPTS)])
    for row, prompt in enumerate(PROMPTS):
        np.testing.assert_allclose(_chosen(result, row), scored.logprobs[row][len(prompt) - 1:], **TOLERANCE)
        assert all(entry.top == () for entry in result.logprobs[row])  # logprobs=0: the token's own only


def _processed(logits: np.ndarray, seen: set[int], temperature: float, top_k: int, penalty: float) -> np.ndarray:
    """HF's processing order, in numpy: repetition penalty, temperature, top-k, log-softmax."""
    logits = logits.astype(np.float64).copy()
    for token in seen:
        logits[token] = logits[token] / penalty if logits[token] > 0 else logits[token] * penalty
    logits /= temperature
    threshold = np.sort(logits)[-top_k]
    return _log_softmax(np.where(logits >= threshold, logits, -np.inf))


@pytest.mark.parametrize("method", ["plain", "ngram"])
def test_logprobs_follow_the_processors(tiny_model, method):
    """Under temperature, top-k and a repetition penalty, each token's log-prob is that of the
    processed distribution it was drawn from (filtered tokens at -inf), per row's own context."""
    settings = dict(temperature=0.7, top_k=5, repetition_penalty=1.3)
    result = jaxspec.generate(tiny_model, None, PROMPTS, max_new_tokens=12, ignore_eos=True, logprobs=6, seed=2,
                              method=method, **settings)
    for row, prompt in enumerate(PROMPTS):
        logits = step_logits(tiny_model, prompt, result.tokens[row])
        for step, entry in enumerate(result.logprobs[row]):
            seen = set(prompt) | set(result.tokens[row][:step])
            reference = _processed(logits[step], seen, settings["temperature"], settings["top_k"],
                                   settings["repetition_penalty"])
            np.testing.assert_allclose(entry.logprob, reference[entry.token], rtol=1e-4, atol=1e-5)
            # Five tokens survive top-k; the sixth alternative is filtered out.
            assert np.isfinite([v for _, v in entry.top[:5]]).all() and entry.top[5][1] == -np.inf


def test_stream_reports_the_same_logprobs(tiny_model, plain):
    stream = jaxspec.stream(tiny_model, None, PROMPTS[0], max_new_tokens=NEW, ignore_eos=True, logprobs=4,
                            method="ngram")
    assert list(stream) == plain.tokens[0]
    np.testing.assert_allclose(_chosen(stream.result, 0), _chosen(plain, 0), **TOLERANCE)


def test_no_logprobs_unless_asked(tiny_model):
    assert jaxspec.generate(tiny_model, None, PROMPTS[0], max_new_tokens=3).logprobs is None


@pytest.mark.parametrize("value", [-1, 21, 2.5, "3", True])
def test_bad_logprobs_are_refused_by_name(value):
    with pytest.raises(jaxspec.InvalidRequestError, match="logprobs must be an integer in \\[0, 20\\]"):
        jaxspec.GenerateOptions(logprobs=value)


def test_cli_prints_logprobs_and_refuses_bad_ones(capsys):
    assert cli.main(["generate", "hi", "--logprobs", "99"]) == 2
    assert "--logprobs must be an integer" in capsys.readouterr().err


@requires_default_model
@pytest.mark.real_model
def test_default_model_logprobs_speculative_equal_plain_and_score():
    model = jaxspec.load()
    prompt = "Write a haiku about the sea."
    runs = {method: jaxspec.generate(model, draft, prompt, chat=True, max_new_tokens=32, logprobs=2, ignore_eos=True,
                                     **({"method": method} if draft is None else {}))
            for method, draft in (("plain", None), ("ngram", None), ("eagle3", jaxspec.load("eagle3-smollm2-135m")))}
    ids = model.tokenizer.encode_chat(prompt)
    scored = jaxspec.score(model, [ids + runs["plain"].tokens[0]]).logprobs[0][len(ids) - 1:]
    np.testing.assert_allclose(_chosen(runs["plain"], 0), scored, **TOLERANCE)
    for method in ("ngram", "eagle3"):
        assert runs[method].tokens == runs["plain"].tokens
        np.testing.assert_allclose(_chosen(runs[method], 0), _chosen(runs["plain"], 0), **TOLERANCE)
