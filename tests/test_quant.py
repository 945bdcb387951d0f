"""Weight formats (jaxspec.models.quant): int8 codes and scales, the W8A8 product, bf16, the
params-tree conversion and the fused projections, on tiny random models."""

from __future__ import annotations

import dataclasses
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec.cache import KVCache
from jaxspec.errors import InvalidRequestError
from jaxspec.models import layers, llama, quant, qwen35
from jaxspec.models.quant import WeightFormat
from jaxspec.spec import loop
from tests.conftest import (ENGINE_COMPILER_OPTIONS, HYBRID_CONFIG, TINY, max_relative_error, random_drafts,
                            requires_default_model)

RNG = np.random.default_rng(0)


def test_hadamard_is_an_orthonormal_involution_over_blocks():
    assert [quant.rotation_block(width) for width in (576, 1536, 40, 7, 128)] == [64, 64, 8, 1, 64]
    x = RNG.standard_normal((576, 3)).astype(np.float32)
    rotated = quant.hadamard(x, axis=0)
    np.testing.assert_allclose(quant.hadamard(rotated, axis=0), x, atol=1e-5)  # H H = I
    np.testing.assert_allclose(np.linalg.norm(rotated, axis=0), np.linalg.norm(x, axis=0), rtol=1e-5)
    # block by block, the Sylvester matrix / 8: an outlier spreads over its block of 64 only
    spike = np.zeros((576, 1), np.float32)
    spike[70] = 8.0
    spread = quant.hadamard(spike, axis=0)[:, 0]
    assert np.allclose(np.abs(spread[64:128]), 1.0) and not spread[:64].any() and not spread[128:].any()
    np.testing.assert_allclose(np.asarray(quant.hadamard(jnp.asarray(x), axis=0)), rotated, atol=1e-6)


def test_quantize_rows_is_symmetric_per_row_and_within_half_a_step():
    w = RNG.standard_normal((6, 40)).astype(np.float32)
    w[2] = 0.0  # an all-zero row gets scale 1 and zero codes
    q = quant.quantize_rows(w)
    assert q.values.dtype == np.int8 and q.scales.shape == (6,)
    assert np.abs(q.values).max() == 127 and q.scales[2] == 1.0 and not q.values[2].any()
    rotated = quant.hadamard(w, axis=1)  # codes live in the rotated basis, within half a step there
    np.testing.assert_allclose(np.abs(rotated).max(axis=1)[[0, 1, 3, 4, 5]], 127 * q.scales[[0, 1, 3, 4, 5]],
                               rtol=1e-6)
    assert (np.abs(q.values * q.scales[:, None] - rotated) <= q.scales[:, None] / 2 * (1 + 1e-5)).all()
    # and back in the weight's basis the row error is no larger (the rotation is orthonormal)
    row_error = np.linalg.norm(quant.dequantize(q) - w, axis=1)
    assert (row_error <= np.sqrt(40) * q.scales / 2 * (1 + 1e-5)).all()
    # The jax path agrees to XLA's division rounding (scales within an ulp, codes within one step).
    on_device = quant.quantize_rows(jnp.asarray(w))
    np.testing.assert_allclose(np.asarray(on_device.scales), q.scales, rtol=2e-7)
    assert np.abs(np.asarray(on_device.values, np.int32) - q.values).max() <= 1


class W8A8ProductTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_w8a8_product_is_the_exact_integer_product_scaled(self):
        """int32 accumulation is exact: the result is (codes @ codes) * w_scale * x_scale, bitwise."""
        w = quant.quantize_rows(RNG.standard_normal((24, 40)).astype(np.float32))
        x = RNG.standard_normal((40, 5)).astype(np.float32)
        got = np.asarray(self.variant(quant.matmul)(jax.tree.map(jnp.asarray, w), jnp.asarray(x)))
        codes, token_scales = (np.asarray(a) for a in quant.quantize_tokens(quant.hadamard(jnp.asarray(x), 0)))
        exact = w.values.astype(np.int64) @ codes.astype(np.int64)
        np.testing.assert_array_equal(got, exact.astype(np.float32) * w.scales[:, None] * token_scales[None, :])
        # and it is a faithful product: within int8 rounding of the float one
        assert max_relative_error(got, quant.dequantize(w) @ x) < 2e-2


