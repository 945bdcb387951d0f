"""W8A16 matmul: the reference by hand and against float64 within its rounding bound, the Pallas
kernel against the reference over shapes (N = 1, 5, 37; O and I off the block grid; x float32
or bf16), the implementation switch, the Triton lowering, and bad input. On CPU the kernel runs
in the Pallas interpreter; on a GPU the same tests run it natively."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.errors import InvalidRequestError, UnsupportedModelError
from jaxspec.pallas.int8_matmul import (
    MAX_KERNEL_TOKENS, Implementation, kernel_supports, resolve_implementation, w8a16_matmul,
    w8a16_matmul_pallas, w8a16_matmul_reference)
from tests.conftest import max_relative_error

INTERPRET = jax.default_backend() != "gpu"
FLOAT32_UNIT_ROUNDOFF = 2.0**-24
# Kernel and reference multiply the same bf16 operands (each product exact in float32) and sum in
# float32; only the order of the I-term sums differs, which moves the result by float32 rounding.
KERNEL_TOLERANCE = 1e-5  # max |kernel - reference| / max |reference|


def random_weight(rng: np.random.RandomState, out_features: int, in_features: int):
    """int8 values over the whole symmetric range and positive per-channel scales of varied size."""
    values = jnp.asarray(rng.randint(-127, 128, (out_features, in_features)), jnp.int8)  # [O, I]
    scales = jnp.asarray(rng.uniform(0.5, 4.0, out_features) / 127.0, jnp.float32)  # [O]
    return values, scales


def as_bf16_in_float64(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32), np.float64)


class ReferenceByHandTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_reference_by_hand(self):
        # x rounds to bf16 first: 1 + 2^-10 -> 1 (bf16 keeps 8 significant bits), so x = [1, 2].
        # Row 0: (1*1 + 2*2) * 0.5 = 2.5.  Row 1: (-3*1 + 4*2) * 0.25 = 1.25.
        values = jnp.array([[1, 2], [-3, 4]], jnp.int8)
        scales = jnp.array([0.5, 0.25], jnp.float32)
        x = jnp.array([[1.0 + 2.0**-10], [2.0]], jnp.float32)  # [I, N] = [2, 1]
        out = self.variant(w8a16_matmul_reference)(values, scales, x)
        chex.assert_trees_all_equal(out, jnp.array([[2.5], [1.25]], jnp.float32))


def test_reference_matches_float64_within_its_rounding_bound():
    """values * scales @ bf16(x) in float64 is the exact answer; the reference sums I exact
    products in float32 and scales once, so each output is off by at most
    (gamma_I + u) * scale * (|values| @ |x|), gamma_I = I u / (1 - I u), u = 2^-24."""
    out_features, in_features, tokens = 576, 1536, 5
    rng = np.random.RandomState(0)
    values, scales = random_weight(rng, out_features, in_features)
    x = jnp.asarray(rng.randn(in_features, tokens), jnp.float32)
    out = w8a16_matmul_reference(values, scales, x)
    chex.assert_shape(out, (out_features, tokens))
    assert out.dtype == jnp.float32

    values64, scales64, x64 = np.asarray(values, np.float64), np.asarray(scales, np.float64), as_bf16_in_float64(x)
    exact = (values64 * scales64[:, None]) @ x64  # [O, N]
    u = FLOAT32_UNIT_ROUNDOFF
    gamma = in_features * u / (1 - in_features * u)
    bound = (gamma + u) * scales64[:, None] * (np.abs(values64) @ np.abs(x64))
    error = np.abs(np.asarray(out, np.float64) - exact)
    worst = np.unravel_index(np.argmax(error - bound), error.shape)
    assert np.all(error <= bound), f"error {error[worst]:.3g} > bound {bound[worst]:.3g} at {worst}"


# (O, I, N, x dtype, tile limits): what each case reaches.
KERNEL_CASES = [
    (576, 1536, 1, jnp.float32, {}),  # decode at the model's down projection: N padded 1 -> 16
    (576, 1536, 5, jnp.bfloat16, {}),  # a verify of 5 tokens, x already bf16
    (200, 96, 37, jnp.float32, {}),  # O padded 200 -> 256, I in 3 blocks of 32, N padded 37 -> 64
    (200, 96, 37, jnp.bfloat16, dict(block_o=16, block_i=16, block_n=16)),  # 13 x 3 programs, 6 steps of I
    (48, 80, 2, jnp.float32, dict(block_o=16, block_i=16, block_n=16)),  # I in 5 blocks of 16
]


@pytest.mark.parametrize("out_features, in_features, tokens, x_dtype, tiles", KERNEL_CASES)
def test_kernel_matches_reference(out_features, in_features, tokens, x_dtype, tiles):
    rng = np.random.RandomState(out_features + tokens)
    values, scales = random_weight(rng, out_features, in_features)
    x = jnp.asarray(rng.randn(in_features, tokens), x_dtype)
    ours = w8a16_matmul_pallas(values, scales, x, interpret=INTERPRET, **tiles)
    reference = w8a16_matmul_reference(values, scales, x)
    chex.assert_shape(ours, (out_features, tokens))
    assert ours.dtype == jnp.float32
    chex.assert_tree_all_finite(ours)
    assert max_relative_error(ours, reference) < KERNEL_TOLERANCE


def test_x_is_rounded_to_bf16_once_on_the_way_in():
    """float32 x and the same x already in bf16 are the same operand to both paths, bit for bit."""
    rng = np.random.RandomState(3)
    values, scales = random_weight(rng, 64, 48)
    x = jnp.asarray(rng.randn(48, 3), jnp.float32)
    for matmul in (functools.partial(w8a16_matmul_pallas, block_i=16, interpret=INTERPRET),
                   w8a16_matmul_reference):
        chex.assert_trees_all_equal(matmul(values, scales, x), matmul(values, scales, x.astype(jnp.bfloat16)))


def test_dispatch_follows_the_switch():
    rng = np.random.RandomState(4)
    values, scales = random_weight(rng, 64, 64)
    x = jnp.asarray(rng.randn(64, 4), jnp.float32)
    reference = w8a16_matmul_reference(values, scales, x)
    chex.assert_trees_all_equal(w8a16_matmul(values, scales, x, implementation="reference"), reference)
    interpreted = w8a16_matmul(values, scales, x, implementation=Implementation.INTERPRET)
    assert max_relative_error(interpreted, reference) < KERNEL_TOLERANCE
    auto_path = w8a16_matmul_reference if INTERPRET else w8a16_matmul_pallas
    chex.assert_trees_all_equal(w8a16_matmul(values, scales, x), auto_path(values, scales, x))


def test_auto_takes_the_kernel_only_where_it_is_built_for():
    assert kernel_supports(576, 576, 1) and kernel_supports(49152, 576, MAX_KERNEL_TOKENS)
    assert not kernel_supports(576, 576, MAX_KERNEL_TOKENS + 1)  # prefill: XLA's own GEMM tiling
    assert not kernel_supports(200, 576, 5) and not kernel_supports(576, 100, 5)  # would copy the weight
    auto_on_supported = Implementation.REFERENCE if INTERPRET else Implementation.PALLAS
    assert resolve_implementation("auto", 576, 576, 5) is auto_on_supported
    assert resolve_implementation("auto", 576, 576, MAX_KERNEL_TOKENS + 1) is Implementation.REFERENCE
    assert resolve_implementation("auto", 200, 576, 5) is Implementation.REFERENCE
    assert resolve_implementation("interpret", 200, 576, 5) is Implementation.INTERPRET
    with pytest.raises(InvalidRequestError, match="unknown matmul implementation 'fast'"):
        resolve_implementation("fast", 576, 576, 5)


@pytest.mark.skipif(not INTERPRET, reason="on a GPU the native kernel is allowed")
def test_native_kernel_off_gpu_is_refused():
    values, scales = random_weight(np.random.RandomState(5), 16, 16)
    x = jnp.zeros((16, 1), jnp.float32)
    with pytest.raises(InvalidRequestError, match="implementation='pallas'.*GPU.*backend is 'cpu'"):
        w8a16_matmul(values, scales, x, implementation="pallas")
    with pytest.raises(InvalidRequestError, match="w8a16_matmul_pallas.*GPU.*interpret=True"):
        w8a16_matmul_pallas(values, scales, x)


@pytest.mark.parametrize("out_features, in_features, tokens", [(49152, 576, 64), (576, 1536, 2), (200, 96, 37)])
def test_native_kernel_lowers_to_triton_for_cuda(monkeypatch, out_features, in_features, tokens):
    """Exporting for CUDA runs Pallas's Triton lowering of the kernel even without a GPU (every op
    needs a Triton rule, every tile a Triton shape); only Triton's own compile is left for a GPU
    (bench/gpu_run.sh). The backend check is told it is on a GPU so the native path is taken."""
    from jax import export

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    triton_calls = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    matmul = jax.jit(functools.partial(w8a16_matmul, implementation="pallas"))
    exported = export.export(matmul, platforms=["cuda"], disabled_checks=triton_calls)(
        jax.ShapeDtypeStruct((out_features, in_features), jnp.int8),
        jax.ShapeDtypeStruct((out_features,), jnp.float32),
        jax.ShapeDtypeStruct((in_features, tokens), jnp.bfloat16))
    assert "__gpu$xla.gpu.triton" in exported.mlir_module()
    assert exported.out_avals[0].shape == (out_features, tokens)


def test_bad_input_is_named():
    values, scales = random_weight(np.random.RandomState(6), 32, 16)
    x = jnp.zeros((16, 2), jnp.float32)
    for matmul in (w8a16_matmul_reference, functools.partial(w8a16_matmul_pallas, interpret=True), w8a16_matmul):
        with pytest.raises(UnsupportedModelError, match=r"int8\[O, I\]; got float32\[32, 16\]"):
            matmul(values.astype(jnp.float32), scales, x)
        with pytest.raises(UnsupportedModelError, match=r"int8\[O, I\]; got int8\[512\]"):
            matmul(values.reshape(-1), scales, x)
        with pytest.raises(InvalidRequestError, match=r"scales must be float\[O=32\].*got float32\[16\]"):
            matmul(values, scales[:16], x)
        with pytest.raises(InvalidRequestError, match=r"scales must be float\[O=32\].*got int32\[32\]"):
            matmul(values, scales.astype(jnp.int32), x)
        with pytest.raises(InvalidRequestError, match=r"x must be float\[I=16, N\].*got float32\[32, 2\]"):
            matmul(values, scales, jnp.zeros((32, 2)))
        with pytest.raises(InvalidRequestError, match=r"x must be float\[I=16, N\].*got float32\[16\]"):
            matmul(values, scales, jnp.zeros((16,)))
        with pytest.raises(InvalidRequestError, match=r"x must be float\[I=16, N\].*got int32\[16, 2\]"):
            matmul(values, scales, x.astype(jnp.int32))
    for tiles in (dict(block_o=8), dict(block_i=48), dict(block_n=0)):
        (name, block), = tiles.items()
        with pytest.raises(InvalidRequestError, match=f"{name}={block} must be a power of two >= 16"):
            w8a16_matmul_pallas(values, scales, x, interpret=True, **tiles)
