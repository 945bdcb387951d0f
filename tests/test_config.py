"""Configs: HF config.json parsing and the JSON form converted directories store.

RoPE is parsed in one place (`config._rope_settings`, through `config_from_hf`) for every family:
Qwen3.5's parse must keep a Llama-3 scaling, not drop it.
"""

from __future__ import annotations

import json

import pytest

from jaxspec.config import (
    Architecture,
    RopeScaling,
    RopeType,
    config_from_dict,
    config_from_hf,
    config_to_dict,
    rope_scaling_from_dict,
)
from jaxspec.errors import UnsupportedModelError
from jaxspec.models import qwen35

LLAMA3_SCALING = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=64)
SCALED = RopeScaling(rope_type=RopeType.LLAMA3, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)
LLAMA_HF = dict(model_type="llama", vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, intermediate_size=24, rope_theta=5e5, rope_scaling=LLAMA3_SCALING,
                eos_token_id=[2, 3])
QWEN35_HF = dict(model_type="qwen3_5_text", vocab_size=64, hidden_size=32, intermediate_size=48,
                 num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8)


def test_llama_config_round_trips_through_json_with_its_rope_scaling():
    cfg = config_from_hf(LLAMA_HF)
    assert cfg.rope_scaling == SCALED and cfg.eos_token_ids == (2, 3) and cfg.architecture is Architecture.LLAMA
    assert config_from_dict(json.loads(json.dumps(config_to_dict(cfg)))) == cfg


def test_config_from_dict_refuses_fields_it_does_not_know():
    data = {**config_to_dict(config_from_hf(LLAMA_HF)), "sliding_window": 4}
    with pytest.raises(UnsupportedModelError, match="sliding_window"):
        config_from_dict(data)


def test_qwen35_reads_rope_through_the_shared_parse():
    scaled = qwen35.config_from_hf({**QWEN35_HF, "rope_parameters": {"rope_theta": 1e6, **LLAMA3_SCALING}})
    assert scaled.rope_scaling == SCALED and scaled.rope_theta == 1e6
    plain = qwen35.config_from_hf(QWEN35_HF)
    assert plain.rope_scaling is None and plain.rope_theta == qwen35.DEFAULT_ROPE_THETA
    assert qwen35.config_from_hf({**QWEN35_HF, "rope_theta": 5e4}).rope_theta == 5e4
    restored = qwen35.config_from_dict(json.loads(json.dumps(qwen35.config_to_dict(scaled))))
    assert restored == scaled


def test_qwen35_unsupported_rope_type_names_the_field():
    with pytest.raises(UnsupportedModelError, match="rope_type.*'proportional'"):
        qwen35.config_from_hf({**QWEN35_HF, "rope_parameters": {"rope_type": "proportional", "factor": 4.0}})


LONGROPE = dict(rope_type="longrope", short_factor=[1.0, 1.5], long_factor=[4.0] * 2,  # R/2 = 2 for both
                original_max_position_embeddings=48)


def test_longrope_context_is_capped_at_its_original_context():
    # transformers switches a whole forward to long_factor past the original context, which keys
    # already in the cache cannot follow: the served context stops there (RopeScaling.context_limit).
    llama = config_from_hf({**LLAMA_HF, "max_position_embeddings": 4096, "rope_scaling": LONGROPE})
    assert llama.rope_scaling.rope_type is RopeType.LONGROPE and llama.max_position_embeddings == 48
    hybrid = qwen35.config_from_hf({**QWEN35_HF, "max_position_embeddings": 4096,
                                    "rope_parameters": {"rope_theta": 1e6, **LONGROPE}})
    assert hybrid.max_position_embeddings == 48


def test_a_scaling_stored_before_rope_types_reads_as_llama3():
    stored = {key: value for key, value in LLAMA3_SCALING.items() if key != "rope_type"}
    assert rope_scaling_from_dict(stored) == SCALED
