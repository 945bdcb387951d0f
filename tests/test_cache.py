"""The Cache protocol (both caches honour it, max_rollback means what it says), and the KV
cache: per-row writes, rollback by length, and forward consistency across cache states."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.cache import KV_AXES, Cache, KVCache, StateRollbackError, write_kv, write_rows
from jaxspec.models import llama, qwen35
from jaxspec.models.hybrid_cache import CONV_AXES, SSM_AXES
from jaxspec.models.qwen35 import LayerType, Qwen35Cache, Qwen35Config
from tests.conftest import TINY, max_relative_error

HYBRID = Qwen35Config(vocab_size=32, dim=16, num_layers=2, layer_types=(LayerType.LINEAR_ATTENTION,
                      LayerType.FULL_ATTENTION), ffn_dim=16, num_heads=2, num_kv_heads=1, head_dim=8, rotary_dim=4,
                      linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=4,
                      linear_value_head_dim=4, rollback_states=3)


def _hybrid_cache_after(steps: int) -> Qwen35Cache:
    """A batch-of-one hybrid cache that ran and committed `steps` tokens, one forward each."""
    params = qwen35.init_params(HYBRID, jax.random.PRNGKey(0))

    @jax.jit
    def step(cache, token):
        _, _, cache = qwen35.forward(params, HYBRID, token, cache)
        return cache.advance(jnp.ones_like(cache.length))

    cache = Qwen35Cache.create(HYBRID, 1, 16)
    for token in range(steps):
        cache = step(cache, jnp.full((1, 1), token, jnp.int32))
    return cache


@pytest.mark.parametrize("kind", ["kv", "hybrid"])
def test_both_caches_honour_the_protocol_and_its_max_rollback(kind):
    """Structurally a Cache; and from its furthest commit, rolling back exactly max_rollback
    positions works while max_rollback + 1 raises (KVCache: any length down to 0; the hybrid:
    what its ring of rollback_states DeltaNet states holds)."""
    if kind == "kv":
        cache = KVCache.create(TINY, batch=1, capacity=8).advance(jnp.array([8]))
        assert cache.max_rollback == cache.capacity == 8
    else:
        cache = _hybrid_cache_after(5)
        assert cache.max_rollback == HYBRID.rollback_states - 1 == 2
    assert isinstance(cache, Cache)
    furthest = int(cache.length[0])
    rolled = cache.set_length(cache.length - cache.max_rollback)
    assert int(rolled.length[0]) == furthest - cache.max_rollback
    with pytest.raises(StateRollbackError, match="cannot set"):
        cache.set_length(cache.length - cache.max_rollback - 1)


def test_kv_cache_refuses_lengths_past_its_capacity():
    with pytest.raises(StateRollbackError, match="row 1: cannot set a KV cache to length 9"):
        KVCache.create(TINY, batch=2, capacity=8).set_length(jnp.array([8, 9]))


def test_write_rows_lands_at_each_rows_offset():
    buffer = jnp.zeros((2, 1, 6, 1))  # [B, K, S, H]
    new = jnp.arange(1, 7, dtype=jnp.float32).reshape(2, 3, 1, 1)  # [B, T, K, H]: row 0: 1 2 3, row 1: 4 5 6
    out = write_rows(buffer, new, jnp.array([0, 2]))[:, 0, :, 0]
    np.testing.assert_array_equal(out, [[1, 2, 3, 0, 0, 0], [0, 0, 4, 5, 6, 0]])


def test_write_past_capacity_is_dropped_not_clamped():
    buffer = jnp.arange(6, dtype=jnp.float32).reshape(1, 1, 6, 1)
    new = jnp.full((1, 3, 1, 1), -1.0)
    out = write_rows(buffer, new, jnp.array([5]))[:, 0, :, 0]
    # Only slot 5 fits; slots 6 and 7 do not exist and must not land on 3 and 4 instead.
    np.testing.assert_array_equal(out, [[0, 1, 2, 3, 4, -1]])


def test_create_shapes_and_lengths():
    cache = KVCache.create(TINY, batch=3, capacity=32)
    assert len(cache.keys) == TINY.num_layers == len(cache.values)
    assert cache.keys[0].shape == (3, TINY.num_kv_heads, 32, TINY.head_dim)
    assert cache.capacity == 32 and cache.batch == 3
    np.testing.assert_array_equal(cache.length, [0, 0, 0])
    np.testing.assert_array_equal(cache.advance(jnp.array([1, 2, 0])).length, [1, 2, 0])


@pytest.mark.parametrize("kv_format", ["f32", "q8_0"])
def test_cache_buffers_have_one_logical_axis_per_dimension(kv_format):
    """The caches' logical axis names (what sharding maps to a mesh) fit every buffer they name."""
    cfg = TINY if kv_format == "f32" else dataclasses.replace(TINY, head_dim=32, rotary_dim=32)
    cache = KVCache.create(cfg, batch=2, capacity=8, kv_format=kv_format)
    for leaf in jax.tree.leaves((cache.keys, cache.values)):  # a packed format's leaves too
        assert leaf.ndim == len(KV_AXES)
    hybrid = Qwen35Cache.create(HYBRID, 2, 8)
    assert all(leaf.ndim == len(KV_AXES) for leaf in jax.tree.leaves((hybrid.keys, hybrid.values)))
    assert all(state.ndim == len(SSM_AXES) for state in hybrid.ssm)
    assert all(window.ndim == len(CONV_AXES) for window in hybrid.conv)


