"""The entry points (jaxspec.checkpoints.load): load, info and convert, for every family and format.

Done means: `info` and `convert` work on a GGUF file, a Llama HF directory and a Qwen3.5 HF
directory, and the converted copy generates exactly the source's tokens.
"""

from __future__ import annotations

import jax
import pytest

import ckpt_fixtures as fx
from ckpt_fixtures import hf_dirs, isolated_cache, tiny_gguf  # noqa: F401 (fixtures)
from jaxspec import checkpoints
from jaxspec.errors import CheckpointError


def test_convert_hf_round_trip(hf_dirs, tmp_path):
    directory, _ = hf_dirs["qwen2-bias"]
    original = checkpoints.load_checkpoint(directory)
    out = checkpoints.convert(directory, tmp_path / "converted")
    assert (out / "tokenizer.json").read_bytes() == (directory / "tokenizer.json").read_bytes()
    assert not (out / "config.json").exists()  # never mistaken for an HF directory
    loaded = checkpoints.load_checkpoint(out)
    assert loaded.config == original.config
    assert loaded.tokenizer_source == out and loaded.source == out
    fx.assert_params_equal(loaded.params, jax.device_get(original.params))
    assert checkpoints.info(out)["format"] == "jaxspec"
    with pytest.raises(CheckpointError, match="not empty"):
        checkpoints.convert(directory, out)
    for file in (out / "params").rglob("*"):
        if file.is_file():
            file.write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="cannot restore params"):
        checkpoints.load_checkpoint(out)


def test_convert_gguf_round_trip(tiny_gguf, tmp_path):
    path, expected = tiny_gguf
    original = checkpoints.load_checkpoint(path)
    out = checkpoints.convert(path, tmp_path / "from-gguf", progress=True)
    loaded = checkpoints.load_checkpoint(out)
    assert loaded.config == original.config
    assert loaded.tokenizer_source == original.tokenizer_source
    fx.assert_params_equal(loaded.params, expected)


def test_info_summaries(hf_dirs, tiny_gguf):
    path, _ = tiny_gguf
    gguf_info = checkpoints.info(path)
    hf_info = checkpoints.info(hf_dirs["llama-untied"][0])
    for summary in (gguf_info, hf_info):
        assert summary["architecture"] == "llama" and summary["num_layers"] == 2
        assert summary["dim"] == 64 and summary["vocab_size"] == 128
        # embed + lm_head + 2 layers of (2 norms + q,k,v,o + 3 mlp) + final norm
        assert summary["param_count"] == 2 * 128 * 64 + 2 * (2 * 64 + 64 * 64 * 2 + 32 * 64 * 2 + 3 * 128 * 64) + 64
        assert summary["file_size_bytes"] > 0
    assert gguf_info["format"] == "gguf" and hf_info["format"] == "hf"
    assert hf_info["tensor_types"] == {"F32": 21}

