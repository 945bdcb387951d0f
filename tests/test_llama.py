"""The Llama-family trunk's side of the `jaxspec.models.forward` contract: the T new K/V land at
each row's own cache length and the length comes back unchanged; `logit_indices` picks positions;
`hidden_layers` returns the asked residual streams in the asked order; `positions` only rotate;
T tokens at once equal T one-token steps, jitted or not. Parity with transformers is
tests/test_parity_hf.py's, and cache rollback tests/test_cache.py's."""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import models
from jaxspec.cache import KVCache
from jaxspec.model import Model, lm_head_of
from jaxspec.models import layers, llama
from tests.conftest import TINY, max_relative_error

L = TINY.num_layers
TOKENS = jnp.array([[5, 17, 3, 99, 42], [0, 64, 64, 127, 8]], jnp.int32)  # [B, T]
B, T = TOKENS.shape
CAPACITY = 16


@functools.cache
def tiny_params():
    return llama.init_params(TINY, jax.random.PRNGKey(5), scale=0.2)


def empty_cache(batch: int = B, lengths=None) -> KVCache:
    """Zeroed buffers, rows at `lengths` (default 0): slots a forward did not write stay zero."""
    cache = models.create_cache(TINY, batch, CAPACITY)
    return cache if lengths is None else cache.advance(jnp.asarray(lengths, jnp.int32))


def written_slots(buffer: jax.Array) -> list[list[int]]:
    """Per row, the slots of a [B, K, S, H] buffer holding anything but zeros."""
    nonzero = np.asarray(jnp.any(buffer != 0, axis=(1, 3)))  # [B, S]
    return [np.flatnonzero(row).tolist() for row in nonzero]


