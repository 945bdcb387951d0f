"""The generation loop and API on a tiny random model: batching, stops, seeds, streaming, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec.cache import KVCache
from jaxspec.models import llama
from tests.conftest import TINY

PROMPTS = [[5, 6, 7, 8, 9], [1, 2], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]
forward = jax.jit(llama.forward, static_argnums=1)


def _greedy_by_recompute(params, prompt, steps):
    """Reference greedy: rerun the whole sequence every step from an empty cache, no cache reuse.

    The sequence is right-padded to one length (causal attention never reads the padding), so
    this compiles once, not once per length.
    """
    seq = list(prompt)
    width = len(prompt) + steps
    for _ in range(steps):
        padded = jnp.asarray([seq + [0] * (width - len(seq))])
        logits, _, _ = forward(params, TINY, padded, KVCache.create(TINY, 1, 64),
                               logit_indices=jnp.array([[len(seq) - 1]]))
        seq.append(int(jnp.argmax(logits[0, -1])))
    return seq[len(prompt):]


def test_greedy_matches_full_recompute(tiny_model):
    result = jaxspec.generate(tiny_model, None, PROMPTS[0], max_new_tokens=24, ignore_eos=True)
    assert result.tokens[0] == _greedy_by_recompute(tiny_model.params, PROMPTS[0], 24)
    assert result.finish_reason == ["length"]
    assert result.stats.new_tokens == 24 and result.stats.target_forwards == 23


def test_batch_rows_equal_each_prompt_alone(tiny_model):
    batch = jaxspec.generate(tiny_model, None, PROMPTS, max_new_tokens=20, ignore_eos=True)
    for row, prompt in enumerate(PROMPTS):
        alone = jaxspec.generate(tiny_model, None, prompt, max_new_tokens=20, ignore_eos=True)
        assert batch.tokens[row] == alone.tokens[0]


def test_same_seed_same_sample(tiny_model):
    kwargs = dict(max_new_tokens=16, temperature=1.0, top_k=30, top_p=0.9, ignore_eos=True)
    first = jaxspec.generate(tiny_model, None, PROMPTS, seed=7, **kwargs)
    again = jaxspec.generate(tiny_model, None, PROMPTS, seed=7, **kwargs)
    other = jaxspec.generate(tiny_model, None, PROMPTS, seed=8, **kwargs)
    assert first.tokens == again.tokens
    assert first.tokens != other.tokens


def test_eos_stops_a_row_and_keeps_the_eos(tiny_model):
    free = jaxspec.generate(tiny_model, None, PROMPTS[1], max_new_tokens=20, ignore_eos=True).tokens[0]
    stop_token = free[5]
    first_hit = free.index(stop_token)
    result = jaxspec.generate(tiny_model, None, PROMPTS[1], max_new_tokens=20, stop_token_ids=[stop_token],
                              ignore_eos=True)
    assert result.tokens[0] == free[: first_hit + 1]
    assert result.finish_reason == ["stop"]


def test_multi_token_stop_sequence_on_device(tiny_model):
    free = jaxspec.generate(tiny_model, None, PROMPTS[0], max_new_tokens=20, ignore_eos=True).tokens[0]
    sequence = tuple(free[6:9])
    spec_result = jaxspec.generate(tiny_model, None, PROMPTS[0], max_new_tokens=20, ignore_eos=True)
    prepared = jaxspec.api._prepare(
        tiny_model, PROMPTS[0], max_new_tokens=20, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0,
        repetition_penalty=1.0, seed=0, chat=False, stop=None, stop_token_ids=None, ignore_eos=True)
    spec = jaxspec.api.dataclasses.replace(prepared.spec, stop_sequences=(sequence,))
    state = jaxspec.spec.loop.run_jit(tiny_model.params, None, prepared.request, spec=spec)
    end = next(i for i in range(2, 20) if tuple(free[i - 2:i + 1]) == sequence)
    assert jaxspec.api._generated(state, 1)[0] == spec_result.tokens[0][: end + 1]
    assert int(state.finish_reason[0]) == jaxspec.spec.loop.FINISH_STOP


def test_rows_finish_independently(tiny_model):
    free = jaxspec.generate(tiny_model, None, PROMPTS, max_new_tokens=12, ignore_eos=True).tokens
    stop_token = free[0][2]
    result = jaxspec.generate(tiny_model, None, PROMPTS, max_new_tokens=12, stop_token_ids=[stop_token],
                              ignore_eos=True)
    for row in range(3):
        expected = free[row][: free[row].index(stop_token) + 1] if stop_token in free[row] else free[row]
        assert result.tokens[row] == expected
    assert result.finish_reason[0] == "stop"


def test_stream_yields_the_same_tokens(tiny_model):
    stream = jaxspec.stream(tiny_model, PROMPTS[2], max_new_tokens=10, ignore_eos=True)
    streamed = list(stream)
    whole = jaxspec.generate(tiny_model, None, PROMPTS[2], max_new_tokens=10, ignore_eos=True)
    assert streamed == whole.tokens[0] == stream.result.tokens[0]
    assert stream.result.stats.target_forwards == 9


def test_new_prompt_lengths_in_one_bucket_do_not_recompile(tiny_model):
    jaxspec.generate(tiny_model, None, [1, 2, 3], max_new_tokens=8)
    again = jaxspec.generate(tiny_model, None, [4, 5, 6, 7, 8, 9], max_new_tokens=8)
    assert again.stats.compile_seconds == 0.0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(prompt=[]), "non-empty"),
        (dict(prompt=[[1, 2], []]), "prompt 1 is empty"),
        (dict(prompt=[1, 128]), "token id 128 outside the vocabulary"),
        (dict(prompt=[1, -1]), "token id -1"),
        (dict(prompt="text"), "no tokenizer"),
        (dict(prompt=[1], max_new_tokens=0), "max_new_tokens"),
        (dict(prompt=[1, 2], max_new_tokens=255), "exceeds the model's context of 256"),
        (dict(prompt=[1], temperature=-0.5), "temperature must be >= 0"),
        (dict(prompt=[1], top_p=0.0), "top_p must be in (0, 1]"),
        (dict(prompt=[1], top_p=1.5), "top_p must be in (0, 1]"),
        (dict(prompt=[1], top_k=-2), "top_k"),
        (dict(prompt=[1], min_p=2.0), "min_p"),
        (dict(prompt=[1], repetition_penalty=0.0), "repetition_penalty"),
        (dict(prompt=[1], stop_token_ids=[999]), "stop token id 999"),
    ],
)
def test_bad_requests_fail_before_jit_with_a_clear_message(tiny_model, kwargs, message):
    with pytest.raises(jaxspec.InvalidRequestError, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        jaxspec.generate(tiny_model, None, **kwargs)
