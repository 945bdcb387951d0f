"""KV formats: ggml block layouts by hand, round-trip error bounds, real packing, the quantize
kernel against its reference, the quantized cache (per-row writes, rollback), bad input, and
speculative greedy == plain greedy over the same quantized cache."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.cache import KVCache, KVFormat, write_kv
from jaxspec.errors import InvalidRequestError, UnsupportedModelError
from jaxspec.models import llama
from jaxspec.pallas import kv_quant
from jaxspec.pallas.kv_quant import Format, Q5_1, Q8_0
from jaxspec.spec.verify import chain_parents, greedy_accept
from tests.conftest import TINY, max_relative_error

# Same suite natively on a GPU, in the Pallas interpreter elsewhere.
INTERPRET = jax.default_backend() != "gpu"
TINY32 = dataclasses.replace(TINY, head_dim=32, rotary_dim=32)  # block formats need H % 32 == 0
F16_EPS = 2.0**-11  # float16 relative rounding of the stored d and m


def test_q8_0_block_by_hand():
    # max |x| = 127, so d = 127 / 127 = 1 (exact in float16) and the codes are x rounded
    # half away from zero, as C's roundf: 1.5 -> 2, -2.5 -> -3, 3.49 -> 3, 0.5 -> 1.
    x = np.zeros(32, np.float32)
    x[:6] = [-127.0, 1.5, -2.5, 3.49, 0.5, 100.0]
    packed = kv_quant.quantize_reference(jnp.asarray(x), "q8_0")
    assert isinstance(packed, Q8_0)
    np.testing.assert_array_equal(packed.scales, [1.0])
    np.testing.assert_array_equal(packed.codes[:6], [-127, 2, -3, 3, 1, 100])
    np.testing.assert_array_equal(kv_quant.dequantize(packed)[:6], [-127, 2, -3, 3, 1, 100])


def test_q5_1_block_by_hand():
    # x_j = j - 10: min m = -10, max 21, d = 31 / 31 = 1, so code q_j = j.
    # Byte j (j < 16) packs q_j's low nibble and q_{j+16}'s: j | (j << 4), e.g. byte 1 = 0x11.
    # The fifth bit is set exactly for q_16 .. q_31: high_bits = 0xFFFF0000.
    x = jnp.arange(32, dtype=jnp.float32) - 10.0
    packed = kv_quant.quantize_reference(x, "q5_1")
    assert isinstance(packed, Q5_1)
    np.testing.assert_array_equal(packed.nibbles, [j | (j << 4) for j in range(16)])
    np.testing.assert_array_equal(packed.high_bits, [0xFFFF0000])
    np.testing.assert_array_equal(packed.scales, [1.0])
    np.testing.assert_array_equal(packed.mins, [-10.0])
    np.testing.assert_array_equal(kv_quant.dequantize(packed), x)


def _blocks_for_bounds() -> np.ndarray:
    """Head vectors [R, 64] with hard blocks: zeros, constants, one outlier, tiny and huge scales."""
    rng = np.random.RandomState(0)
    x = rng.randn(42, 64).astype(np.float32)
    x[0] = 0.0
    x[1] = 3.25
    x[2, :32] = -7.0
    x[3, 5] = 50.0
    x[4] *= 1e-3
    x[5] *= 300.0
    x[6, 32:] = np.linspace(-1, 1, 32)
    return x


def _block_error_bound(x: np.ndarray, fmt: Format) -> np.ndarray:
    """Largest |x - dequantize(quantize(x))| each value may have, per the format's arithmetic."""
    blocks = x.astype(np.float64).reshape(*x.shape[:-1], -1, 32)
    if fmt is Format.Q8_0:
        d = np.abs(blocks).max(-1, keepdims=True) / 127
        bound = d * (0.5 + 127 * F16_EPS)  # rounding, plus float16 d times |q| <= 127
    elif fmt is Format.Q5_1:
        low, high = blocks.min(-1, keepdims=True), blocks.max(-1, keepdims=True)
        d = (high - low) / 31
        bound = d * (0.5 + 31 * F16_EPS) + np.abs(low) * F16_EPS  # rounding, float16 d and m
    elif fmt is Format.BF16:
        bound = np.abs(blocks) * 2.0**-8
    else:
        bound = np.zeros_like(blocks)
    return np.broadcast_to(bound * (1 + 1e-5) + 1e-30, blocks.shape).reshape(x.shape)


