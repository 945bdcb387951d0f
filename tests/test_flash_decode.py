"""Decode/verify attention: the reference on hand-computed cases, the Pallas kernel against the
reference over formats, group sizes, T and lengths, causal and under random draft-tree masks, the
model forward through the kernel, the attention switch, and bad input. On CPU the kernel runs in
the Pallas interpreter; on a GPU the same tests run it natively."""

import dataclasses
import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.cache import KVCache
from jaxspec.errors import InvalidRequestError
from jaxspec.models import llama
from jaxspec.pallas import flash_decode as flash_decode_module
from jaxspec.pallas import kv_quant
from jaxspec.pallas.flash_decode import (Attention, TreeMask, flash_decode, flash_decode_reference,
                                         resolve_attention)
from tests.conftest import max_relative_error
from tests.test_kv_quant import TINY32, random_params

INTERPRET = jax.default_backend() != "gpu"


def _hand_case():
    """B=1, K=1, G=2 (head 0 has q=1, head 1 has q=0), H=1 (so the 1/sqrt(H) scale is 1), S=4.

    keys   [0, ln 3, ln 4, 100]: slot 3 is stale garbage past the row's reach
    values [4, 8,    2,    -50]
    """
    keys = jnp.asarray([0.0, math.log(3.0), math.log(4.0), 100.0]).reshape(1, 1, 4, 1)
    values = jnp.asarray([4.0, 8.0, 2.0, -50.0]).reshape(1, 1, 4, 1)
    return keys, values


def test_reference_decode_by_hand():
    keys, values = _hand_case()
    q = jnp.asarray([1.0, 0.0]).reshape(1, 1, 1, 2, 1)  # [B, T, K, G, H]
    # length 0: the query sits at slot 0 and sees only it -> value 4 for both heads.
    out = flash_decode_reference(q, keys, values, jnp.array([0]))
    np.testing.assert_allclose(out.reshape(2), [4.0, 4.0], rtol=1e-6)
    # length 1: slots 0, 1. Head 0: weights exp(0) : exp(ln 3) = 1 : 3 -> (4 + 3*8) / 4 = 7.
    # Head 1: scores 0, 0 -> uniform -> (4 + 8) / 2 = 6.
    out = flash_decode_reference(q, keys, values, jnp.array([1]))
    np.testing.assert_allclose(out.reshape(2), [7.0, 6.0], rtol=1e-6)


def test_reference_verify_is_causal_within_the_new_tokens_by_hand():
    keys, values = _hand_case()
    q = jnp.asarray([1.0, 0.0, 1.0, 0.0]).reshape(1, 2, 1, 2, 1)  # T = 2 queries at slots 1 and 2
    out = flash_decode_reference(q, keys, values, jnp.array([1])).reshape(2, 2)  # [T, G]
    # t = 0 (slot 1) as above: 7 and 6. t = 1 (slot 2) sees slots 0..2 but never slot 3:
    # head 0 weights 1 : 3 : 4 -> (4 + 24 + 8) / 8 = 4.5; head 1 uniform -> (4 + 8 + 2) / 3.
    np.testing.assert_allclose(out, [[7.0, 6.0], [4.5, 14.0 / 3.0]], rtol=1e-6)


def test_reference_tree_mask_hides_a_sibling_by_hand():
    keys, values = _hand_case()
    # Length 1: the pending token (node 0, slot 1) and its two children, siblings at slots 2 and 3.
    q = jnp.asarray([1.0, 0.0] * 3).reshape(1, 3, 1, 2, 1)  # [B, T, K, G, H]
    visible = jnp.asarray([[True, False, False],  # node 0 sees itself
                           [True, True, False],  # node 1: its parent and itself, not its sibling
                           [True, False, True]])  # node 2: its parent and itself, not its sibling
    mask = TreeMask(start=jnp.array([1]), visible=visible[None])
    out = flash_decode_reference(q, keys, values, jnp.array([1]), mask=mask).reshape(3, 2)  # [T, G]
    # Nodes 0 and 1 see what causal queries at slots 1 and 2 see (7, 6 and 4.5, 14/3): had node 1
    # seen its sibling's key 100, head 0 would read value -50.
    # Node 2 sees slots 0, 1, 3: head 0 weights 1 : 3 : e^100 -> -50 (to float32);
    # head 1 uniform -> (4 + 8 - 50) / 3 = -38/3.
    np.testing.assert_allclose(out, [[7.0, 6.0], [4.5, 14.0 / 3.0], [-50.0, -38.0 / 3.0]], rtol=1e-6)


