"""The hybrid cache (jaxspec.models.hybrid_cache) through the Qwen3.5 forward: a verify forward
then a commit selects each row's own state, a ragged chunked prefill commits each row's own
state, and the ring rolls back up to rollback_states - 1 positions and refuses further.

Each committed state is checked by the logits of the token after it, against transformers'
`qwen3_5` over the committed sequence, on one of test_qwen35's small random checkpoints (written
the same way with the same seed, so the jitted programs are shared with that module).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec.cache import StateRollbackError
from jaxspec.checkpoints import load_checkpoint
from jaxspec.models.gated_deltanet import DeltaRule
from jaxspec.models.hybrid_cache import ChunkedSteps, Qwen35Cache, RecordedSteps
from tests.conftest import max_relative_error
from tests.test_qwen35 import forward, hf_logits, prefill, step_fn, write_hf

CACHE_CASE = "attention-first-untied-rope0.5"  # test_qwen35's case with attention first, then DeltaNet


@jax.jit
def _commit(cache, target):
    return cache.set_length(target)


@pytest.fixture(scope="module")
def hf_case(tmp_path_factory):
    directory = tmp_path_factory.mktemp(CACHE_CASE)
    hf_model = write_hf(directory, CACHE_CASE, seed=len(CACHE_CASE))
    ckpt = load_checkpoint(directory)
    return hf_model, jaxspec.Model(config=ckpt.config, params=ckpt.params)


def test_verify_forward_then_advance_selects_each_rows_state(hf_case):
    """After a prefill, a T = 5 forward, then advance by n per row (0, 2, 5 ...): the next step's
    logits equal HF's on the committed sequence, so each row kept exactly its state after n."""
    hf_model, model = hf_case
    cfg = model.config
    sequence = np.random.RandomState(4).randint(0, cfg.vocab_size, (2, 80))
    full = hf_logits(hf_model, sequence)
    prefix = 12
    cache = Qwen35Cache.create(cfg, 2, 96)
    _, _, cache = prefill(model, sequence, cache)
    cache = _commit(cache, jnp.full((2,), prefix, jnp.int32))
    verify_logits, _, verified = forward(model.params, cfg, jnp.asarray(sequence[:, prefix:prefix + 5], jnp.int32), cache)
    assert max_relative_error(verify_logits, full[:, prefix:prefix + 5]) <= 1e-4
    assert isinstance(verified.pending, RecordedSteps)
    for accepted in ([0, 5], [2, 3], [5, 1]):
        lengths = prefix + np.asarray(accepted)
        committed = _commit(verified, jnp.asarray(lengths, jnp.int32))  # = verified.advance(accepted)
        assert committed.pending is None
        # The token after the committed ones, run from the selected state, for every row.
        next_tokens = sequence[np.arange(2), lengths][:, None]
        logits, _, _ = forward(model.params, cfg, jnp.asarray(next_tokens, jnp.int32), committed)
        assert max_relative_error(logits[:, 0], full[np.arange(2), lengths]) <= 1e-4, accepted
    # The chunked record (recorded_steps=0): start state + per-position inputs, the commit
    # recomputing the selected state; the same numbers.
    _, _, chunked = forward(model.params, cfg, jnp.asarray(sequence[:, prefix:prefix + 5], jnp.int32), cache,
                            delta_rule=DeltaRule.CHUNKED)
    assert isinstance(chunked.pending, ChunkedSteps)
    lengths = prefix + np.asarray([3, 1])
    committed = _commit(chunked, jnp.asarray(lengths, jnp.int32))
    logits, _, _ = forward(model.params, cfg, jnp.asarray(sequence[np.arange(2), lengths][:, None], jnp.int32), committed)
    assert max_relative_error(logits[:, 0], full[np.arange(2), lengths]) <= 1e-4
    # A commit the cache cannot serve, inside a jitted program: that row's state turns to NaN.
    bad = _commit(verified, jnp.asarray([prefix - 1, prefix + 2], jnp.int32))
    logits, _, _ = forward(model.params, cfg, jnp.asarray(sequence[:, :1], jnp.int32), bad)
    assert np.isnan(logits[0]).all() and np.isfinite(logits[1]).all()


def test_ragged_chunked_prefill_commits_each_rows_own_state(hf_case):
    """Right-padded prompts of 80 and 37 tokens in one chunked forward; after set_length each row
    continues as if it had run alone (padding never reaches its state)."""
    hf_model, model = hf_case
    cfg = model.config
    rng = np.random.RandomState(5)
    tokens = rng.randint(0, cfg.vocab_size, (2, 80))
    lengths = np.array([80, 37])
    cache = Qwen35Cache.create(cfg, 2, 96)
    _, _, cache = prefill(model, tokens, cache)
    assert isinstance(cache.pending, ChunkedSteps)
    cache = _commit(cache, jnp.asarray(lengths, jnp.int32))
    following = rng.randint(0, cfg.vocab_size, (2,))
    logits, _, _ = forward(model.params, cfg, jnp.asarray(following[:, None], jnp.int32), cache)
    for row in range(2):
        sequence = list(tokens[row, :lengths[row]]) + [following[row]]
        expected = hf_logits(hf_model, [sequence])[0, -1]
        assert max_relative_error(logits[row, 0], expected) <= 1e-4


def test_rollback_within_the_ring_restores_the_state(hf_case):
    _, model = hf_case
    cfg = model.config
    step = step_fn(cfg)
    tokens = np.random.RandomState(6).randint(0, cfg.vocab_size, (20,))
    cache = Qwen35Cache.create(cfg, 1, 64)
    seen = []
    for token in tokens:
        logits, cache = step(model.params, cache, jnp.asarray([token], jnp.int32))
        seen.append(np.asarray(logits[0]))
    for back in range(1, cfg.rollback_states):  # up to R - 1 positions back, no forward between
        rolled = cache.set_length(cache.length - back)
        position = len(tokens) - back
        logits, _ = step(model.params, rolled, jnp.asarray([tokens[position]], jnp.int32))
        np.testing.assert_allclose(logits[0], seen[position], rtol=1e-5, atol=1e-5)


def test_rollback_past_the_ring_raises(hf_case):
    _, model = hf_case
    cfg = dataclasses.replace(model.config, rollback_states=3)
    step = step_fn(cfg)
    cache = Qwen35Cache.create(cfg, 2, 32)
    for token in range(6):
        _, cache = step(model.params, cache, jnp.asarray([token, token], jnp.int32))
    cache.set_length(cache.length - 2)  # R - 1 back: fine
    with pytest.raises(StateRollbackError, match="rollback_states=3"):
        cache.set_length(jnp.asarray([6, 3], jnp.int32))
    with pytest.raises(StateRollbackError, match="length 7"):
        cache.set_length(cache.length + 1)  # forward with no forward pass: the state is unknown
    # Inside a jitted program the same check runs (only a failing program calls back to the host).
    with pytest.raises(Exception, match="rollback_states=3"):
        jax.block_until_ready(_commit(cache, jnp.asarray([6, 2], jnp.int32)).length)
    np.testing.assert_array_equal(_commit(cache, jnp.asarray([6, 4], jnp.int32)).length, [6, 4])
