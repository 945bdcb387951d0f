"""Gated DeltaNet: the recurrent form (the reference) by hand and against transformers, the
chunked form against the recurrent one, and the helpers the hybrid cache commits with."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.models import gated_deltanet
from jaxspec.models.gated_deltanet import chunk_end_state, chunked_delta_rule, conv_windows, heads_first, recurrent_delta_rule
from tests.conftest import max_relative_error


def _delta_inputs(batch=2, steps=37, heads=3, dk=4, dv=5, seed=0):
    """query (unit, scaled by dk^-1/2), key (unit) [B, T, E, X]; value [B, T, E, Y]; log decay in
    (-0.3, 0] and beta in (0, 1) [B, T, E]; a start state [B, E, X, Y]."""
    rng = np.random.RandomState(seed)

    def unit(x):
        return x / np.sqrt((x * x).sum(-1, keepdims=True))

    arrays = (unit(rng.randn(batch, steps, heads, dk)) * dk ** -0.5, unit(rng.randn(batch, steps, heads, dk)),
              rng.randn(batch, steps, heads, dv), -rng.rand(batch, steps, heads) * 0.3,
              rng.rand(batch, steps, heads), rng.randn(batch, heads, dk, dv))
    return [jnp.asarray(a, jnp.float32) for a in arrays]


def test_recurrent_step_by_hand():
    """One head, dk = dv = 1: S' = S e^g + beta k (v - S e^g k), o = S' q."""
    q, k, v, g, beta, s = (jnp.full((1, 1, 1, 1), 0.5), jnp.full((1, 1, 1, 1), 1.0), jnp.full((1, 1, 1, 1), 3.0),
                           jnp.full((1, 1, 1), np.log(0.5)), jnp.full((1, 1, 1), 0.25), jnp.full((1, 1, 1, 1), 2.0))
    out, states = recurrent_delta_rule(q, k, v, g, beta, s)
    # decayed S = 1; memory = 1; delta = 0.25 * (3 - 1) = 0.5; S' = 1.5; o = 0.75
    np.testing.assert_allclose(states[0, 0, 0], [[1.5]], rtol=1e-6)
    np.testing.assert_allclose(out[0, 0, 0], [0.75], rtol=1e-6)


@pytest.mark.parametrize("steps", [2, 9])  # the unrolled short path and the scan
def test_recurrent_form_matches_transformers(steps):
    """Against transformers' `torch_recurrent_gated_delta_rule` (which scales q by dk^-1/2 itself)."""
    import torch
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

    q, k, v, g, beta, s = _delta_inputs(steps=steps)
    out, states = jax.jit(recurrent_delta_rule)(q, k, v, g, beta, s)
    chex.assert_shape(out, (2, steps, 3, 5))
    chex.assert_shape(states, (2, steps, 3, 4, 5))
    unscaled_q = np.asarray(q) * q.shape[-1] ** 0.5
    reference_out, reference_state = torch_recurrent_gated_delta_rule(
        *(torch.tensor(np.asarray(x)) for x in (unscaled_q, k, v, g, beta)),
        initial_state=torch.tensor(np.asarray(s)), output_final_state=True)
    assert max_relative_error(out, reference_out.numpy()) < 1e-5
    assert max_relative_error(states[:, -1], reference_state.numpy()) < 1e-5


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_chunked_form_equals_recurrent_form(chunk_size):
    q, k, v, g, beta, s = _delta_inputs()
    out, states = jax.jit(recurrent_delta_rule)(q, k, v, g, beta, s)
    chunk_out, starts, final = jax.jit(chunked_delta_rule, static_argnames="chunk_size")(
        q, k, v, g, beta, s, chunk_size=chunk_size)
    size = min(chunk_size, q.shape[1])
    chex.assert_shape(starts, (2, -(-37 // size), 3, 4, 5))
    chex.assert_trees_all_close(chunk_out, out, atol=2e-5, rtol=1e-4)
    chex.assert_trees_all_close(final, states[:, -1], atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(starts[:, 0], s)
    for c in range(1, starts.shape[1]):  # chunk c starts from the state after c * size tokens
        np.testing.assert_allclose(starts[:, c], states[:, c * size - 1], atol=2e-5, rtol=1e-4)


def test_chunked_form_matches_transformers():
    """Against transformers' own chunked form, `torch_chunk_gated_delta_rule`, at its chunk of 64."""
    import torch
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    q, k, v, g, beta, s = _delta_inputs(steps=80, seed=1)
    out, _, final = jax.jit(chunked_delta_rule)(q, k, v, g, beta, s)
    unscaled_q = np.asarray(q) * q.shape[-1] ** 0.5
    reference_out, reference_state = torch_chunk_gated_delta_rule(
        *(torch.tensor(np.asarray(x)) for x in (unscaled_q, k, v, g, beta)),
        initial_state=torch.tensor(np.asarray(s)), output_final_state=True)
    assert max_relative_error(out, reference_out.numpy()) < 1e-4
    assert max_relative_error(final, reference_state.numpy()) < 1e-4


def test_chunk_end_state_stops_at_identity_updates():
    """Positions made identity updates (decay 0, beta 0) leave the state alone: a chunk cut after
    its 5th position ends in the recurrent state after 5 positions (how a commit selects one)."""
    q, k, v, g, beta, s = _delta_inputs(steps=8, seed=2)
    _, states = recurrent_delta_rule(q, k, v, g, beta, s)
    kept = jnp.arange(8)[None, :, None] < 5  # [1, T, 1]
    state = chunk_end_state(s, heads_first(k), heads_first(v), heads_first(jnp.where(kept, g, 0.0)),
                            heads_first(jnp.where(kept, beta, 0.0)))
    chex.assert_trees_all_close(state, states[:, 4], atol=2e-5, rtol=1e-4)


def test_unit_lower_inverse_is_a_triangular_solve():
    rng = np.random.RandomState(3)
    for size in (1, 2, 7, 64):
        lower = np.tril(rng.randn(3, size, size) * 0.5, -1).astype(np.float32)
        expected = np.linalg.inv(np.eye(size) + lower.astype(np.float64))
        assert max_relative_error(jax.jit(gated_deltanet.unit_lower_inverse)(jnp.asarray(lower)), expected) < 1e-5


def test_conv_windows_by_hand():
    """W - 1 = 2, one channel: window [1, 2], new inputs [3, 4, 5]; after n inputs the window is
    the last two of [1, 2, 3, 4, 5][: 2 + n]."""
    window = jnp.asarray([[[1.0], [2.0]]])  # [B=1, W-1=2, C=1]
    inputs = jnp.asarray([[[3.0], [4.0], [5.0]]])  # [B, T=3, C]
    windows = conv_windows(window, inputs, jnp.asarray([[0, 1, 3]]))  # [B, M=3, W-1, C]
    chex.assert_shape(windows, (1, 3, 2, 1))
    np.testing.assert_array_equal(windows[0, :, :, 0], [[1, 2], [2, 3], [4, 5]])
