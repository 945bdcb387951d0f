"""Decode/verify attention: the reference on hand-computed cases, the Pallas kernel against the
reference over formats, group sizes, T and lengths, the model forward through the kernel, the
attention switch, and bad input. On CPU the kernel runs in the Pallas interpreter; on a GPU the
same tests run it natively."""

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
from jaxspec.pallas.flash_decode import Attention, flash_decode, flash_decode_reference, resolve_attention
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


def test_model_forward_through_the_kernel_matches_the_reference():
    """A verify step (T = 3) on a prefilled q8_0/q5_1 cache with rows at different lengths."""
    params = random_params(TINY32, seed=7)
    attention = Attention.INTERPRET if INTERPRET else Attention.PALLAS
    forward = jax.jit(llama.forward, static_argnums=1, static_argnames=("attention",))
    prompt = jnp.asarray(np.random.RandomState(0).randint(0, TINY32.vocab_size, (2, 6)))
    verify = jnp.asarray(np.random.RandomState(1).randint(0, TINY32.vocab_size, (2, 3)))
    cache = KVCache.create(TINY32, 2, 16, kv_format=("q8_0", "q5_1"))
    _, _, cache = forward(params, TINY32, prompt, cache, attention=Attention.REFERENCE)
    cache = cache.set_length(jnp.array([6, 4]))
    results = {mode: forward(params, TINY32, verify, cache, attention=mode)[::2]
               for mode in (Attention.REFERENCE, attention)}
    (ref_logits, ref_cache), (our_logits, our_cache) = results[Attention.REFERENCE], results[attention]
    assert max_relative_error(our_logits, ref_logits) < 1e-5
    # The quantize-on-write kernel stored exactly what the reference stored.
    chex.assert_trees_all_equal(our_cache.keys, ref_cache.keys)
    chex.assert_trees_all_equal(our_cache.values, ref_cache.values)


@pytest.mark.parametrize("key_format, value_format", [("f32", "bf16"), ("q8_0", "q5_1"), ("q5_1", "q8_0")])
def test_native_kernels_lower_to_triton_for_cuda(key_format, value_format):
    """Even without a GPU, lowering for CUDA runs Pallas's Triton lowering of both kernels (every
    op must have a Triton rule, blocks must be Triton-shaped); only Triton's own compile is left
    for a GPU (bench/gpu_check.sh)."""
    from jax import export

    batch, steps, num_kv_heads, group, capacity, head_dim = 2, 5, 2, 4, 256, 128
    shaped = lambda fmt: jax.eval_shape(lambda: kv_quant.zeros((batch, num_kv_heads, capacity, head_dim),
                                                                 kv_quant.Format(fmt)))
    triton_calls = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    attention = jax.jit(functools.partial(flash_decode_module._flash_decode_pallas, block_s=64,
                                          split_size=128, interpret=False))
    exported = export.export(attention, platforms=["cuda"], disabled_checks=triton_calls)(
        jax.ShapeDtypeStruct((batch, steps, num_kv_heads, group, head_dim), jnp.float32),
        shaped(key_format), shaped(value_format), jax.ShapeDtypeStruct((batch,), jnp.int32))
    assert "__gpu$xla.gpu.triton" in exported.mlir_module()
    new = jax.ShapeDtypeStruct((batch, steps, num_kv_heads, head_dim), jnp.float32)
    for fmt in {key_format, value_format} & {"q8_0", "q5_1"}:
        quantize = jax.jit(functools.partial(kv_quant._quantize_pallas, fmt=kv_quant.Format(fmt), block_rows=64,
                                             interpret=False))
        exported = export.export(quantize, platforms=["cuda"], disabled_checks=triton_calls)(new)
        assert "__gpu$xla.gpu.triton" in exported.mlir_module()


def test_attention_switch():
    assert resolve_attention("reference") is Attention.REFERENCE
    assert resolve_attention("interpret") is Attention.INTERPRET
    expected_auto = Attention.PALLAS if jax.default_backend() == "gpu" else Attention.REFERENCE
    assert resolve_attention("auto") is expected_auto
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