# (K format, V format, G, T): each format as K and as V, decode (T = 1) and verify (T > 1).
SWEEP = [
    ("f32", "f32", 1, 1),
    ("f32", "f32", 4, 5),
    ("bf16", "bf16", 2, 3),
    ("q8_0", "q5_1", 1, 1),
    ("q8_0", "q5_1", 4, 5),
    ("q5_1", "q8_0", 2, 3),
    ("q8_0", "q8_0", 3, 1),
    ("q5_1", "q5_1", 1, 4),
]
# The kernel and the reference read the same stored values; only summation order differs
# (and, natively, the exp implementation), so every format gets a float32-sized tolerance.
TOLERANCE = {"f32": 2e-5, "bf16": 2e-5, "q8_0": 3e-5, "q5_1": 3e-5}


@pytest.mark.parametrize("key_format, value_format, group, steps", SWEEP)
def test_kernel_matches_reference(key_format, value_format, group, steps):
    batch, num_kv_heads, capacity, head_dim = 4, 2, 64, 32
    rng = np.random.RandomState(group * 10 + steps)
    q = jnp.asarray(rng.randn(batch, steps, num_kv_heads, group, head_dim), jnp.float32)
    keys = kv_quant.quantize_reference(jnp.asarray(rng.randn(batch, num_kv_heads, capacity, head_dim) * 2), key_format)
    values = kv_quant.quantize_reference(jnp.asarray(rng.randn(batch, num_kv_heads, capacity, head_dim)), value_format)
    # Rows at length 0, 1, part way, and full (the last query sits on the last slot).
    lengths = jnp.array([0, 1, 37, capacity - steps], jnp.int32)
    # 2 splits of 32 slots, 2 blocks of 16 each: the online softmax and the split merge both run.
    ours = flash_decode(q, keys, values, lengths, block_s=16, split_size=32, interpret=INTERPRET)
    reference = flash_decode_reference(q, keys, values, lengths)
    chex.assert_shape(ours, (batch, steps, num_kv_heads, group, head_dim))
    chex.assert_tree_all_finite(ours)
    tolerance = max(TOLERANCE[key_format], TOLERANCE[value_format])
    chex.assert_trees_all_close(ours, reference, atol=tolerance, rtol=tolerance)


def random_tree_visible(rng: np.random.RandomState, nodes: int) -> np.ndarray:
    """bool[nodes, nodes]: visible[t, m] = "node m is t or an ancestor of t" for a random tree
    whose nodes are ordered parents before children (node 0, the pending token, is the root)."""
    visible = np.eye(nodes, dtype=bool)
    for node in range(1, nodes):
        visible[node] |= visible[rng.randint(node)]  # the parent's row is already complete
    return visible


def _random_attention_inputs(key_format, value_format, group, steps, seed, *, lengths=(0, 24), num_kv_heads=2,
                             capacity=128, head_dim=32):
    """q [B, T, K, G, H] and a K/V cache of S slots, by default K = 2, H = 32, S = 128 and the rows'
    lengths 0, 24 and S - T: one at the cache's start, one not aligned to a block of 16 whose last
    query (at slot 24 + 40 or 24 + 8) sits alone on the first slot of a split of 32, one ending on
    the last slot. `lengths` sets the rows before the last (B = its count + 1); the last row always
    ends on the last slot."""
    batch = len(lengths) + 1
    rng = np.random.RandomState(seed)
    q = jnp.asarray(rng.randn(batch, steps, num_kv_heads, group, head_dim), jnp.float32)
    keys = kv_quant.quantize_reference(jnp.asarray(rng.randn(batch, num_kv_heads, capacity, head_dim) * 2), key_format)
    values = kv_quant.quantize_reference(jnp.asarray(rng.randn(batch, num_kv_heads, capacity, head_dim)), value_format)
    lengths = jnp.array([*lengths, capacity - steps], jnp.int32)
    return q, keys, values, lengths


