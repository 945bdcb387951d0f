"""GGUF files (jaxspec.checkpoints.gguf): the header parser, dequantization, a family's params.

Ground truth is independent of jaxspec: gguf.quants round trips of the HF weights (permuted as
llama.cpp does, by ckpt_fixtures' own writer), and gguf.GGUFReader for offsets.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest

import ckpt_fixtures as fx
from ckpt_fixtures import hf_dirs, isolated_cache, tiny_gguf  # noqa: F401 (fixtures)
from jaxspec import checkpoints
from jaxspec.errors import CheckpointError, UnsupportedModelError

QT = gguf.GGMLQuantizationType


@pytest.mark.parametrize("variant", ["llama-untied", "llama-tied", "qwen2-bias", "qwen3-qknorm-tied"])
def test_gguf_matches_dequantized_hf_weights(hf_dirs, tmp_path, variant):
    """Q4_1 / Q8_0 / F16 / BF16 / F32 tensors, Q/K permuted as llama.cpp does (llama only)."""
    directory, state_dict = hf_dirs[variant]
    path = tmp_path / "model.gguf"
    expected = fx.write_gguf(path, state_dict, fx.hf_config(directory))
    ckpt = checkpoints.load_checkpoint(path, use_cache=False)
    # The same model read from HF and from GGUF gets the same config.
    assert ckpt.config == checkpoints.load_checkpoint(directory).config
    fx.assert_params_equal(ckpt.params, expected)
    types = checkpoints.info(path)["tensor_types"]
    assert {"F32", "F16", "BF16", "Q8_0", "Q4_1"} <= set(types)


def test_gguf_f32_is_exact(hf_dirs, tmp_path):
    directory, state_dict = hf_dirs["llama-untied"]
    path = tmp_path / "f32.gguf"
    fx.write_gguf(path, state_dict, fx.hf_config(directory), all_f32=True)
    ckpt = checkpoints.load_checkpoint(path, use_cache=False)
    fx.assert_params_equal(ckpt.params, fx.expected_params(state_dict, 2, tie=False))


def test_gguf_unpermute_is_what_makes_it_match(hf_dirs, tmp_path):
    """Reading a Llama GGUF as if unpermuted would differ: the test above is not vacuous."""
    directory, state_dict = hf_dirs["llama-untied"]
    path = tmp_path / "f32.gguf"
    fx.write_gguf(path, state_dict, fx.hf_config(directory), all_f32=True)
    raw_q = checkpoints.read_gguf(path).tensor("blk.0.attn_q.weight")
    assert not np.array_equal(raw_q, state_dict["model.layers.0.self_attn.q_proj.weight"])


def test_read_gguf_header(hf_dirs, tmp_path):
    directory, state_dict = hf_dirs["qwen3-qknorm-tied"]
    path = tmp_path / "q3.gguf"
    fx.write_gguf(path, state_dict, fx.hf_config(directory))
    gf = checkpoints.read_gguf(path)
    assert gf.architecture == "qwen3"
    assert gf.metadata["qwen3.attention.key_length"] == 32
    assert gf.metadata["qwen3.attention.layer_norm_rms_epsilon"] == 1e-5  # float32, shortest repr
    assert gf.metadata["tokenizer.ggml.tokens"] == fx.TOKENS
    assert gf.metadata["tokenizer.ggml.merges"] == fx.MERGES
    assert gf.metadata["tokenizer.ggml.token_type"] == [1] * len(fx.TOKENS)
    info = gf.tensors["blk.1.attn_q.weight"]
    assert info.shape == (4 * 32, 64) and info.qtype == QT.Q4_1
    reference = gguf.GGUFReader(path)
    for tensor in reference.tensors:  # offsets agree with the reference reader
        assert gf.tensors[tensor.name].offset == tensor.data_offset
        np.testing.assert_array_equal(gf.raw(tensor.name).reshape(-1), tensor.data.view(np.uint8).reshape(-1))
    tokenizer = checkpoints.load_checkpoint(path, use_cache=False).tokenizer_source
    assert tokenizer["tokenizer.ggml.model"] == "gpt2"
    assert tokenizer["tokenizer.ggml.bos_token_id"] == 1 and tokenizer["tokenizer.ggml.eos_token_id"] == 2
    assert tokenizer["tokenizer.chat_template"] == "{{ messages }}"
    assert tokenizer["tokenizer.ggml.add_bos_token"] is False
    assert all(key.startswith("tokenizer.") for key in tokenizer)


@pytest.mark.parametrize(("keep", "problem"), [(0.5, "truncated: tensor '.*' ends at byte"), (0.01, "truncated: its header")])
def test_truncated_gguf(tiny_gguf, tmp_path, keep, problem):
    """Cut mid-data (a tensor runs off the end) or mid-header."""
    path, _ = tiny_gguf
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(CheckpointError, match=problem) as err:
        checkpoints.load_checkpoint(cut)
    assert str(cut) in str(err.value)


def test_bad_magic(tmp_path):
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"GGML" + bytes(100))
    with pytest.raises(CheckpointError, match="bad magic") as err:
        checkpoints.load_checkpoint(path)
    assert str(path) in str(err.value)


def test_gguf_unsupported_architecture(hf_dirs, tmp_path):
    directory, state_dict = hf_dirs["llama-untied"]
    path = tmp_path / "gpt2.gguf"
    fx.write_gguf(path, state_dict, fx.hf_config(directory), arch="gpt2")
    with pytest.raises(UnsupportedModelError, match="'gpt2'"):
        checkpoints.load_checkpoint(path)


def test_gguf_unsupported_quant_type(hf_dirs, tmp_path):
    directory, state_dict = hf_dirs["llama-untied"]
    path = tmp_path / "q8k.gguf"
    block_size, type_size = gguf.GGML_QUANT_SIZES[QT.Q8_K]
    odd = np.zeros((4, type_size), np.uint8)  # 4 rows of one Q8_K block: [4, 256]
    fx.write_gguf(path, state_dict, fx.hf_config(directory), extra_tensors={"extra.weight": (odd, QT.Q8_K)})
    with pytest.raises(UnsupportedModelError, match="Q8_K") as err:
        checkpoints.load_checkpoint(path, use_cache=False)
    assert "extra.weight" in str(err.value)


def test_gguf_missing_tensor(hf_dirs, tmp_path):
    directory, state_dict = hf_dirs["llama-untied"]
    path = tmp_path / "missing.gguf"
    fx.write_gguf(path, state_dict, fx.hf_config(directory), skip=("blk.1.ffn_up.weight",))
    with pytest.raises(CheckpointError, match="blk.1.ffn_up.weight"):
        checkpoints.load_checkpoint(path, use_cache=False)