def test_each_token_s_product_is_independent_of_its_neighbours():
    """A column's result is bitwise the same alone (padded to two columns), in a pair, or in nine."""
    w = jax.tree.map(jnp.asarray, quant.quantize_rows(RNG.standard_normal((48, 64)).astype(np.float32)))
    x = jnp.asarray(RNG.standard_normal((64, 9)).astype(np.float32))
    product = jax.jit(quant.matmul)
    nine = np.asarray(product(w, x))
    np.testing.assert_array_equal(np.asarray(product(w, x[:, :1])), nine[:, :1])
    np.testing.assert_array_equal(np.asarray(product(w, x[:, 3:5])), nine[:, 3:5])


def test_bf16_product_rounds_operands_and_accumulates_in_float32():
    w = RNG.standard_normal((32, 64)).astype(np.float32)
    x = RNG.standard_normal((64, 3)).astype(np.float32)
    got = np.asarray(quant.matmul(jnp.asarray(w, jnp.bfloat16), jnp.asarray(x)))
    assert got.dtype == np.float32
    rounded = np.asarray(jnp.asarray(w, jnp.bfloat16), np.float64) @ np.asarray(jnp.asarray(x, jnp.bfloat16),
                                                                               np.float64)
    np.testing.assert_allclose(got, rounded, rtol=1e-5, atol=1e-5)


def _weight_upcast_in_compiled(fn, w, rows) -> bool:
    """Whether XLA's compiled `fn(w, rows)` holds a float32 copy of the bf16 weight `w`."""
    text = jax.jit(fn).lower(w, rows).compile().as_text()
    return f"f32[{w.shape[0]},{w.shape[1]}]" in text


def test_bf16_product_after_a_transpose_keeps_bf16_operands():
    """The feature-major stream is a transpose of the token-major rows, and a norm after it keeps
    the transposed (column-major) layout; XLA CPU converted a bf16 weight to float32 at every call
    of a product fed such an operand (quant.matmul's comment), which made bf16 forwards 2x slower
    than float32. The product must reach XLA with operands it runs in bf16."""
    w = jnp.asarray(RNG.standard_normal((48, 32)), jnp.bfloat16)  # [O, I]
    rows = jnp.asarray(RNG.standard_normal((8, 32)), jnp.float32)  # [N, I]: token-major
    control = lambda w, x: jax.lax.dot_general(w, x.astype(jnp.bfloat16), (((1,), (0,)), ((), ())),
                                               preferred_element_type=jnp.float32)
    if _weight_upcast_in_compiled(control, w, rows.T.copy()):  # a row-major operand, made outside
        pytest.skip("this XLA build runs no bf16 product in bf16 (no bf16 dot library)")
    normed = lambda x: x * jax.lax.rsqrt(jnp.mean(x * x, axis=0, keepdims=True) + 1e-6)
    assert _weight_upcast_in_compiled(lambda w, r: control(w, normed(r.T)), w, rows), \
        "the plain product no longer shows the upcast: the test no longer covers the layout"
    assert not _weight_upcast_in_compiled(lambda w, r: quant.matmul(w, normed(r.T)), w, rows)
    got = jax.jit(lambda w, r: quant.matmul(w, normed(r.T)))(w, rows)
    np.testing.assert_allclose(np.asarray(got), np.asarray(control(w, normed(rows.T))), rtol=1e-6, atol=1e-6)


def test_bf16_product_gradient_is_bf16_products_of_the_float32_gradient():
    """quant.matmul's bf16 gradient (a custom VJP: both backward products in bf16, the cotangent
    rounded at the product) against float32 autodiff of the same bf16-rounded operands, in the
    shape of a training step: the activation arrives transposed, the output leaves transposed
    (eagle3.encode), and the weight is a float32 master cast inside. Also runs the compiled
    gradient, which is what fails when XLA turns a bf16 dot into a form no CPU kernel has."""
    w = jnp.asarray(RNG.standard_normal((48, 32)) * 0.1, jnp.float32)  # [O, I]
    rows = jnp.asarray(RNG.standard_normal((16, 32)), jnp.float32)  # [N, I]
    probe = jnp.asarray(RNG.standard_normal((16, 48)), jnp.float32)  # [N, O]

    def loss(w, rows, product):
        out = product(w.astype(jnp.bfloat16), jnp.tanh(rows).T).T  # [N, O]
        return jnp.sum(jnp.sin(out) * probe)

    rounded = lambda w, x: jnp.asarray(w, jnp.float32) @ x.astype(jnp.bfloat16).astype(jnp.float32)
    grad = jax.jit(jax.grad(lambda w, r: loss(w, r, quant.matmul), argnums=(0, 1)))
    want = jax.grad(lambda w, r: loss(w, r, rounded), argnums=(0, 1))(w, rows)
    got = grad(w, rows)
    for g, ref in zip(got, want):
        assert g.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(g), np.asarray(ref), rtol=2e-2, atol=2e-2 * float(jnp.abs(ref).max()))
    assert _bf16_dots(grad.lower(w, rows).compile().as_text()) == 3  # forward, dW, dx