class ForwardVariantsTest(chex.TestCase):
    """What must hold whether the trunk runs eagerly or compiled."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_t_tokens_at_once_equal_t_one_token_steps(self):
        forward = self.variant(
            lambda params, tokens, cache: models.forward(params, TINY, tokens, cache, hidden_layers=(L,)))
        at_once, (normed_at_once,), cache_at_once = forward(tiny_params(), TOKENS, empty_cache())
        cache, step_logits, step_normed = empty_cache(), [], []
        for t in range(T):
            logits, (normed,), cache = forward(tiny_params(), TOKENS[:, t:t + 1], cache)
            cache = cache.advance(jnp.ones((B,), jnp.int32))
            step_logits.append(logits)
            step_normed.append(normed)
        assert max_relative_error(jnp.concatenate(step_logits, axis=1), at_once) < 1e-5
        assert max_relative_error(jnp.concatenate(step_normed, axis=1), normed_at_once) < 1e-5
        for stepped, whole in zip(cache.keys + cache.values, cache_at_once.keys + cache_at_once.values):
            assert max_relative_error(stepped, whole) < 1e-5

    @chex.variants(with_jit=True, without_jit=True)
    def test_ragged_rows_write_at_their_own_offsets_and_keep_their_lengths(self):
        """Rows at lengths 2 and 7 write slots 2-6 and 7-11, the K/V a row writes alone."""
        forward = self.variant(lambda params, tokens, cache: models.forward(params, TINY, tokens, cache))
        lengths = [2, 7]
        _, _, cache = forward(tiny_params(), TOKENS, empty_cache(lengths=lengths))
        np.testing.assert_array_equal(cache.length, lengths)  # the caller commits, not forward
        for buffer in cache.keys + cache.values:
            chex.assert_shape(buffer, (B, TINY.num_kv_heads, CAPACITY, TINY.head_dim))
            assert written_slots(buffer) == [list(range(2, 2 + T)), list(range(7, 7 + T))]
        # Row 1 alone (one forward: each batch shape costs a compile): its neighbour does not leak in.
        _, _, alone = forward(tiny_params(), TOKENS[1:], empty_cache(1, lengths[1:]))
        for batched, single in zip(cache.keys + cache.values, alone.keys + alone.values):
            chex.assert_trees_all_close(batched[1], single[0], rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def full_forward():
    """Logits [B, T, V] and every hidden (-1, 0 .. L) of TOKENS from an empty cache."""
    everything = (-1, *range(L + 1))
    logits, hiddens, _ = models.forward(tiny_params(), TINY, TOKENS, empty_cache(), hidden_layers=everything)
    return logits, dict(zip(everything, hiddens))


def test_logit_indices_select_positions_per_row(full_forward):
    all_logits, _ = full_forward
    indices = jnp.array([[4, 0, 2], [1, 1, 3]], jnp.int32)  # [B, P]: any positions, any order, repeats
    picked, hiddens, _ = models.forward(tiny_params(), TINY, TOKENS, empty_cache(), logit_indices=indices)
    chex.assert_shape(picked, (B, 3, TINY.vocab_size))
    chex.assert_trees_all_close(picked, jnp.take_along_axis(all_logits, indices[..., None], axis=1),
                                rtol=1e-5, atol=1e-5)
    assert hiddens == ()  # none asked, none returned


def test_hidden_layers_come_back_in_the_order_asked(full_forward):
    _, every = full_forward
    asked = (L, 0, -1, L - 1)
    _, hiddens, _ = models.forward(tiny_params(), TINY, TOKENS, empty_cache(), hidden_layers=asked)
    assert len(hiddens) == len(asked)
    for layer, hidden in zip(asked, hiddens):
        chex.assert_shape(hidden, (B, T, TINY.dim))
        chex.assert_trees_all_close(hidden, every[layer], rtol=1e-6, atol=1e-6)
    assert all(not np.allclose(every[i], every[i + 1]) for i in range(-1, L))  # each layer moves the stream


def test_hidden_minus_one_is_the_embedding_and_l_is_after_the_final_norm(full_forward):
    _, every = full_forward
    # L is the stream after the final norm; init_params starts every norm weight at one.
    renormed = layers.rms_norm(every[L - 1], jnp.ones((TINY.dim,)), TINY.norm_eps, axis=-1)
    chex.assert_trees_all_close(every[L], renormed, rtol=1e-5, atol=1e-5)
    # -1 is the embedding output: with tied embeddings, the head's rows for the tokens given.
    tied = dataclasses.replace(TINY, tie_embeddings=True)
    model = Model(config=tied, params=llama.init_params(tied, jax.random.PRNGKey(6)))
    _, (embedded,), _ = models.forward(model.params, tied, TOKENS, empty_cache(), hidden_layers=(-1,))
    chex.assert_trees_all_equal(embedded, lm_head_of(model)[TOKENS])


def test_positions_default_to_the_slots_and_only_rotate(full_forward):
    """RoPE positions are the write slots unless given. Given, they rotate Q and K and nothing
    else: the K/V land at the same slots, a uniform shift leaves the logits alone (RoPE sees only
    relative positions), and a gap before the last token changes only that token's logits."""
    all_logits, _ = full_forward
    default_cache = models.forward(tiny_params(), TINY, TOKENS, empty_cache())[2]
    slots = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    explicit, _, _ = models.forward(tiny_params(), TINY, TOKENS, empty_cache(), positions=slots)
    chex.assert_trees_all_close(explicit, all_logits, rtol=1e-6, atol=1e-6)

    shifted, _, shifted_cache = models.forward(tiny_params(), TINY, TOKENS, empty_cache(), positions=slots + 3)
    assert max_relative_error(shifted, all_logits) < 1e-5
    assert written_slots(shifted_cache.keys[0]) == [list(range(T))] * B
    assert not np.allclose(shifted_cache.keys[0], default_cache.keys[0], atol=1e-3)  # rotated further

    gap = slots.at[:, -1].add(4)  # [B, T]: 0 1 2 3 8
    gapped, _, _ = models.forward(tiny_params(), TINY, TOKENS, empty_cache(), positions=gap)
    chex.assert_trees_all_close(gapped[:, :-1], all_logits[:, :-1], rtol=1e-6, atol=1e-6)
    assert not np.allclose(gapped[:, -1], all_logits[:, -1], atol=1e-3)