@pytest.fixture(scope="module")
def params():
    return llama.init_params(TINY, jax.random.PRNGKey(1), scale=0.2)


forward = jax.jit(llama.forward, static_argnums=1)


def _logits(params, tokens, cache):
    logits, _, cache = forward(params, TINY, jnp.asarray(tokens, jnp.int32), cache)
    return logits, cache


def test_incremental_decode_matches_full_forward(params):
    tokens = np.random.RandomState(0).randint(0, TINY.vocab_size, (2, 12))
    full, _ = _logits(params, tokens, KVCache.create(TINY, 2, 16))
    cache = KVCache.create(TINY, 2, 16)
    chunk, cache = _logits(params, tokens[:, :5], cache)
    pieces = [chunk]
    cache = cache.advance(jnp.array([5, 5]))
    for t in range(5, 12, 3):  # then chunks of 3 (the shape of a verification round)
        chunk, cache = _logits(params, tokens[:, t:t + 3], cache)
        cache = cache.advance(jnp.array([chunk.shape[1]] * 2))
        pieces.append(chunk)
    assert max_relative_error(jnp.concatenate(pieces, axis=1), full) < 1e-5


def test_rollback_by_length_forgets_rejected_tokens(params):
    """Write 4 speculative tokens, keep 1, then continue: equal to never having written them."""
    tokens = np.random.RandomState(1).randint(0, TINY.vocab_size, (1, 8))
    wrong = np.random.RandomState(2).randint(0, TINY.vocab_size, (1, 4))
    clean = KVCache.create(TINY, 1, 16)
    _, clean = _logits(params, tokens[:, :6], clean)
    clean = clean.advance(jnp.array([6]))
    reference, _ = _logits(params, tokens[:, 6:], clean)

    cache = KVCache.create(TINY, 1, 16)
    _, cache = _logits(params, tokens[:, :5], cache)
    cache = cache.advance(jnp.array([5]))
    speculative = np.concatenate([tokens[:, 5:6], wrong[:, :3]], axis=1)
    _, cache = _logits(params, speculative, cache)
    cache = cache.advance(jnp.array([1]))  # accept only tokens[5]: the rest is rolled back
    resumed, _ = _logits(params, tokens[:, 6:], cache)
    assert max_relative_error(resumed, reference) < 1e-5