def _bf16_dots(hlo: str) -> int:
    """How many dots of a compiled program multiply two bf16 operands."""
    operand_types = {}
    for name, dtype in re.findall(r"(%[\w.\-]+) = (\w+)\[", hlo):
        operand_types[name] = dtype
    for name, dtype in re.findall(r"(%[\w.\-]+): (\w+)\[", hlo):  # computation parameters
        operand_types[name] = dtype
    dots = re.findall(r" dot\((%[\w.\-]+), (%[\w.\-]+)\)", hlo)
    return sum(operand_types.get(a) == operand_types.get(b) == "bf16" for a, b in dots)


def test_int8_embedding_gathers_scaled_rows():
    table = quant.quantize_rows(RNG.standard_normal((20, 8)).astype(np.float32))
    tokens = jnp.asarray([3, 0, 19, 3])
    got = quant.embedding_rows(jax.tree.map(jnp.asarray, table), tokens)
    np.testing.assert_array_equal(np.asarray(got), quant.dequantize(table)[np.asarray(tokens)])


def test_convert_touches_linear_weights_only_and_shape_structs_match():
    params = llama.init_params(TINY, jax.random.PRNGKey(0))
    for fmt, dtype in [(WeightFormat.INT8, np.int8), (WeightFormat.BF16, jnp.bfloat16), (WeightFormat.F32, np.float32)]:
        converted = quant.convert(params, fmt)
        assert quant.format_of(converted) is fmt
        layer = converted.layers[0]
        linear = layer.attention.q_proj.values if fmt is WeightFormat.INT8 else layer.attention.q_proj
        assert linear.dtype == dtype and layer.attn_norm.dtype == np.float32
        structs = quant.shape_structs(llama.param_shapes(TINY), fmt)
        assert jax.tree.structure(structs) == jax.tree.structure(converted)
        for want, got in zip(jax.tree.leaves(structs), jax.tree.leaves(converted), strict=True):
            assert (want.shape, want.dtype) == (got.shape, got.dtype)


def test_unknown_weight_format_is_refused_by_name():
    choices = r"\['auto', 'f32', 'bf16', 'int8', 'q4'\]"
    with pytest.raises(InvalidRequestError, match=rf"unknown weight format 'int4'; choose from {choices}"):
        WeightFormat.parse("int4")
    with pytest.raises(InvalidRequestError, match="unknown weight format"):
        jaxspec.load("smollm2-135m", weight_format="fp8")


def test_auto_is_f32_on_cpu_and_bf16_on_gpu():
    assert WeightFormat.AUTO.resolve("cpu") is WeightFormat.F32
    assert WeightFormat.AUTO.resolve("gpu") is WeightFormat.BF16
    assert WeightFormat.INT8.resolve("gpu") is WeightFormat.INT8


@pytest.mark.parametrize("fmt", ["f32", "bf16", "int8"])
def test_fused_projections_compute_what_separate_ones_do(fmt):
    """One q/k/v and one gate/up product per layer: the same logits (int8: bitwise, since its
    rows and tokens are quantized alike either way), and unfuse gives back the checkpoint's."""
    separate = quant.convert(llama.init_params(TINY, jax.random.PRNGKey(0), scale=0.2), fmt)
    fused = layers.fuse_projections(separate)
    assert fused.layers[0].attention.q_proj is None and fused.layers[0].mlp.gate_up_proj is not None
    tokens = jnp.asarray([[1, 5, 9, 2, 7]])
    run = jax.jit(lambda p: llama.forward(p, TINY, tokens, KVCache.create(TINY, 1, 16))[0])
    if fmt == "int8":
        np.testing.assert_array_equal(np.asarray(run(fused)), np.asarray(run(separate)))
    else:
        assert max_relative_error(run(fused), run(separate)) < 1e-5
    chex.assert_trees_all_equal(layers.unfuse_projections(fused), separate)


