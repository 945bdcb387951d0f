"""HF directories (jaxspec.checkpoints.safetensors): weights, shards, dtypes, and what is refused.

Ground truth is the torch state dict of a tiny random model of each variant (ckpt_fixtures).
"""

from __future__ import annotations

import json

import pytest
from safetensors.numpy import load_file, save_file

import ckpt_fixtures as fx
from ckpt_fixtures import hf_dirs, isolated_cache  # noqa: F401 (fixtures)
import jaxspec
from jaxspec import checkpoints
from jaxspec.config import config_from_hf
from jaxspec.errors import CheckpointError, UnsupportedModelError


@pytest.mark.parametrize("variant", list(fx.HF_VARIANTS))
def test_hf_dir_matches_torch_state_dict(hf_dirs, variant):
    directory, state_dict = hf_dirs[variant]
    tie = fx.HF_VARIANTS[variant]["tie"]
    ckpt = checkpoints.load_checkpoint(directory)
    assert ckpt.config == config_from_hf(fx.hf_config(directory))
    assert ckpt.config.tie_embeddings is tie
    fx.assert_params_equal(ckpt.params, fx.expected_params(state_dict, ckpt.config.num_layers, tie=tie))
    assert ckpt.tokenizer_source == directory
    assert ckpt.source == directory


def test_hf_variants_exercise_what_they_claim(hf_dirs):
    """Guard the fixtures: bias, QK-norm, bf16 storage and sharding really are there."""
    qwen2 = checkpoints.load_checkpoint(hf_dirs["qwen2-bias"][0])
    assert qwen2.config.attention_bias and qwen2.params.layers[0].attention.q_bias is not None
    qwen3 = checkpoints.load_checkpoint(hf_dirs["qwen3-qknorm-tied"][0])
    assert qwen3.config.qk_norm and qwen3.params.layers[0].attention.q_norm.shape == (32,)
    assert qwen3.config.head_dim == 32 != qwen3.config.dim // qwen3.config.num_heads
    assert checkpoints.info(hf_dirs["llama-bf16"][0])["tensor_types"] == {"BF16": 21}
    sharded = hf_dirs["llama-sharded"][0]
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("model-*.safetensors"))) > 2


def test_hf_missing_tensor(hf_dirs, tmp_path):
    directory = fx.copy_dir(hf_dirs["llama-untied"][0], tmp_path / "hf")
    tensors = load_file(directory / "model.safetensors")
    del tensors["model.layers.1.self_attn.v_proj.weight"]
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.v_proj\.weight"):
        checkpoints.load_checkpoint(directory)


def test_hf_shape_mismatch(hf_dirs, tmp_path):
    directory = fx.copy_dir(hf_dirs["llama-untied"][0], tmp_path / "hf")
    config = fx.hf_config(directory)
    config["intermediate_size"] = 96
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"gate_proj\.weight.*\(128, 64\).*\(96, 64\)"):
        checkpoints.load_checkpoint(directory)


def test_hf_missing_config(hf_dirs, tmp_path):
    directory = fx.copy_dir(hf_dirs["llama-untied"][0], tmp_path / "hf")
    (directory / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json") as err:
        checkpoints.load_checkpoint(directory)
    assert str(directory) in str(err.value)


def test_hf_unsupported_model_type(hf_dirs, tmp_path):
    directory = fx.copy_dir(hf_dirs["llama-untied"][0], tmp_path / "hf")
    config = fx.hf_config(directory)
    config["model_type"] = "gpt_neox"
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="gpt_neox"):
        checkpoints.load_checkpoint(directory)