def test_rows_with_different_lengths_are_independent(params):
    """Row 0 at length 3 and row 1 at length 7 in one batch equal each row run alone."""
    seqs = [np.random.RandomState(s).randint(0, TINY.vocab_size, (n,)) for s, n in ((3, 4), (4, 8))]
    alone = []
    for seq in seqs:
        cache = KVCache.create(TINY, 1, 16)
        _, cache = _logits(params, seq[None, :-1], cache)
        cache = cache.advance(jnp.array([len(seq) - 1]))
        logits, _ = _logits(params, seq[None, -1:], cache)
        alone.append(logits[0, 0])
    cache = KVCache.create(TINY, 2, 16)
    padded = np.zeros((2, 7), np.int64)
    padded[0, :3], padded[1, :7] = seqs[0][:-1], seqs[1][:-1]
    _, cache = _logits(params, padded, cache)
    cache = cache.set_length(jnp.array([3, 7]))
    last = np.stack([seqs[0][-1:], seqs[1][-1:]])
    batched, _ = _logits(params, last, cache)
    for row in range(2):
        assert max_relative_error(batched[row, 0], alone[row]) < 1e-5


def _filled_cache(kv_format: str, lengths: list[int], capacity: int = 12) -> KVCache:
    """A cache of head dim 32 (every block format tiles it) whose every slot of every row, layer
    and K/V buffer holds its own random vector, at ragged `lengths`."""
    cfg = dataclasses.replace(TINY, head_dim=32, rotary_dim=32)
    cache = KVCache.create(cfg, batch=len(lengths), capacity=capacity, kv_format=kv_format)
    shape = (len(lengths), capacity, cfg.num_kv_heads, cfg.head_dim)  # [B, T, K, H]: one write of every slot
    keys = jax.random.split(jax.random.PRNGKey(0), 2 * cfg.num_layers)
    buffers = [write_kv(buffer, jax.random.normal(key, shape), jnp.zeros((len(lengths),), jnp.int32))
               for buffer, key in zip(cache.keys + cache.values, keys)]
    return cache.replace(keys=tuple(buffers[:cfg.num_layers]), values=tuple(buffers[cfg.num_layers:])).set_length(
        jnp.array(lengths))


def _moved(before: KVCache, sources: np.ndarray, destination: np.ndarray) -> tuple:
    """What every packed leaf of every K/V buffer must hold after moving each row's slots
    `sources[b]` to `destination[b] + 0 .. P - 1`: computed slot by slot in numpy."""
    def move(leaf):  # [B, K, S, X]
        original = np.asarray(leaf)
        expected = original.copy()
        for row, row_sources in enumerate(sources):
            for i, source in enumerate(row_sources):
                expected[row, :, destination[row] + i] = original[row, :, source]
        return expected

    return jax.tree.map(move, (before.keys, before.values))


@pytest.mark.parametrize("kv_format", ["f32", "bf16", "q8_0", "q5_1"])
def test_commit_path_gathers_each_rows_path_into_contiguous_slots(kv_format):
    """Slot length + i takes what slot length + path[i] held, per row; every other slot (the
    committed ones below length, those past the path) is untouched, and lengths do not move."""
    lengths = np.array([2, 5, 0])
    cache = _filled_cache(kv_format, lengths.tolist())
    # Root first and increasing; past a row's accepted node the path repeats the root (0).
    path = np.array([[0, 2, 5, 0], [0, 1, 2, 3], [0, 4, 0, 0]])
    committed = cache.commit_path(jnp.asarray(path, jnp.int32))
    chex.assert_trees_all_equal((committed.keys, committed.values),
                                _moved(cache, lengths[:, None] + path, lengths))
    np.testing.assert_array_equal(committed.length, lengths)
    assert committed.kv_format == cache.kv_format


@pytest.mark.parametrize("kv_format", ["f32", "q5_1"])
def test_move_slots_copies_to_any_destination(kv_format):
    """A tree drafter's scratch slots moved down to where its chain would have written them;
    overlapping sources and destinations read the old contents."""
    cache = _filled_cache(kv_format, [3, 1])
    sources, destination = np.array([[7, 4, 3], [1, 1, 2]]), np.array([3, 2])
    moved = cache.move_slots(jnp.asarray(sources, jnp.int32), jnp.asarray(destination, jnp.int32))
    chex.assert_trees_all_equal((moved.keys, moved.values), _moved(cache, sources, destination))
    np.testing.assert_array_equal(moved.length, [3, 1])