# The default model's step-and-verify checks: a prompt and the 8 tokens forwarded after it.
STEP_AND_VERIFY_TEXT = "The quick brown fox jumps over the lazy dog. " * 5
STEP_AND_VERIFY_CONTINUATION = [791, 4189, 10936, 28, 549, 1010, 622, 253]


@pytest.fixture(scope="module")
def default_int8():
    """The default model's first 4 layers under int8 (loaded once for the module's tests that read
    it): its own int8 weights and shapes, final norm and head, so every op the 30 layers run, at a
    seventh of the compile. What these tests claim depends on the forward's width, not its depth."""
    return jaxspec.layer_skip(jaxspec.load(weight_format="int8"), 4)


def _step_and_verify_logits(model, prompt, continuation, batch: int = 1):
    """Logits of `continuation`'s positions after `prompt` (in each of `batch` equal rows), from
    forwards of 1, 5 and all of its tokens per row, each padded as the decode loop pads them
    (`loop.padded_tokens`: batch * T to a multiple of TOKEN_LANES)."""
    cfg = model.config
    lanes = quant.TOKEN_LANES
    _, _, cache = jax.jit(lambda p: llama.forward(p, cfg, jnp.asarray([prompt] * batch),
                                                  KVCache.create(cfg, batch, len(prompt) + 2 * lanes)))(model.params)
    cache = cache.advance(jnp.asarray([len(prompt)] * batch))
    # At batch 1 every width pads to the same 8 tokens: one program (one compile of the whole trunk).
    # Compiled as the engine compiles it (XLA's default flags, not the suite's: conftest).
    forward = jax.jit(lambda p, tokens, c: llama.forward(p, cfg, tokens, c)[0])
    programs = {}

    def step(tokens):
        if tokens.shape not in programs:
            programs[tokens.shape] = forward.lower(model.params, tokens, cache).compile(
                compiler_options=ENGINE_COMPILER_OPTIONS)
        return np.asarray(programs[tokens.shape](model.params, tokens, cache))

    padded = {t: np.pad(np.asarray([continuation[:t]] * batch, np.int32),
                        ((0, 0), (0, loop.padded_tokens(t, batch, lanes) - t)))
              for t in (1, 5, len(continuation))}
    return {t: step(jnp.asarray(tokens))[:, :t] for t, tokens in padded.items()}


@pytest.mark.parametrize("fmt", ["int8", "bf16"])
def test_logits_are_bitwise_the_same_in_a_step_and_inside_a_verify(fmt):
    """A position's logits under int8 or bf16 weights do not depend on how many tokens the forward
    carries (one, two, or a k+1 = 8 token verify), once padded to TOKEN_LANES as the loop does."""
    model = jaxspec.convert_weights(jaxspec.Model(config=TINY, params=llama.init_params(TINY, jax.random.PRNGKey(0),
                                                                                       scale=0.2)), fmt)
    logits = _step_and_verify_logits(model, [5, 6, 7, 8, 9, 10, 11, 12], [40, 41, 42, 43, 44, 45, 46, 47])
    for t in (1, 5):
        np.testing.assert_array_equal(logits[t], logits[8][:, :t])


@requires_default_model
@pytest.mark.real_model
def test_int8_on_the_default_model_is_bitwise_across_widths_and_speculation_is_exact(default_int8):
    """The default model under int8 (its first 4 layers: see the fixture): padded to TOKEN_LANES
    (without it an ulp of float work flips an int8 rounding and logits move by up to 1.0), a step
    and a verify agree bitwise, and speculative greedy output equals plain greedy."""
    model = default_int8
    prompt = model.tokenizer.encode(STEP_AND_VERIFY_TEXT)
    logits = _step_and_verify_logits(model, prompt, STEP_AND_VERIFY_CONTINUATION)
    for t in (1, 5):
        np.testing.assert_array_equal(logits[t], logits[8][:, :t])
    # unpadded, every Spec-Bench prompt tried diverged within 6-46 tokens; EAGLE-3 is in bench/spec.py
    question = "Summarise in two sentences: the fox jumped over the dog, then the dog chased the fox home."
    plain = jaxspec.generate(model, None, question, chat=True, max_new_tokens=24, ignore_eos=True)
    spec = jaxspec.generate(model, None, question, chat=True, max_new_tokens=24, ignore_eos=True,
                            method="ngram", num_draft_tokens=3)
    assert spec.tokens == plain.tokens


