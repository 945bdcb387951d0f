"""Family descriptors (jaxspec.models.family) and their registry (jaxspec.models).

Every registered family's trees must agree leaf for leaf: the shapes and the tensor names each
checkpoint format gives them, all instances of the family's params type (their logical axes are
the type's, tests/test_params.py).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from jaxspec import models
from jaxspec.config import ModelConfig
from tests.conftest import GEMMA_CONFIGS, HYBRID_CONFIG, LLAMA_CONFIGS
from jaxspec.errors import UnsupportedModelError
from jaxspec.models import gemma, llama, qwen35
from jaxspec.models.family import TensorSource
from jaxspec.models.params import is_shape

QWEN35_CONFIG = HYBRID_CONFIG
CONFIGS = {**LLAMA_CONFIGS, "qwen3_5-hybrid": QWEN35_CONFIG, **GEMMA_CONFIGS}
INIT = {ModelConfig: llama.init_params, qwen35.Qwen35Config: qwen35.init_params, gemma.GemmaConfig: gemma.init_params}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def case(request):
    cfg = CONFIGS[request.param]
    params = INIT[type(cfg)](cfg, jax.random.PRNGKey(0))  # tiny: built for real, not traced
    return cfg, models.family_of(cfg), params


def test_shapes_are_what_init_params_builds(case):
    cfg, family, params = case
    assert jax.tree.map(lambda leaf: leaf.shape, params) == family.param_shapes(cfg)


def test_tensor_trees_match_the_shapes_and_name_each_leaf_once(case):
    cfg, family, _ = case
    structure = jax.tree.structure(family.param_shapes(cfg), is_leaf=is_shape)
    layouts = [family.hf_tensors(cfg, prefix) for prefix in family.hf_prefixes]
    if family.gguf_tensors is not None and getattr(cfg, "generation", 3) == 3:  # llama.cpp's gemma3, not 4
        layouts += [family.gguf_tensors(cfg, arch) for arch in family.gguf_architectures]
    for tensors in layouts:
        assert jax.tree.structure(tensors) == structure
        names = [tensor.name for tensor in jax.tree.leaves(tensors)]
        assert all(isinstance(t, TensorSource) for t in jax.tree.leaves(tensors))
        assert len(set(names)) == len(names)


def test_config_dict_round_trip(case):
    cfg, family, _ = case
    assert family.config_from_dict(family.config_to_dict(cfg)) == cfg


def test_llama_gguf_permutes_q_and_k_for_llama_and_mistral_only():
    cfg = LLAMA_CONFIGS["llama-untied"]
    rows = np.arange(cfg.num_heads * cfg.head_dim, dtype=np.float32)[:, None]
    permuted_q = llama.gguf_tensors(cfg, "llama").layers[0].attention.q_proj
    assert not np.array_equal(permuted_q.apply(rows), rows)
    assert llama.gguf_tensors(cfg, "qwen2").layers[0].attention.q_proj.apply(rows) is rows
    assert llama.gguf_tensors(cfg, "llama").layers[0].attention.v_proj.transform is None


def test_unpermute_inverts_llama_cpp_permute():
    import ckpt_fixtures as fx

    rng = np.random.default_rng(0)
    for n_head, head_dim in [(4, 16), (3, 64), (2, 8)]:
        w = rng.standard_normal((n_head * head_dim, 24)).astype(np.float32)
        permuted = fx.llama_cpp_permute(w, n_head)
        assert not np.array_equal(permuted, w)
        np.testing.assert_array_equal(llama.unpermute_rows(permuted, n_head), w)
        bias = w[:, 0].copy()
        np.testing.assert_array_equal(llama.unpermute_rows(fx.llama_cpp_permute(bias, n_head), n_head), bias)


def test_qwen35_hf_tensors_add_one_to_zero_centred_norms_only():
    tensors = qwen35.hf_tensors(QWEN35_CONFIG, "model.")
    zeros = np.zeros(4, np.float32)
    np.testing.assert_array_equal(tensors.final_norm.apply(zeros), zeros + 1)
    np.testing.assert_array_equal(tensors.layers[1].attention.q_norm.apply(zeros), zeros + 1)
    np.testing.assert_array_equal(tensors.layers[0].delta_net.out_norm.apply(zeros), zeros)  # gated norm: as stored
    assert tensors.layers[0].delta_net.conv_weight.apply(np.zeros((6, 1, 4))).shape == (6, 4)
    assert tensors.lm_head.name == "lm_head.weight"  # never under the trunk's prefix


def test_registry_dispatch():
    assert models.family_for_hf({"model_type": "mellum"}) is llama.FAMILY
    assert models.family_for_hf({"model_type": "qwen3_5_text"}) is qwen35.FAMILY
    assert models.family_for_gguf("mistral", "x.gguf") is llama.FAMILY
    assert models.family_named("qwen3_5") is qwen35.FAMILY
    with pytest.raises(UnsupportedModelError, match="'gpt_neox'.*qwen3_5"):
        models.family_for_hf({"model_type": "gpt_neox"})
    with pytest.raises(UnsupportedModelError, match="'gpt2' in x.gguf"):
        models.family_for_gguf("gpt2", "x.gguf")
    with pytest.raises(UnsupportedModelError, match="'nope'"):
        models.family_named("nope")
    with pytest.raises(UnsupportedModelError, match="no trunk family registered for config type dict"):
        models.family_of({})


def test_a_family_that_claims_a_registered_model_type_is_refused():
    clash = dataclasses.replace(qwen35.FAMILY, name="other", config_class=dict, hf_model_types=("llama",))
    with pytest.raises(RuntimeError, match="overlaps the registered 'llama'"):  # a registry bug, not bad input
        models.register_family(clash)
    assert "other" not in models.FAMILIES
