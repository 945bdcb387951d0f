"""The shared model layers: hand-computed tiny cases (RMSNorm, rotate-half RoPE, the attention
output gate, SwiGLU, the logits head), and every RoPE scaling against transformers'
`ROPE_INIT_FUNCTIONS`."""

from __future__ import annotations

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.cache import KVCache
from jaxspec.config import ModelConfig, RopeScaling, RopeType, config_from_hf
from jaxspec.errors import UnsupportedModelError
from jaxspec.models import layers

# ----------------------------------------------------------------------------------------------
# Hand-computed cases
# ----------------------------------------------------------------------------------------------


class RmsNormTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_feature_major_by_hand(self):
        # x = [2, -2, 2, -2]: mean square 4, rms 2, so x / rms * w = [1, -1, 1, -1] * [1, 2, 3, 4].
        norm = self.variant(lambda x, w: layers.rms_norm(x, w, eps=0.0))
        out = norm(jnp.asarray([[2.0], [-2.0], [2.0], [-2.0]]), jnp.asarray([1.0, 2.0, 3.0, 4.0]))  # [D, B*T]
        chex.assert_shape(out, (4, 1))
        chex.assert_trees_all_close(out[:, 0], jnp.asarray([1.0, -2.0, 3.0, -4.0]))

    @chex.variants(with_jit=True, without_jit=True)
    def test_per_head_axis_and_eps(self):
        # Over H (axis 1) of [heads, H, B, T]: head 0 = [3, 4] (mean square 12.5), eps 3.5 -> rms 4.
        norm = self.variant(lambda x, w: layers.rms_norm(x, w, eps=3.5, axis=1))
        x = jnp.asarray([3.0, 4.0, 0.0, 0.0]).reshape(2, 2, 1, 1)
        out = norm(x, jnp.asarray([1.0, 10.0]))
        chex.assert_shape(out, (2, 2, 1, 1))
        chex.assert_trees_all_close(out[:, :, 0, 0], jnp.asarray([[0.75, 10.0], [0.0, 0.0]]))


@pytest.mark.parametrize("width", [1, 9, 64, 576])
def test_feature_sum_is_the_sum_and_the_same_bits_at_every_token_count(width):
    """rms_norm's sum over features: equal to np.sum within float32 rounding, along any axis, and
    each token's sum bitwise the same whether the stream carries 8 tokens or 512 (jnp.sum inside
    a fused trunk is not: a step and a verify at batch >= 8 parted under int8)."""
    x = np.random.default_rng(width).standard_normal((width, 512)).astype(np.float32)  # [D, N]
    total = jax.jit(layers.feature_sum)
    np.testing.assert_allclose(np.asarray(total(x))[0], x.astype(np.float64).sum(axis=0), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(total(x[:, :8])), np.asarray(total(x))[:, :8])
    chex.assert_shape(layers.feature_sum(jnp.asarray(x.T), axis=1), (512, 1))
    np.testing.assert_array_equal(np.asarray(layers.feature_sum(jnp.asarray(x.T), axis=1))[:, 0],
                                  np.asarray(total(x))[0])


class RopeTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_rotate_half_pairs_i_with_i_plus_half_and_passes_the_rest(self):
        # H = 6, R = 4: dim 0 pairs with 2, dim 1 with 3; dims 4, 5 pass through. Pair 0 turns by
        # 90 degrees (cos 0, sin 1): (x0, x2) = (1, 5) -> (x0 cos - x2 sin, x2 cos + x0 sin) = (-5, 1).
        # Pair 1 by 180 degrees: (x1, x3) = (2, 7) -> (-2, -7).
        rope = self.variant(lambda x, cos, sin: layers.apply_rope(x, cos, sin, rotary_dim=4))
        x = jnp.asarray([1.0, 2.0, 5.0, 7.0, 8.0, 9.0]).reshape(1, 6, 1, 1)  # [heads, H, B, T]
        cos = jnp.asarray([0.0, -1.0]).reshape(2, 1, 1)  # [R/2, B, T]
        sin = jnp.asarray([1.0, 0.0]).reshape(2, 1, 1)
        out = rope(x, cos, sin)
        chex.assert_shape(out, (1, 6, 1, 1))
        chex.assert_trees_all_close(out[0, :, 0, 0], jnp.asarray([-5.0, -2.0, 1.0, -7.0, 8.0, 9.0]))

    def test_tables_are_positions_times_inverse_frequencies(self):
        # theta = 100, R = 4: inverse frequencies 100^-(0/4), 100^-(2/4) = 1, 0.1.
        cfg = ModelConfig(vocab_size=4, dim=4, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=4, ffn_dim=4,
                          rotary_dim=4, rope_theta=100.0)
        cos, sin = layers.rope_tables(cfg, jnp.asarray([[0, 1, 2]]))
        chex.assert_shape((cos, sin), (2, 1, 3))
        angles = np.asarray([[0.0, 1.0, 2.0], [0.0, 0.1, 0.2]])
        chex.assert_trees_all_close((cos[:, 0], sin[:, 0]), (np.cos(angles), np.sin(angles)), rtol=1e-6)

    def test_attention_scale_multiplies_cos_and_sin(self):
        scaling = RopeScaling(rope_type=RopeType.YARN, factor=4.0, original_max_position_embeddings=64)
        assert scaling.attention_scale == pytest.approx(0.1 * math.log(4.0) + 1.0)
        cfg = ModelConfig(vocab_size=4, dim=8, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=8, ffn_dim=4,
                          rotary_dim=8, rope_scaling=scaling)
        positions = jnp.asarray([[3, 40]])
        cos, sin = layers.rope_tables(cfg, positions)
        angles = layers.rope_inv_freq(8, cfg.rope_theta, scaling)[:, None] * np.asarray([3.0, 40.0])
        chex.assert_trees_all_close((cos[:, 0], sin[:, 0]),
                                    (np.cos(angles) * scaling.attention_scale, np.sin(angles) * scaling.attention_scale),
                                    rtol=1e-5)


# One head of width 2 over a model width of 2, identity q/k/v/o projections.
GATE_CFG = ModelConfig(vocab_size=4, dim=2, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=2, ffn_dim=2,
                       rotary_dim=2)
IDENTITY = jnp.eye(2)


@pytest.mark.parametrize("output_gate", [False, True])
def test_attention_output_gate_by_hand(output_gate):
    """One token on an empty cache attends only to itself, so the attention output is its own
    value v = h = [1, 2] (RoPE at position 0 is the identity). The gate rows G = [[0, 0],
    [ln 3, 0]] give gate = G h = [0, ln 3], sigmoid = [1/2, 3/4]: the output is [0.5, 1.5]."""
    gate_rows = jnp.asarray([[0.0, 0.0], [math.log(3.0), 0.0]])
    layer = layers.AttentionParams(q_proj=jnp.concatenate([IDENTITY, gate_rows]) if output_gate else IDENTITY,
                                   k_proj=IDENTITY, v_proj=IDENTITY, o_proj=IDENTITY,
                                   q_bias=None, k_bias=None, v_bias=None, q_norm=None, k_norm=None)
    cache = KVCache.create(GATE_CFG, batch=1, capacity=4)
    h = jnp.asarray([[1.0], [2.0]])  # [D, B*T]
    cos, sin = layers.rope_tables(GATE_CFG, jnp.zeros((1, 1), jnp.int32))
    out, keys, values = layers.self_attention(layer, GATE_CFG, h, cos, sin, cache.keys[0], cache.values[0],
                                              cache.length, 1, 1, output_gate=output_gate)
    chex.assert_shape(out, (2, 1))
    expected = [0.5, 1.5] if output_gate else [1.0, 2.0]
    chex.assert_trees_all_close(out[:, 0], jnp.asarray(expected), rtol=1e-6)
    chex.assert_trees_all_close(values[0, 0, 0], jnp.asarray([1.0, 2.0]))  # written at slot 0


def test_swiglu_by_hand():
    # D = F = 1: down * silu(gate x) * (up x) = 3 * silu(1) * 2, silu(1) = 1 / (1 + e^-1).
    layer = layers.MlpParams(gate_proj=jnp.asarray([[1.0]]), up_proj=jnp.asarray([[2.0]]),
                             down_proj=jnp.asarray([[3.0]]))
    out = layers.swiglu(layer, jnp.asarray([[1.0]]))
    chex.assert_trees_all_close(out, jnp.asarray([[6.0 / (1.0 + math.exp(-1.0))]]), rtol=1e-6)


def test_output_head_is_the_embedding_when_tied():
    embed, lm_head = jnp.zeros((3, 2)), jnp.ones((3, 2))
    assert layers.output_head(embed, None) is embed
    assert layers.output_head(embed, lm_head) is lm_head


