"""The native decode / verify attention kernel (jaxspec/cpu/attention.cc) against its float64
numpy reference on every instruction-set path, its one guarantee that speculation's exactness
rests on (a query's bits depend only on the slots it sees), and its place in `attend`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.cpu import kernels, reference
from jaxspec.errors import InvalidRequestError
from jaxspec.pallas import flash_decode, kv_quant
from jaxspec.pallas.flash_decode import TreeMask

pytestmark = pytest.mark.skipif(not kernels.available(notice=False),
                                reason=f"native CPU kernels unavailable: {kernels.unavailable_reason()}")

TOLERANCE = 2e-6  # of the output's largest magnitude: float32 rounding against float64


def _operands(batch, steps, kv_heads, group, head_dim, capacity, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, steps, kv_heads, group, head_dim)).astype(np.float32)
    keys = rng.standard_normal((batch, kv_heads, capacity, head_dim)).astype(np.float32)
    values = rng.standard_normal((batch, kv_heads, capacity, head_dim)).astype(np.float32)
    return q, keys, values


def _causal(batch, steps):
    return np.broadcast_to(np.tril(np.ones((steps, steps), bool)), (batch, steps, steps))


def _call(q, keys, values, start, visible, scale=0.125, **kwargs):
    return np.asarray(jax.jit(lambda *a: kernels.attention(*a, scale=scale, **kwargs))(
        q, keys, values, np.asarray(start, np.int32), visible))


# (B, T, K, G, H, S): head dims off the vector widths (40, 72), a step, a verify, a tree's worth.
SHAPES = [(1, 1, 3, 3, 64, 256), (2, 5, 3, 3, 64, 40), (3, 7, 2, 4, 40, 33), (1, 17, 1, 2, 72, 64)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_every_path_matches_the_reference_under_causal_and_tree_masks(shape):
    batch, steps, kv_heads, group, head_dim, capacity = shape
    q, keys, values = _operands(*shape)
    rng = np.random.default_rng(1)
    starts = rng.integers(0, capacity - steps + 1, batch)
    tree = rng.random((batch, steps, steps + 3)) < 0.5  # any pattern, wider than T
    tree[:, :, 0] = True
    for visible in (_causal(batch, steps), tree):
        expected = reference.attention(q, keys, values, starts, visible, 0.125)
        for isa in kernels.supported_isas():
            for threads in (1, 0):
                out = _call(q, keys, values, starts, visible, isa=isa, threads=threads)
                error = np.abs(out - expected).max() / np.abs(expected).max()
                assert error < TOLERANCE, (isa, threads, error)


def test_starts_at_and_past_the_ends_and_a_query_that_sees_nothing():
    q, keys, values = _operands(3, 2, 1, 2, 16, 8)
    starts = np.array([0, 8, 20])  # nothing before; the whole cache before; past the capacity
    visible = np.zeros((3, 2, 2), bool)
    visible[:, 1, 1] = True  # token 0 sees only what lies before start; token 1 one window slot
    expected = reference.attention(q, keys, values, starts, visible, 0.25)
    for isa in kernels.supported_isas():
        out = _call(q, keys, values, starts, visible, scale=0.25, isa=isa)
        np.testing.assert_allclose(out, expected, rtol=0, atol=2e-6)
        assert not out[0, 0].any()  # row 0, token 0: no slot at all -> zeros, not NaN


def test_a_query_s_bits_depend_only_on_the_slots_it_sees():
    """The step / verify / tree identity speculation's greedy exactness needs, on every path:
    - a verify's token t equals a 1-token step at length + t (the causal window);
    - a row's result does not depend on the other rows, nor on the thread count;
    - a tree node whose ancestors sit at scattered window slots equals the same query after the
      accepted path is moved to contiguous slots (KVCache.commit_path), read causally."""
    batch, steps, kv_heads, group, head_dim, capacity = 2, 9, 3, 3, 64, 600
    q, keys, values = _operands(batch, steps, kv_heads, group, head_dim, capacity)
    starts = np.array([17, 500])
    for isa in kernels.supported_isas():
        verify = _call(q, keys, values, starts, _causal(batch, steps), isa=isa, threads=0)  # threaded: big enough
        for t in range(steps):
            step = _call(q[:, t:t + 1], keys, values, starts + t, np.ones((batch, 1, 1), bool), isa=isa, threads=1)
            assert np.array_equal(step, verify[:, t:t + 1]), (isa, t)
        alone = _call(q[1:], keys[1:], values[1:], starts[1:], _causal(1, steps), isa=isa)
        assert np.array_equal(alone, verify[1:]), isa

        # Tree: node 5's path is window slots 0, 2, 5 (root, a child, node 5); the rest are siblings.
        tree = np.zeros((batch, steps, steps), bool)
        tree[:, 5, [0, 2, 5]] = True
        scattered = _call(q, keys, values, starts, tree, isa=isa)[:, 5]
        moved_keys, moved_values = keys.copy(), values.copy()
        for b, start in enumerate(starts):
            for depth, node in enumerate([0, 2, 5]):
                moved_keys[b, :, start + depth] = keys[b, :, start + node]
                moved_values[b, :, start + depth] = values[b, :, start + node]
        step = _call(q[:, 5:6], moved_keys, moved_values, starts + 2, np.ones((batch, 1, 1), bool), isa=isa)
        assert np.array_equal(step[:, 0], scattered), isa


def test_bad_operands_are_refused_by_name():
    q, keys, values = _operands(1, 2, 2, 2, 8, 4)
    visible = _causal(1, 2)
    with pytest.raises(InvalidRequestError, match=r"attention: q must be float32 \[B, T, K, G, H\]"):
        kernels.attention(q[0], keys, values, np.zeros(1, np.int32), visible, scale=1.0)
    with pytest.raises(InvalidRequestError, match=r"attention: keys must be float32 \[B=1, K=2, S, H=8\]"):
        kernels.attention(q, keys[:, :1], values, np.zeros(1, np.int32), visible, scale=1.0)
    with pytest.raises(InvalidRequestError, match="attention: keys .* and values .* differ"):
        kernels.attention(q, keys, values[:, :, :3], np.zeros(1, np.int32), visible, scale=1.0)
    with pytest.raises(InvalidRequestError, match=r"start must be \[B=1\] and visible \[B=1, T=2, M\]"):
        kernels.attention(q, keys, values, np.zeros(2, np.int32), visible, scale=1.0)


def test_attend_takes_the_kernel_for_float32_caches_and_the_reference_otherwise():
    batch, steps, kv_heads, group, head_dim, capacity = 2, 4, 2, 2, 32, 48
    q, keys, values = _operands(batch, steps, kv_heads, group, head_dim, capacity)
    lengths = jnp.array([3, 40])
    native = flash_decode.attend(q, keys, values, lengths, attention="native")
    expected = flash_decode.flash_decode_reference(q, keys, values, lengths)
    np.testing.assert_allclose(native, expected, rtol=0, atol=1e-5)
    assert "jaxspec_attention" in jax.jit(lambda *a: flash_decode.attend(*a, attention="native")).lower(
        q, keys, values, lengths).as_text()
    mask = TreeMask(start=lengths, visible=jnp.asarray(np.random.default_rng(2).random((batch, steps, 6)) < 0.6))
    np.testing.assert_allclose(flash_decode.attend(q, keys, values, lengths, mask=mask, attention="native"),
                               flash_decode.flash_decode_reference(q, keys, values, lengths, mask=mask),
                               rtol=0, atol=1e-5)
    # A block-quantized cache and a sliding window are the reference's (bitwise its result).
    packed_keys = kv_quant.quantize_reference(jnp.asarray(keys).transpose(0, 2, 1, 3), "q8_0")
    packed_keys = jax.tree.map(lambda leaf: leaf.transpose(0, 2, 1, 3), packed_keys)  # [B, K, S, X]
    for kwargs in (dict(keys=packed_keys), dict(window=4)):
        args = dict(keys=keys, values=values) | kwargs
        window = args.pop("window", None)
        ours = flash_decode.attend(q, args["keys"], args["values"], lengths, window=window, attention="native")
        theirs = flash_decode.flash_decode_reference(q, args["keys"], args["values"], lengths, window=window)
        assert np.array_equal(ours, theirs)