@requires_default_model
@pytest.mark.real_model
def test_int8_at_batch_32_is_bitwise_in_a_step_and_inside_a_verify(default_int8):
    """Past batch 1 the loop pads batch * T, not T, to TOKEN_LANES: at batch 32 a plain step is
    [32, 1] (32 tokens), a k = 4 verify [32, 5] (160) and a k = 7 one [32, 8] (256), so the
    forwards cross both widths where XLA:CPU's reduction changed. With RMSNorm's mean a `jnp.mean`,
    XLA:CPU reduced differently once a forward held 64 tokens (256 once the mean was taken along
    the minor axis), the logits moved by an ulp and then by int8 flips (0.66 at batch 64), and
    prompt lookup left plain greedy in 54 of 64 rows at batch 64. `feature_sum` adds
    elementwise, the same at every width. (Batch 8, 8 against 64 tokens, passed as well.)

    The width is what matters here, not the depth (the fixture's 4-layer cut). The forwards
    compile under XLA's default flags, as the engine's do: under the suite's (conftest) the last
    layer fuses into the head differently with the depth, and cuts of 2 (one machine) or 4 and 6
    layers (an AMD EPYC, Zen 2) parted by an ulp at width 160. The same machine parted here with
    cache-major attention scores (tests/test_flash_decode.py)."""
    model = default_int8
    prompt = model.tokenizer.encode(STEP_AND_VERIFY_TEXT)
    logits = _step_and_verify_logits(model, prompt, STEP_AND_VERIFY_CONTINUATION, batch=32)
    for t in (1, 5):
        np.testing.assert_array_equal(logits[t], logits[8][:, :t])


def test_a_draft_loaded_in_auto_runs_in_its_target_s_format(tiny_model):
    target = jaxspec.convert_weights(tiny_model, "int8")
    draft_cfg = dataclasses.replace(TINY, num_layers=1)
    draft = jaxspec.Model(config=draft_cfg, params=llama.init_params(draft_cfg, jax.random.PRNGKey(7), scale=0.2))
    prepared = jaxspec.prepare(target, draft, [1, 2, 3], max_new_tokens=4)
    assert quant.format_of(prepared.speculation.draft.params) is WeightFormat.INT8
    explicit = jaxspec.convert_weights(draft, "f32")  # a format asked for is kept
    prepared = jaxspec.prepare(target, explicit, [1, 2, 3], max_new_tokens=4)
    assert quant.format_of(prepared.speculation.draft.params) is WeightFormat.F32


@pytest.fixture(scope="module")
def int8_target(tiny_model):
    return jaxspec.convert_weights(tiny_model, "int8")


PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7], [40, 41, 42, 40, 41, 42], [9, 8, 7, 6, 5, 4, 30, 31, 9, 8, 7]]


@pytest.mark.parametrize("method", ["ngram", "draft", "layer_skip", "eagle3", "mtp"])
def test_int8_speculation_equals_int8_plain_greedy_on_a_ragged_batch(int8_target, method):
    plain = jaxspec.generate(int8_target, None, PROMPTS, max_new_tokens=20, ignore_eos=True)
    spec = jaxspec.generate(int8_target, prompt=PROMPTS, max_new_tokens=20, ignore_eos=True, num_draft_tokens=3,
                            **random_drafts(method))
    assert spec.tokens == plain.tokens
    assert spec.stats.method == method and spec.stats.proposed > 0


@pytest.mark.parametrize("fmt", ["int8"])
def test_the_hybrid_family_runs_int8_close_to_f32(fmt):
    """Qwen3.5's linear layers (DeltaNet projections included) take the format; its conv and
    decay params stay float32; log-probs stay near float32's and prompt lookup matches plain."""
    model = jaxspec.Model(config=HYBRID_CONFIG, params=qwen35.init_params(HYBRID_CONFIG, jax.random.PRNGKey(1)))
    converted = jaxspec.convert_weights(model, fmt)
    assert converted.params.layers[0].delta_net.conv_weight.dtype == np.float32
    ids = [[3, 7, 9, 11, 3, 7, 9, 11, 3, 7]]
    reference, ours = (jaxspec.score(m, ids).logprobs[0] for m in (model, converted))
    np.testing.assert_allclose(ours, reference, atol=0.05)
    plain = jaxspec.generate(converted, None, ids, max_new_tokens=12, ignore_eos=True)
    spec = jaxspec.generate(converted, None, ids, max_new_tokens=12, ignore_eos=True, method="ngram")
    assert spec.tokens == plain.tokens