@pytest.mark.parametrize("fmt", list(Format))
def test_round_trip_within_the_format_bound(fmt):
    x = _blocks_for_bounds()
    restored = np.asarray(kv_quant.dequantize(kv_quant.quantize_reference(jnp.asarray(x), fmt)))
    error = np.abs(restored - x)
    bound = _block_error_bound(x, fmt)
    worst = np.unravel_index(np.argmax(error - bound), x.shape)
    assert np.all(error <= bound), f"{fmt}: error {error[worst]:.3g} > bound {bound[worst]:.3g} at {worst}"
    np.testing.assert_array_equal(restored[0], 0.0)  # a zero block stays exactly zero
    if fmt.is_block:
        np.testing.assert_allclose(restored[1], 3.25, rtol=F16_EPS)  # a constant block, to float16


@pytest.mark.parametrize("fmt, bytes_per_32", [("f32", 128), ("bf16", 64), ("q8_0", 34), ("q5_1", 24)])
def test_packing_is_real(fmt, bytes_per_32):
    packed = kv_quant.zeros((3, 2, 5, 64), Format(fmt))
    assert kv_quant.nbytes(packed) == 3 * 2 * 5 * 64 // 32 * bytes_per_32
    assert tuple(packed.shape) == (3, 2, 5, 64)
    cache = KVCache.create(TINY32, batch=2, capacity=8, kv_format=(fmt, "q5_1"))
    per_token = KVFormat.parse((fmt, "q5_1")).bytes_per_token(TINY32)
    assert cache.nbytes == 2 * 8 * per_token
    assert per_token == TINY32.num_layers * TINY32.num_kv_heads * (bytes_per_32 + 24)


@pytest.mark.parametrize("fmt", ["q8_0", "q5_1"])
def test_quantize_kernel_matches_reference(fmt):
    # 2 * 3 * 7 = 42 head vectors: not a multiple of the 16-row tile, so the padded tail is
    # exercised too. The two implementations share no code; the outputs must agree bit for bit.
    x = jnp.asarray(_blocks_for_bounds().reshape(2, 3, 7, 64))
    kernel = kv_quant.quantize(x, fmt, block_rows=16, interpret=INTERPRET)
    reference = kv_quant.quantize_reference(x, fmt)
    assert jax.tree.structure(kernel) == jax.tree.structure(reference)
    for ours, theirs in zip(jax.tree.leaves(kernel), jax.tree.leaves(reference)):
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
        np.testing.assert_array_equal(ours, theirs)


def test_write_kv_quantizes_at_each_rows_offset_and_drops_past_capacity():
    buffer = kv_quant.zeros((2, 1, 6, 32), Format.Q8_0)  # [B, K, S, H]
    new = jax.random.normal(jax.random.PRNGKey(0), (2, 3, 1, 32))  # [B, T, K, H]
    out = jax.jit(write_kv)(buffer, new, jnp.array([1, 4]))
    restored = kv_quant.dequantize(out)[:, 0]  # [B, S, H]
    expected = kv_quant.dequantize(kv_quant.quantize_reference(new, "q8_0"))[:, :, 0]  # [B, T, H]
    np.testing.assert_array_equal(restored[0, 1:4], expected[0])
    np.testing.assert_array_equal(restored[1, 4:6], expected[1, :2])  # slot 6 does not exist: dropped
    untouched = np.ones((2, 6), bool)
    untouched[0, 1:4] = untouched[1, 4:6] = False
    np.testing.assert_array_equal(np.asarray(restored)[untouched], 0.0)