def test_logits_head_selects_positions_per_row():
    head = jnp.asarray([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])  # [V=3, D=2]
    h = jnp.arange(12, dtype=jnp.float32).reshape(2, 6)  # [D, B*T], B = 2, T = 3
    full = layers.logits_head(head, h, batch=2, steps=3)
    chex.assert_shape(full, (2, 3, 3))
    # Row 0, position 1 is column 1 of h: features (1, 7) -> logits (1, 7, 8).
    chex.assert_trees_all_close(full[0, 1], jnp.asarray([1.0, 7.0, 8.0]))
    picked = layers.logits_head(head, h, batch=2, steps=3, logit_indices=jnp.asarray([[2], [0]]))
    chex.assert_shape(picked, (2, 1, 3))
    chex.assert_trees_all_close(picked[:, 0], jnp.stack([full[0, 2], full[1, 0]]))


# ----------------------------------------------------------------------------------------------
# RoPE scaling against transformers
# ----------------------------------------------------------------------------------------------

HF_BASE = dict(vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
               num_key_value_heads=1, max_position_embeddings=4096)
SCALINGS = {
    "linear": dict(rope_type="linear", factor=2.0, rope_theta=10000.0),
    "llama3": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=512, rope_theta=500000.0),
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=1024, rope_theta=10000.0),
    # DeepSeek's spelling: the attention factor from mscale / mscale_all_dim, own betas, no rounding.
    "yarn-mscale": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=1024, mscale=1.0,
                        mscale_all_dim=0.707, beta_fast=16, beta_slow=2, truncate=False, rope_theta=10000.0),
    "yarn-explicit-attention-factor": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=1024,
                                           attention_factor=0.8, rope_theta=10000.0),
    # Half-width RoPE: one short factor per rotated frequency; factor implied by the contexts.
    "longrope": dict(rope_type="longrope", short_factor=[1.0 + 0.1 * i for i in range(8)], long_factor=[2.0] * 8,
                     original_max_position_embeddings=1024, partial_rotary_factor=0.5, rope_theta=10000.0),
    "dynamic": dict(rope_type="dynamic", factor=2.0, rope_theta=10000.0),
}


@pytest.mark.parametrize("name", sorted(SCALINGS))
def test_scaled_inverse_frequencies_and_attention_factor_match_transformers(name):
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = transformers.LlamaConfig(**HF_BASE, rope_parameters=dict(SCALINGS[name]))
    # transformers' own values at initialisation (dynamic NTK: at any length up to the context).
    expected, attention_factor = ROPE_INIT_FUNCTIONS[SCALINGS[name]["rope_type"]](hf_config, None)
    cfg = config_from_hf(hf_config.to_dict())
    assert cfg.rope_scaling.rope_type is RopeType(SCALINGS[name]["rope_type"])
    ours = layers.rope_inv_freq(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling)
    chex.assert_shape(ours, (cfg.rotary_dim // 2,))
    np.testing.assert_allclose(ours, expected.numpy(), rtol=1e-6)
    assert cfg.rope_scaling.attention_scale == pytest.approx(attention_factor, rel=1e-12)


def test_longrope_serves_the_context_its_short_factors_cover():
    hf = {**HF_BASE, "model_type": "llama", "rope_parameters": dict(SCALINGS["longrope"])}
    assert config_from_hf(hf).rope_scaling.context_limit == 1024


@pytest.mark.parametrize("rope_parameters, message", [
    (dict(rope_type="proportional", rope_theta=10000.0), "'proportional' is not supported: it pairs rotated dims"),
    (dict(rope_type="ntk-by-parts", factor=2.0), r"'ntk-by-parts' is not supported; jaxspec reads \['default'"),
    (dict(rope_type="llama3", factor=8.0, original_max_position_embeddings=512), "needs.*low_freq_factor"),
    (dict(rope_type="linear"), "lacks its 'factor'"),
    (dict(rope_type="longrope", short_factor=[1.0] * 3, original_max_position_embeddings=1024), "needs one per frequency, 16"),
])
def test_unservable_rope_scalings_are_refused_by_name(rope_parameters, message):
    with pytest.raises(UnsupportedModelError, match=message):
        config_from_hf({**HF_BASE, "model_type": "llama", "rope_parameters": rope_parameters})