def test_hf_pickle_only_is_refused(hf_dirs, tmp_path):
    directory = fx.copy_dir(hf_dirs["llama-untied"][0], tmp_path / "hf")
    (directory / "model.safetensors").unlink()
    (directory / "pytorch_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(CheckpointError, match="safetensors is required"):
        checkpoints.load_checkpoint(directory)


def test_hf_missing_shard(hf_dirs, tmp_path):
    directory = fx.copy_dir(hf_dirs["llama-sharded"][0], tmp_path / "hf")
    shard = sorted(directory.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=shard.name):
        checkpoints.load_checkpoint(directory)



@pytest.mark.parametrize("escape", ["../outside/model-00001.safetensors", "/etc/passwd", "link/model.safetensors"])
def test_a_shard_index_pointing_outside_the_directory_is_refused(hf_dirs, tmp_path, escape):
    """A weight_map entry is a file inside the model directory, never one reached through `..`,
    an absolute path or a symlink out of it."""
    directory = fx.copy_dir(hf_dirs["llama-sharded"][0], tmp_path / "hf")
    outside = tmp_path / "outside"
    outside.mkdir()
    for shard in directory.glob("model-*.safetensors"):
        (outside / shard.name).write_bytes(shard.read_bytes())
    (directory / "link").symlink_to(outside, target_is_directory=True)
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = escape
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"shard .* of '{first}' lies outside"):
        checkpoints.load_checkpoint(directory)


@pytest.mark.parametrize("key, value", [("hidden_size", "abc"), ("num_attention_heads", 0),
                                        ("rope_scaling", [1, 2]), ("eos_token_id", 2.5)])
def test_a_config_value_of_the_wrong_type_is_a_checkpoint_error(hf_dirs, tmp_path, key, value):
    """Never a raw ValueError / ZeroDivisionError / AttributeError from a config value: an error
    naming config.json."""
    directory = fx.copy_dir(hf_dirs["llama-untied"][0], tmp_path / "hf")
    config = fx.hf_config(directory)
    config[key] = value
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(jaxspec.JaxspecError, match="config"):
        checkpoints.load_checkpoint(directory)


@pytest.mark.parametrize("key, value, message", [
    ("rope_theta", float("nan"), r"rope_theta=nan must be a finite number > 0"),
    ("rope_theta", float("inf"), r"rope_theta=inf must be a finite number > 0"),
    ("rms_norm_eps", 0.0, r"norm_eps=0.0 must be a finite number > 0"),
    ("rms_norm_eps", -1e-6, r"norm_eps=-1e-06 must be a finite number > 0"),
    ("max_position_embeddings", 0, r"max_position_embeddings=0 must be >= 1"),
    ("intermediate_size", -1, r"ffn_dim=-1 must be >= 1"),
    ("tie_word_embeddings", "false", r"tie_word_embeddings must be true or false; got 'false'"),
])
def test_a_config_value_that_makes_no_sense_is_refused_by_name(hf_dirs, tmp_path, key, value, message):
    """Values of the right type that cannot describe a model (a NaN theta would make every RoPE
    angle NaN; "false" is a truthy string that would drop lm_head) are refused, naming the field."""
    directory = fx.copy_dir(hf_dirs["llama-untied"][0], tmp_path / "hf")
    config = fx.hf_config(directory)
    config[key] = value
    if key in config.get("rope_parameters", {}):  # transformers 5 keeps theta there too, and it wins
        config["rope_parameters"][key] = value
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(jaxspec.JaxspecError, match=rf"config\.json: .*{message}"):
        checkpoints.load_checkpoint(directory)


@pytest.mark.parametrize("count", [1, 3, 0, -1, 10**9, "2", 2.0, True])
def test_num_hidden_layers_must_match_the_layers_in_the_weights(hf_dirs, tmp_path, count):
    """A count other than the weights' layers (or not an integer) is refused before the parse sizes
    anything by it: 1 on a 2-layer checkpoint would load one layer and ignore the rest."""
    directory, _ = hf_dirs["llama-untied"]
    damaged = fx.copy_dir(directory, tmp_path / "count")
    config = fx.hf_config(damaged)
    assert config["num_hidden_layers"] == 2
    (damaged / "config.json").write_text(json.dumps(config | {"num_hidden_layers": count}))
    with pytest.raises(CheckpointError, match="num_hidden_layers is") as err:
        checkpoints.load_checkpoint(damaged)
    assert "config.json" in str(err.value)


@pytest.mark.parametrize("damage", ["truncated", "foreign"])
def test_a_damaged_shard_is_a_checkpoint_error_naming_it(hf_dirs, tmp_path, damage):
    directory = fx.copy_dir(hf_dirs["llama-sharded"][0], tmp_path / "hf")
    shard = sorted(directory.glob("model-*.safetensors"))[1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\x00" * len(data))
    with pytest.raises(CheckpointError, match="not a readable safetensors file") as err:
        checkpoints.load_checkpoint(directory)
    assert shard.name in str(err.value)