def test_default_cache_is_float32_and_unchanged():
    cache = KVCache.create(TINY, batch=2, capacity=16)
    assert cache.kv_format == KVFormat() and str(cache.kv_format) == "f32/f32"
    assert cache.keys[0].dtype == jnp.float32 and cache.keys[0].shape == (2, TINY.num_kv_heads, 16, TINY.head_dim)
    assert KVCache.create(TINY, 1, 4, dtype=jnp.bfloat16).kv_format == KVFormat(Format.BF16, Format.BF16)
    assert KVCache.create(TINY32, 1, 4, kv_format="q8_0").kv_format == KVFormat(Format.Q8_0, Format.Q8_0)


def test_bad_formats_are_named():
    with pytest.raises(InvalidRequestError, match="unknown KV format 'q4_0'"):
        KVCache.create(TINY32, 1, 8, kv_format=("q8_0", "q4_0"))
    with pytest.raises(InvalidRequestError, match="pair"):
        KVFormat.parse(("q8_0", "q5_1", "f32"))
    with pytest.raises(UnsupportedModelError, match="head_dim divisible by 32.*head_dim is 16"):
        KVCache.create(TINY, 1, 8, kv_format=("q8_0", "q5_1"))
    with pytest.raises(InvalidRequestError, match="float32 or bfloat16"):
        KVCache.create(TINY, 1, 8, dtype=jnp.float16)
    KVCache.create(TINY, 1, 8, kv_format=("f32", "bf16"))  # plain formats take any head dim


@pytest.mark.skipif(not INTERPRET, reason="on a GPU the native kernel is allowed")
def test_native_quantize_kernel_off_gpu_is_refused():
    with pytest.raises(InvalidRequestError, match="GPU.*interpret=True"):
        kv_quant.quantize(jnp.zeros((4, 32)), "q8_0")


def random_params(cfg, seed: int, scale: float = 0.2):
    """llama.init_params's shapes, drawn with numpy (no per-op compiles): norms 1, weights N(0, scale)."""
    rng = np.random.RandomState(seed)
    shapes = jax.eval_shape(lambda: llama.init_params(cfg, jax.random.PRNGKey(0)))
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: jnp.ones(leaf.shape) if path[-1].name.endswith("norm")
        else jnp.asarray(scale * rng.randn(*leaf.shape), jnp.float32), shapes)


@pytest.fixture(scope="module")
def params():
    return random_params(TINY32, seed=3)


forward = jax.jit(llama.forward, static_argnums=1, static_argnames=("attention",))
SEED_FORMAT = ("q8_0", "q5_1")  # the CUDA seed's: K in q8_0, V in q5_1


def test_quantized_cache_chunked_equals_full_forward_with_rollback(params):
    """Each token's K/V is quantized on its own, so prefill in one go, in chunks, or with rejected
    tokens written and rolled back all read the same stored values."""
    tokens = np.random.RandomState(0).randint(0, TINY32.vocab_size, (2, 12))
    full, _, _ = forward(params, TINY32, jnp.asarray(tokens), KVCache.create(TINY32, 2, 16, kv_format=SEED_FORMAT))
    cache = KVCache.create(TINY32, 2, 16, kv_format=SEED_FORMAT)
    pieces = []
    for start in range(0, 12, 4):
        wrong = (tokens[:, start:start + 4] + 1) % TINY32.vocab_size
        _, _, cache = forward(params, TINY32, jnp.asarray(wrong), cache)  # written, then rejected
        logits, _, cache = forward(params, TINY32, jnp.asarray(tokens[:, start:start + 4]), cache)
        cache = cache.advance(jnp.array([4, 4]))
        pieces.append(logits)
    assert max_relative_error(jnp.concatenate(pieces, axis=1), full) < 1e-5