# (K format, V format, G, T): the SWEEP's format pairs under a tree of T = 1 + N nodes; with 40
# nodes a query's window needs two bit words.
TREE_SWEEP = [
    ("f32", "f32", 1, 41),
    ("bf16", "bf16", 3, 41),
    ("q8_0", "q5_1", 3, 41),
    ("q5_1", "q8_0", 1, 41),
    ("q8_0", "q8_0", 3, 9),
    ("q5_1", "q5_1", 1, 9),
]


@pytest.mark.parametrize("key_format, value_format, group, steps", TREE_SWEEP)
def test_kernel_matches_reference_under_a_tree_mask(key_format, value_format, group, steps):
    q, keys, values, lengths = _random_attention_inputs(key_format, value_format, group, steps, seed=steps + group)
    rng = np.random.RandomState(steps * 10 + group)
    visible = jnp.asarray(np.stack([random_tree_visible(rng, steps) for _ in lengths]))  # [B, T, T]
    # The tree is written at each row's length; blocks of 16 and splits of 32 slots, so a
    # window of 41 slots spans several blocks and splits.
    mask = TreeMask(start=lengths, visible=visible)
    ours = flash_decode(q, keys, values, lengths, mask=mask, block_s=16, split_size=32, interpret=INTERPRET)
    reference = flash_decode_reference(q, keys, values, lengths, mask=mask)
    chex.assert_shape(ours, q.shape)
    chex.assert_tree_all_finite(ours)
    tolerance = max(TOLERANCE[key_format], TOLERANCE[value_format])
    chex.assert_trees_all_close(ours, reference, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("layout", ["query-major", "cache-major"])
@pytest.mark.parametrize("key_format, value_format, group, steps", [("f32", "f32", 3, 1), ("q8_0", "q5_1", 3, 5),
                                                                    ("bf16", "bf16", 1, 9), ("f32", "f32", 1, 1)])
@pytest.mark.parametrize("query_block", [2, 4096])
def test_reference_decode_and_prefill_paths_agree(monkeypatch, layout, key_format, value_format, group, steps,
                                                  query_block):
    """The reference attends decode/verify sizes in one product over the cache (scores in either
    layout; a lone query padded to two) and a prefill a block of queries at a time over the
    slots the block can reach: the same attention, causal, under a tree mask and in a sliding
    window, with blocks of 2 (T = 5 and 9 leave a short last block; the row at length S - T
    reaches the last slot only from its last block) or T in one block."""
    assert flash_decode_module.DECODE_MAX_QUERIES >= 3 * 9  # decode and verify sizes take one product
    q, keys, values, lengths = _random_attention_inputs(key_format, value_format, group, steps, seed=7 * steps + group)
    rng = np.random.RandomState(steps)
    mask = TreeMask(start=lengths, visible=jnp.asarray(np.stack([random_tree_visible(rng, steps) for _ in lengths])))
    cases = {"causal": {}, "tree": {"mask": mask},
             "window": {"window": 16, "query_positions": lengths[:, None] + jnp.arange(steps)}}
    for name, options in cases.items():
        monkeypatch.setattr(flash_decode_module, "DECODE_SCORES_LAYOUT", layout)
        decode = flash_decode_reference(q, keys, values, lengths, **options)
        monkeypatch.setattr(flash_decode_module, "DECODE_MAX_QUERIES", 0)
        monkeypatch.setattr(flash_decode_module, "PREFILL_QUERY_BLOCK", query_block)
        prefill = flash_decode_reference(q, keys, values, lengths, **options)
        monkeypatch.undo()
        assert max_relative_error(decode, prefill) < 1e-5, name


@pytest.mark.parametrize("key_format, value_format", [("f32", "f32"), ("q8_0", "q5_1")])
@pytest.mark.parametrize("group", [1, 2, 3])
def test_a_query_s_attention_is_bitwise_the_same_whatever_shares_the_call(key_format, value_format, group):
    """A step (T = 1) and a verify (T = k + 1) give a position the same bits, as greedy
    speculation's exactness needs (under int8 weights an ulp of attention flips an activation's
    rounding downstream). Each prefix of 12 queries, compiled as the engine compiles it, against
    all 12: the count of queries beside a query (G*T from 1 to 36) moves none of its output.
    Cache-major scores failed this on an AMD EPYC (Zen 2): Q mod 16 in 1-8 against 9-16, and
    without its padding a lone query (G = 1, T = 1) did. G = 2 is the tiny test model's, 3 the
    default model's; the other sizes are the default model's (K = 3, H = 64) at batch 4 over 384
    slots. Below about 4,096 scores a call XLA:CPU compiles the softmax's exp(x - max)
    differently ([3, 2, Q, 128] changed with Q = 1-5 against more), so a call that small is not
    bitwise; at batch 1, where the engine's steps are that small, T pads to 8 in a step and a
    verify alike (`loop.padded_tokens`)."""
    steps = 12
    q, keys, values, lengths = _random_attention_inputs(key_format, value_format, group, steps, seed=group,
                                                        lengths=(0, 24, 200), num_kv_heads=3, capacity=384,
                                                        head_dim=64)
    attend = jax.jit(flash_decode_reference)
    whole = np.asarray(attend(q, keys, values, lengths))
    for prefix in range(1, steps):
        np.testing.assert_array_equal(np.asarray(attend(q[:, :prefix], keys, values, lengths)), whole[:, :prefix],
                                      err_msg=f"{prefix} of {steps} queries, G = {group}")


def test_a_causal_triangle_mask_is_the_causal_rule_exactly():
    group, steps = 2, 5
    q, keys, values, lengths = _random_attention_inputs("q8_0", "q5_1", group, steps, seed=3)
    triangle = jnp.tril(jnp.ones((steps, steps), bool))  # query t sees nodes 0..t
    mask = TreeMask(start=lengths, visible=jnp.broadcast_to(triangle, (len(lengths), steps, steps)))
    kernel = functools.partial(flash_decode, block_s=16, split_size=32, interpret=INTERPRET)
    for attention in (flash_decode_reference, kernel):
        chex.assert_trees_all_equal(attention(q, keys, values, lengths, mask=mask),
                                    attention(q, keys, values, lengths))


def test_model_forward_through_the_kernel_matches_the_reference():
    """A verify step (T = 3) on a prefilled q8_0/q5_1 cache with rows at different lengths.

    One layer: its K/V come from the same projection ops on either path, so what the kernel
    quantizes on write is bitwise what the reference quantizes. With a second layer the two
    paths' attention sums differ in the last bit (~3e-7), and a layer-1 key that sits on a q8_0
    rounding boundary then takes the neighbouring code (seen: one int8 code of 2048, a 6e-4
    relative logit change); that is rounding, not a kernel error, so it is not what this checks.
    """
    config = dataclasses.replace(TINY32, num_layers=1)
    params = random_params(config, seed=7)
    attention = Attention.INTERPRET if INTERPRET else Attention.PALLAS
    forward = jax.jit(llama.forward, static_argnums=1, static_argnames=("attention",))
    prompt = jnp.asarray(np.random.RandomState(0).randint(0, config.vocab_size, (2, 6)))
    verify = jnp.asarray(np.random.RandomState(1).randint(0, config.vocab_size, (2, 3)))
    cache = KVCache.create(config, 2, 16, kv_format=("q8_0", "q5_1"))
    _, _, cache = forward(params, config, prompt, cache, attention=Attention.REFERENCE)
    cache = cache.set_length(jnp.array([6, 4]))
    results = {mode: forward(params, config, verify, cache, attention=mode)[::2]
               for mode in (Attention.REFERENCE, attention)}
    (ref_logits, ref_cache), (our_logits, our_cache) = results[Attention.REFERENCE], results[attention]
    assert max_relative_error(our_logits, ref_logits) < 1e-5
    # The quantize-on-write kernel stored exactly what the reference stored.
    chex.assert_trees_all_equal(our_cache.keys, ref_cache.keys)
    chex.assert_trees_all_equal(our_cache.values, ref_cache.values)


def _lowers_to_triton(function, *shapes) -> bool:
    """Whether exporting `function` for CUDA at `shapes` emits a Triton call: Pallas's Triton
    lowering ran (every op had a Triton rule, blocks were Triton-shaped)."""
    from jax import export

    triton_call = "__gpu$xla.gpu.triton"
    exported = export.export(jax.jit(function), platforms=["cuda"],
                             disabled_checks=[export.DisabledSafetyCheck.custom_call(triton_call)])(*shapes)
    return triton_call in exported.mlir_module()


def _cache_shape(fmt: str, shape: tuple[int, ...]):
    """The shape structs of a [B, K, S, H] cache stored in `fmt` (one per leaf)."""
    return jax.eval_shape(lambda: kv_quant.zeros(shape, kv_quant.Format(fmt)))


def _native_attention(block_s: int = 64, split_size: int = 128):
    return functools.partial(flash_decode_module._flash_decode_pallas, block_s=block_s, split_size=split_size,
                             interpret=False)


@pytest.mark.parametrize("key_format, value_format", [("f32", "bf16"), ("q8_0", "q5_1"), ("q5_1", "q8_0")])
def test_native_kernels_lower_to_triton_for_cuda(key_format, value_format):
    """Even without a GPU, lowering for CUDA runs Pallas's Triton lowering of both kernels; only
    Triton's own compile is left for a GPU (bench/gpu_run.sh)."""
    batch, steps, num_kv_heads, group, capacity, head_dim = 2, 5, 2, 4, 256, 128
    cache = (batch, num_kv_heads, capacity, head_dim)
    assert _lowers_to_triton(_native_attention(),
                             jax.ShapeDtypeStruct((batch, steps, num_kv_heads, group, head_dim), jnp.float32),
                             _cache_shape(key_format, cache), _cache_shape(value_format, cache),
                             jax.ShapeDtypeStruct((batch,), jnp.int32))
    new = jax.ShapeDtypeStruct((batch, steps, num_kv_heads, head_dim), jnp.float32)
    for fmt in {key_format, value_format} & {"q8_0", "q5_1"}:
        quantize = functools.partial(kv_quant._quantize_pallas, fmt=kv_quant.Format(fmt), block_rows=64,
                                     interpret=False)
        assert _lowers_to_triton(quantize, new)


@pytest.mark.parametrize("group, steps", [(3, 41), (1, 65)])
def test_native_kernel_with_a_tree_mask_lowers_to_triton_for_cuda(group, steps):
    """The tree path's bit words, two of them and an odd three, are read by selects and shifts
    that Triton takes (G*T = 123 and 65 queries, each padded to a tile of 128 rows)."""
    batch, num_kv_heads, capacity, head_dim = 2, 2, 256, 128
    cache = (batch, num_kv_heads, capacity, head_dim)
    mask = TreeMask(start=jax.ShapeDtypeStruct((batch,), jnp.int32),
                    visible=jax.ShapeDtypeStruct((batch, steps, steps), jnp.bool_))
    assert _lowers_to_triton(_native_attention(),
                             jax.ShapeDtypeStruct((batch, steps, num_kv_heads, group, head_dim), jnp.float32),
                             _cache_shape("q8_0", cache), _cache_shape("q5_1", cache),
                             jax.ShapeDtypeStruct((batch,), jnp.int32), mask)


def test_attention_switch():
    assert resolve_attention("reference") is Attention.REFERENCE
    assert resolve_attention("interpret") is Attention.INTERPRET
    assert resolve_attention("auto") is Attention.REFERENCE  # on a GPU too: the kernel was slower there
    with pytest.raises(InvalidRequestError, match="unknown attention 'fast'"):
        resolve_attention("fast")


def test_prefill_sized_queries_take_the_reference(monkeypatch):
    def kernel_must_not_run(*args, **kwargs):
        raise AssertionError("the kernel is for decode and verify sizes")

    monkeypatch.setattr(flash_decode_module, "flash_decode", kernel_must_not_run)
    steps, group = 65, 2  # G*T = 130 > MAX_KERNEL_QUERIES
    assert group * steps > flash_decode_module.MAX_KERNEL_QUERIES
    q = jnp.ones((1, steps, 1, group, 32))
    keys = jnp.ones((1, 1, 80, 32))
    out = flash_decode_module.attend(q, keys, keys, jnp.zeros((1,), jnp.int32), attention="interpret")
    chex.assert_shape(out, q.shape)


@pytest.mark.skipif(not INTERPRET, reason="on a GPU the native kernel is allowed")
def test_native_kernel_off_gpu_is_refused():
    keys = jnp.zeros((1, 1, 16, 32))
    q = jnp.zeros((1, 1, 1, 1, 32))
    with pytest.raises(InvalidRequestError, match="attention='pallas'.*GPU.*backend is 'cpu'"):
        resolve_attention("pallas")
    with pytest.raises(InvalidRequestError, match="flash_decode.*GPU.*interpret=True"):
        flash_decode(q, keys, keys, jnp.zeros((1,), jnp.int32))


def test_bad_shapes_are_named():
    keys = jnp.zeros((2, 2, 16, 32))
    with pytest.raises(InvalidRequestError, match=r"q must be \[B, T, K, G, H\]"):
        flash_decode_reference(jnp.zeros((2, 1, 4, 32)), keys, keys, jnp.zeros((2,), jnp.int32))
    with pytest.raises(InvalidRequestError, match="disagree on B, K or H"):
        flash_decode_reference(jnp.zeros((2, 1, 3, 1, 32)), keys, keys, jnp.zeros((2,), jnp.int32))
    with pytest.raises(InvalidRequestError, match=r"lengths must be int32\[B=2\]"):
        flash_decode_reference(jnp.zeros((2, 1, 2, 1, 32)), keys, keys, jnp.zeros((3,), jnp.int32))
    with pytest.raises(InvalidRequestError, match="block_s=0"):
        flash_decode(jnp.zeros((2, 1, 2, 1, 32)), keys, keys, jnp.zeros((2,), jnp.int32), block_s=0,
                     interpret=True)


def test_bad_tree_masks_are_named():
    batch, steps = 2, 3
    q, keys = jnp.zeros((batch, steps, 1, 1, 32)), jnp.zeros((batch, 1, 16, 32))
    lengths = jnp.zeros((batch,), jnp.int32)
    visible = jnp.ones((batch, steps, steps), bool)
    bad_masks = [
        (TreeMask(start=jnp.zeros((3,), jnp.int32), visible=visible), r"start must be int32\[B=2\]"),
        (TreeMask(start=jnp.zeros((batch,), jnp.float32), visible=visible), r"start must be int32\[B=2\]"),
        (TreeMask(start=lengths, visible=visible[:, :2]), r"visible must be bool\[B=2, T=3, M >= 1\]"),
        (TreeMask(start=lengths, visible=visible[..., :0]), r"visible must be bool\[B=2, T=3, M >= 1\]"),
        (TreeMask(start=lengths, visible=visible.astype(jnp.int32)), r"visible must be bool\[B=2, T=3, M >= 1\]"),
    ]
    for mask, message in bad_masks:
        for attend in (flash_decode_reference, functools.partial(flash_decode, interpret=True)):
            with pytest.raises(InvalidRequestError, match=message):
                attend(q, keys, keys, lengths, mask=mask)
