"""Typed params (jaxspec.models.params): every family's and head's params dataclasses.

Each array leaf's field declares one logical axis name per dimension (what a sharding rule will
read), optional params are None exactly when the config has none, the typed trees pass through
jit unchanged, and the orbax store gives back the same typed tree.
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import models
from jaxspec.checkpoints import store
from tests.conftest import GEMMA_CONFIGS, HYBRID_CONFIG, LLAMA_CONFIGS
from jaxspec.errors import CheckpointError, InvalidRequestError
from jaxspec.models import eagle3, gemma, llama, mtp, qwen35
from jaxspec.models.layers import fuse_projections
from jaxspec.models.params import is_axes, logical_axes
from jaxspec.sharding import DEFAULT_RULES

QWEN35 = dataclasses.replace(HYBRID_CONFIG, tie_embeddings=True)
TRUNKS = {**LLAMA_CONFIGS, "qwen3_5-hybrid": QWEN35, **GEMMA_CONFIGS}
EAGLE3 = eagle3.Eagle3Config(dim=16, num_heads=2, num_kv_heads=1, head_dim=8, ffn_dim=24, draft_vocab_size=8,
                             vocab_size=32, rope_theta=10000.0, rotary_dim=8, norm_eps=1e-5,
                             max_position_embeddings=64)
MTP = mtp.MtpConfig(block=dataclasses.replace(LLAMA_CONFIGS["qwen3-qknorm"], num_layers=1))
# Every logical name a param carries has a sharding rule (jaxspec.sharding), so a mesh can place it.
AXIS_NAMES = set(DEFAULT_RULES) | {None}


def _init(name: str):
    key = jax.random.PRNGKey(0)
    if name == "eagle3-head":
        return eagle3.init_params(EAGLE3, key)
    if name == "mtp-head":
        return mtp.init_params(MTP, key)
    cfg = TRUNKS[name]
    init = {qwen35.Qwen35Config: qwen35.init_params, gemma.GemmaConfig: gemma.init_params}.get(type(cfg), llama.init_params)
    return init(cfg, key)


@pytest.fixture(scope="module", params=[*sorted(TRUNKS), "eagle3-head", "mtp-head", "llama-untied-fused"])
def case(request):
    if request.param.endswith("-fused"):  # q/k/v and gate/up fused, as load gives them
        return request.param, fuse_projections(_init(request.param.removesuffix("-fused")))
    return request.param, _init(request.param)  # tiny: built for real, not traced


def test_every_array_leaf_has_one_axis_name_per_dimension(case):
    name, params = case
    axes = logical_axes(params)
    assert type(axes) is type(params)
    # One axes tuple per array, in the same places: absent params are None in both trees.
    assert jax.tree.structure(axes, is_leaf=is_axes) == jax.tree.structure(params), name
    for (path, leaf), names in zip(jax.tree_util.tree_leaves_with_path(params),
                                   jax.tree.leaves(axes, is_leaf=is_axes), strict=True):
        assert len(names) == leaf.ndim, (name, jax.tree_util.keystr(path))
        assert set(names) <= AXIS_NAMES, (name, jax.tree_util.keystr(path), names)


def test_optional_params_are_none_exactly_when_the_config_has_none():
    untied, tied = _init("llama-untied"), _init("qwen2-bias-tied")
    assert untied.lm_head is not None and tied.lm_head is None
    assert untied.layers[0].attention.q_bias is None and tied.layers[0].attention.q_bias is not None
    assert untied.layers[0].attention.q_norm is None
    assert _init("qwen3-qknorm").layers[0].attention.k_norm.shape == (8,)
    hybrid = _init("qwen3_5-hybrid")
    assert [type(layer) for layer in hybrid.layers] == [qwen35.DeltaNetLayer, qwen35.FullAttentionLayer]
    assert hybrid.layers[1].attention.q_proj.shape == (2 * 2 * 8, 16)  # query and gate rows per head


@pytest.mark.parametrize("name", sorted(TRUNKS))
def test_family_axes_come_from_the_types_whatever_the_leaves(name):
    """The descriptor's shape tree is the params type too, so it reads the same axes."""
    cfg = TRUNKS[name]
    shapes = models.family_of(cfg).param_shapes(cfg)
    assert logical_axes(shapes) == logical_axes(_init(name))


def test_logical_axes_names_what_it_cannot_walk():
    with pytest.raises(InvalidRequestError, match="dict is not a params dataclass"):
        logical_axes({"embed": np.zeros((2, 2))})


@pytest.mark.parametrize("name", ["llama-untied", "qwen3_5-hybrid"])
def test_a_jitted_forward_takes_and_returns_the_typed_params_unchanged(name):
    cfg = TRUNKS[name]
    params = _init(name)

    @jax.jit
    def step(params, tokens, cache):
        logits, _, _ = models.forward(params, cfg, tokens, cache)
        return logits, params

    logits, returned = step(params, jnp.zeros((1, 2), jnp.int32), models.create_cache(cfg, 1, 8))
    chex.assert_shape(logits, (1, 2, cfg.vocab_size))
    chex.assert_trees_all_equal_structs(returned, params)
    assert type(returned) is type(params)
    chex.assert_trees_all_equal(returned, params)


def test_a_forward_on_untyped_params_is_refused_by_name():
    cfg = TRUNKS["llama-untied"]
    untyped = {"embed": np.zeros((cfg.vocab_size, cfg.dim), np.float32)}
    with pytest.raises(InvalidRequestError, match="llama params must be a LlamaParams; got dict"):
        models.forward(untyped, cfg, jnp.zeros((1, 1), jnp.int32), models.create_cache(cfg, 1, 4))


@pytest.mark.parametrize("name", sorted(TRUNKS))
def test_orbax_round_trip_restores_the_typed_tree(name, tmp_path):
    cfg = TRUNKS[name]
    params = jax.device_get(_init(name))
    store.save_params(params, tmp_path / "params")
    restored = store.restore_params(tmp_path / "params", models.family_of(cfg), cfg)
    assert type(restored) is type(params)
    chex.assert_trees_all_equal_structs(restored, params)
    chex.assert_trees_all_equal(restored, params)


def test_restoring_into_another_config_is_refused(tmp_path):
    """An entry of another structure (here: tied where the config is untied) never reaches a model."""
    store.save_params(jax.device_get(_init("qwen2-bias-tied")), tmp_path / "params")
    untied = dataclasses.replace(LLAMA_CONFIGS["qwen2-bias-tied"], tie_embeddings=False)
    with pytest.raises(CheckpointError, match="another structure than the llama config implies"):
        store.restore_params(tmp_path / "params", llama.FAMILY, untied)