def _plain_greedy(params, prompt, steps, kv_format):
    cache = KVCache.create(TINY32, 1, 64, kv_format=kv_format)
    logits, _, cache = forward(params, TINY32, jnp.asarray([prompt]), cache)
    cache = cache.advance(jnp.array([len(prompt)]))
    out = [int(jnp.argmax(logits[0, -1]))]
    while len(out) < steps:
        logits, _, cache = forward(params, TINY32, jnp.asarray([[out[-1]]]), cache)
        cache = cache.advance(jnp.array([1]))
        out.append(int(jnp.argmax(logits[0, -1])))
    return out


def _speculative_greedy(params, prompt, steps, kv_format, proposals, k=3):
    """The engine's round on the quantized cache: verify [pending, d_1..d_k] in one forward,
    accept the longest matching prefix, commit n + 1, roll the rest back by length."""
    cache = KVCache.create(TINY32, 1, 64, kv_format=kv_format)
    logits, _, cache = forward(params, TINY32, jnp.asarray([prompt]), cache)
    cache = cache.advance(jnp.array([len(prompt)]))
    out, rounds = [int(jnp.argmax(logits[0, -1]))], 0
    while len(out) < steps:
        drafts = jnp.asarray([proposals(len(out), k)], jnp.int32)
        verify = jnp.concatenate([jnp.asarray([[out[-1]]], jnp.int32), drafts], axis=1)
        logits, _, cache = forward(params, TINY32, verify, cache)
        outcome = greedy_accept(verify[:, 0], drafts, chain_parents(1, k), jnp.array([k]), logits, k)
        n = int(outcome.accepted[0])
        out += [int(t) for t in outcome.committed[0, : n + 1]]
        cache = cache.advance(jnp.array([n + 1]))
        rounds += 1
    return out[:steps], rounds


def test_speculative_greedy_equals_plain_greedy_on_the_quantized_cache(params):
    prompt = list(np.random.RandomState(5).randint(0, TINY32.vocab_size, 8))
    plain = _plain_greedy(params, prompt, 24, SEED_FORMAT)
    # An oracle draft that knows the plain output but plants a wrong token in every other round,
    # so rounds accept all, some or none, and rejected K/V is written then rolled back.
    def proposals(position, k):
        drafts = list(plain[position: position + k]) + [0] * k
        if position % 2:
            drafts[position % k] = (drafts[position % k] + 1) % TINY32.vocab_size
        return drafts[:k]

    speculative, rounds = _speculative_greedy(params, prompt, 24, SEED_FORMAT, proposals)
    assert speculative == plain
    assert rounds < 23  # some rounds did commit several tokens


def test_generate_speculative_equals_plain_on_a_quantized_cache(params):
    import jaxspec
    from jaxspec.api import Model

    model = Model(config=TINY32, params=params)
    prompt = [list(np.random.RandomState(s).randint(4, TINY32.vocab_size, 6)) * 2 for s in (8, 9)]
    common = dict(max_new_tokens=20, ignore_eos=True, kv_format=SEED_FORMAT)
    plain = jaxspec.generate(model, prompt=prompt, method="plain", **common)
    for method, extra in (("ngram", {}), ("layer_skip", {"exit_layer": 1})):
        speculative = jaxspec.generate(model, prompt=prompt, method=method, num_draft_tokens=3, **extra, **common)
        assert speculative.tokens == plain.tokens, method
    assert speculative.stats.rounds < plain.stats.rounds  # the layer-skip draft got tokens accepted
    with pytest.raises(UnsupportedModelError, match="head_dim is 16"):
        jaxspec.generate(Model(config=TINY, params=params), prompt=[1, 2], kv_format="q8_0")
    with pytest.raises(InvalidRequestError, match="unknown KV format"):
        jaxspec.generate(model, prompt=[1, 2], kv_format=("q8_0", "q4_k"))
