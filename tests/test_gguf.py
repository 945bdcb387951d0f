"""GGUF files (jaxspec.checkpoints.gguf): the header parser, dequantization, a family's params.

Ground truth is independent of jaxspec: gguf.quants round trips of the HF weights (permuted as
llama.cpp does, by ckpt_fixtures' own writer), and gguf.GGUFReader for offsets.
"""

from __future__ import annotations

import pathlib
import struct

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



# --- Tensor infos checked against the file (hostile input) ------------------------------------

def _info_fields(data: bytes, name: str) -> dict[str, int]:
    """Byte positions of one tensor info's fields in a GGUF header: n_dims, each ne, type, offset."""
    key = struct.pack("<Q", len(name)) + name.encode()
    at = data.index(key) + len(key)
    n_dims = struct.unpack_from("<I", data, at)[0]
    fields = {"n_dims": at, **{f"ne{i}": at + 4 + 8 * i for i in range(n_dims)}}
    fields["type"] = at + 4 + 8 * n_dims
    fields["offset"] = fields["type"] + 4
    return fields


def _mutated(path, tmp_path, name: str, field: str, fmt: str, value) -> "pathlib.Path":
    data = bytearray(path.read_bytes())
    struct.pack_into(fmt, data, _info_fields(bytes(data), name)[field], value)
    out = tmp_path / "mutated.gguf"
    out.write_bytes(bytes(data))
    return out


@pytest.mark.parametrize(("name", "field", "fmt", "value", "problem"), [
    # A Q4_1 tensor re-declared Q4_0 in place: the same shape in fewer bytes, read as other numbers.
    ("blk.0.attn_q.weight", "type", "<I", int(QT.Q4_0), "changed in place"),
    # An F32 norm re-declared I32: its bit patterns would load as integers.
    ("blk.0.attn_norm.weight", "type", "<I", int(QT.I32), "integer type"),
    ("blk.0.ffn_gate.weight", "offset", "<Q", 64, "starts at data offset 64"),
    ("blk.0.attn_norm.weight", "n_dims", "<I", 0, "has 0 dims"),
    ("blk.0.attn_norm.weight", "ne0", "<Q", 0, "has shape"),
    ("blk.0.attn_norm.weight", "ne0", "<Q", 2**62, "ends at byte|changed in place"),
], ids=["q4_1-as-q4_0", "f32-as-i32", "shifted-offset", "no-dims", "empty-dim", "huge-dim"])
def test_corrupt_tensor_infos_are_refused_naming_the_tensor(tiny_gguf, tmp_path, name, field, fmt, value, problem):
    path, _ = tiny_gguf
    bad = _mutated(path, tmp_path, name, field, fmt, value)
    with pytest.raises(CheckpointError, match=problem) as err:
        checkpoints.load_checkpoint(bad, use_cache=False)
    assert str(bad) in str(err.value) or name in str(err.value)


def test_a_tensor_declared_twice_is_refused(tiny_gguf, tmp_path):
    path, _ = tiny_gguf
    data = path.read_bytes()
    # Rename one tensor to its neighbour's name of the same length: two infos, one name.
    first, second = b"blk.0.ffn_up.weight", b"blk.1.ffn_up.weight"
    bad = tmp_path / "twice.gguf"
    bad.write_bytes(data.replace(second, first, 1))
    with pytest.raises(CheckpointError, match="declared twice"):
        checkpoints.load_checkpoint(bad, use_cache=False)


@pytest.mark.parametrize("block_count", [1, 3, 0, 0xFFFFFFFF])
def test_block_count_must_match_the_layers_in_the_file(hf_dirs, tmp_path, block_count):
    """A count other than the file's layers is refused before anything is sized by it (0xFFFFFFFF
    would build four billion layers; 1 on a 2-layer file would silently load one)."""
    directory, state_dict = hf_dirs["llama-untied"]
    config = fx.hf_config(directory)
    assert config["num_hidden_layers"] == 2
    path = tmp_path / "count.gguf"
    fx.write_gguf(path, state_dict, config)
    data = bytearray(path.read_bytes())
    key = b"llama.block_count"
    at = data.index(struct.pack("<Q", len(key)) + key) + 8 + len(key)
    assert struct.unpack_from("<I", data, at)[0] == gguf.GGUFValueType.UINT32
    struct.pack_into("<I", data, at + 4, block_count)
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"llama.block_count is \d+"):
        checkpoints.load_checkpoint(path, use_cache=False)


def test_a_renamed_tensor_is_refused_not_skipped(tiny_gguf, tmp_path):
    """output.weight renamed: without the check the model would load as tied (the embedding for
    a head) and the renamed tensor would be ignored; llama.cpp refuses such a file too."""
    path, _ = tiny_gguf
    bad = tmp_path / "renamed.gguf"
    name = b"output.weight"  # by its length prefix: not blk.*.attn_output.weight
    key = struct.pack("<Q", len(name)) + name
    bad.write_bytes(path.read_bytes().replace(key, struct.pack("<Q", len(name)) + b"outpuX.weight", 1))
    with pytest.raises(CheckpointError, match=r"does not use: 'outpuX.weight'"):
        checkpoints.load_checkpoint(bad, use_cache=False)


def test_numeric_metadata_stored_as_a_string_is_refused(hf_dirs, tmp_path, monkeypatch):
    """llama.attention.head_count = "4" (a string): int() would take it; the loader refuses it by file."""
    directory, state_dict = hf_dirs["llama-untied"]
    path = tmp_path / "string-count.gguf"
    monkeypatch.setattr(gguf.GGUFWriter, "add_head_count",
                        lambda self, n: self.add_string(f"{self.arch}.attention.head_count", str(n)))
    fx.write_gguf(path, state_dict, fx.hf_config(directory))
    with pytest.raises(CheckpointError, match=r"string-count.gguf: a config value has the wrong type.*'4'"):
        checkpoints.load_checkpoint(path, use_cache=False)
