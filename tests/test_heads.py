"""Draft-head checkpoints (jaxspec.checkpoints.heads): EAGLE-3 and jaxspec's own MTP head format.

Round trips are exact in float32; every way a head file can be wrong is named before anything is
built. (Heads inside a target's HF directory, both layouts, are tested against transformers in
test_mtp.py; EAGLE-3 tensor errors in test_eagle3.py.)
"""

from __future__ import annotations

import dataclasses
import json

import chex
import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxspec import checkpoints
from jaxspec.config import ModelConfig, RopeScaling, RopeType
from jaxspec.errors import CheckpointError
from jaxspec.models import eagle3, mtp

EAGLE3 = eagle3.Eagle3Config(dim=32, num_heads=2, num_kv_heads=1, head_dim=16, ffn_dim=48, draft_vocab_size=20,
                             vocab_size=40, rope_theta=10000.0, rotary_dim=16, norm_eps=1e-5,
                             max_position_embeddings=128, aux_layer_ids=(0, 1, 2))
MTP = mtp.MtpConfig(block=ModelConfig(vocab_size=40, dim=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                      head_dim=16, ffn_dim=48, rotary_dim=16, qk_norm=True),
                    hidden_first=True)


def test_eagle3_round_trip_is_exact(tmp_path):
    params = eagle3.init_params(EAGLE3, jax.random.PRNGKey(0))
    checkpoints.save_eagle3(tmp_path, EAGLE3, params)
    assert checkpoints.is_eagle3_dir(tmp_path) and not checkpoints.is_mtp_head_dir(tmp_path)
    cfg, loaded = checkpoints.load_eagle3(tmp_path)
    assert cfg == EAGLE3
    assert loaded.d2t.dtype == np.int32
    chex.assert_trees_all_equal(jax.device_get(loaded), jax.device_get(params), strict=False)


@pytest.mark.parametrize("scaling", [
    RopeScaling(rope_type=RopeType.LLAMA3, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=64),
    RopeScaling(rope_type=RopeType.YARN, factor=4.0, original_max_position_embeddings=32, beta_fast=16.0),
])
def test_eagle3_head_keeps_its_rope_scaling_through_save_and_load(tmp_path, scaling):
    scaled = dataclasses.replace(EAGLE3, rope_scaling=scaling)
    checkpoints.save_eagle3(tmp_path, scaled, eagle3.init_params(scaled, jax.random.PRNGKey(0)))
    cfg, _ = checkpoints.load_eagle3(tmp_path)
    assert cfg.rope_scaling == scaling and cfg == scaled


def test_eagle3_bf16_head_loads_as_float32(tmp_path):
    params = eagle3.init_params(EAGLE3, jax.random.PRNGKey(0))
    checkpoints.save_eagle3(tmp_path, EAGLE3, params, dtype=ml_dtypes.bfloat16)
    _, loaded = checkpoints.load_eagle3(tmp_path)
    assert loaded.fc.dtype == np.float32
    chex.assert_trees_all_close(dataclasses.replace(loaded, d2t=None), dataclasses.replace(params, d2t=None),
                                rtol=1e-2, atol=1e-3)


def test_eagle3_d2t_mapping_two_draft_ids_to_one_target_is_refused(tmp_path):
    params = eagle3.init_params(EAGLE3, jax.random.PRNGKey(0))
    d2t = np.asarray(params.d2t).copy()
    d2t[1] = d2t[0] - 1  # draft id 1 now maps where draft id 0 does
    checkpoints.save_eagle3(tmp_path, EAGLE3, dataclasses.replace(params, d2t=d2t))
    with pytest.raises(CheckpointError, match="two draft ids to the same target id"):
        checkpoints.load_eagle3(tmp_path)


def test_mtp_head_round_trip_is_exact(tmp_path):
    params = mtp.init_params(MTP, jax.random.PRNGKey(1))
    checkpoints.save_mtp_head(tmp_path, MTP, params)
    assert checkpoints.is_mtp_head_dir(tmp_path) and not checkpoints.is_eagle3_dir(tmp_path)
    cfg, loaded = checkpoints.load_mtp_head(tmp_path)
    assert cfg == MTP
    chex.assert_trees_all_equal(jax.device_get(loaded), jax.device_get(params), strict=False)


def test_mtp_head_tensor_of_the_wrong_shape_is_named(tmp_path):
    checkpoints.save_mtp_head(tmp_path, MTP, mtp.init_params(MTP, jax.random.PRNGKey(1)))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["block.k_norm"] = np.ones(8, np.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"'block.k_norm' has shape \(8,\), the config implies \(16,\)"):
        checkpoints.load_mtp_head(tmp_path)


def test_mtp_head_meta_that_is_not_a_config_is_named(tmp_path):
    checkpoints.save_mtp_head(tmp_path, MTP, mtp.init_params(MTP, jax.random.PRNGKey(1)))
    (tmp_path / checkpoints.MTP_HEAD_META).write_text(json.dumps({"format": "jaxspec-mtp-head"}))
    with pytest.raises(CheckpointError, match="is not a jaxspec MTP head config"):
        checkpoints.load_mtp_head(tmp_path)


def test_has_mtp_reads_the_config(tmp_path):
    assert not checkpoints.has_mtp(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert not checkpoints.has_mtp(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mellum", "num_nextn_predict_layers": 1}))
    assert checkpoints.has_mtp(tmp_path)
