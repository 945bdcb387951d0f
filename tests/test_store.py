"""The orbax weight cache and converted directories (jaxspec.checkpoints.store).

A cache hit must skip dequantization (counted through the one decoding seam,
`checkpoints.gguf.dequantize`), and a damaged or interrupted entry must never reach a model.
"""

from __future__ import annotations

import json
import os
import pathlib
import time

import gguf
import jax
import numpy as np
import pytest

import ckpt_fixtures as fx
from ckpt_fixtures import hf_dirs, isolated_cache, tiny_gguf  # noqa: F401 (fixtures)
from jaxspec import checkpoints
from jaxspec.checkpoints import gguf as gguf_reader
from jaxspec.checkpoints import store
from jaxspec.config import Architecture
from jaxspec.errors import CheckpointError, UnsupportedModelError
from conftest import requires_default_model


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch) -> pathlib.Path:
    """An empty cache for tests that count cache misses (the tiny GGUFs repeat across tests)."""
    path = tmp_path / "cache"
    monkeypatch.setenv("JAXSPEC_CACHE_DIR", str(path))
    return path


@pytest.fixture
def count_dequantize(monkeypatch) -> list[int]:
    calls = [0]
    real = gguf_reader.dequantize

    def counting(raw, qtype):
        calls[0] += 1
        return real(raw, qtype)

    monkeypatch.setattr(gguf_reader, "dequantize", counting)
    return calls


def test_cache_hit_skips_dequantization(tiny_gguf, count_dequantize, fresh_cache):
    path, expected = tiny_gguf
    fx.assert_params_equal(checkpoints.load_checkpoint(path).params, expected)
    assert count_dequantize[0] > 0
    entry = store.gguf_cache_entry(path)
    assert entry.parent.parent == fresh_cache and checkpoints.file_sha256(path) in entry.name and entry.is_dir()
    count_dequantize[0] = 0
    again = checkpoints.load_checkpoint(path)
    assert count_dequantize[0] == 0
    fx.assert_params_equal(again.params, expected)
    assert again.tokenizer_source["tokenizer.ggml.tokens"] == fx.TOKENS
    # use_cache=False bypasses it.
    checkpoints.load_checkpoint(path, use_cache=False)
    assert count_dequantize[0] > 0


def test_cache_is_keyed_by_content(tiny_gguf, hf_dirs, fresh_cache):
    path, _ = tiny_gguf
    checkpoints.load_checkpoint(path)
    directory, state_dict = hf_dirs["llama-tied"]
    expected = fx.write_gguf(path, state_dict, fx.hf_config(directory))  # same path, new content
    fx.assert_params_equal(checkpoints.load_checkpoint(path).params, expected)


def test_corrupt_cache_entry_is_rebuilt(tiny_gguf, count_dequantize, fresh_cache):
    path, expected = tiny_gguf
    checkpoints.load_checkpoint(path)
    entry = store.gguf_cache_entry(path)
    for file in entry.rglob("*"):
        if file.is_file():
            file.write_bytes(b"garbage")
    count_dequantize[0] = 0
    fx.assert_params_equal(checkpoints.load_checkpoint(path).params, expected)
    assert count_dequantize[0] > 0
    count_dequantize[0] = 0
    checkpoints.load_checkpoint(path)  # and the rebuilt entry is good
    assert count_dequantize[0] == 0


def test_a_stray_file_at_an_entry_path_is_replaced(tiny_gguf, count_dequantize, fresh_cache, caplog):
    path, expected = tiny_gguf
    entry = store.gguf_cache_entry(path)
    entry.parent.mkdir(parents=True, exist_ok=True)
    entry.write_bytes(b"not a directory")
    fx.assert_params_equal(checkpoints.load_checkpoint(path).params, expected)
    assert entry.is_dir() and "a file where a cache entry directory belongs" in caplog.text
    count_dequantize[0] = 0
    checkpoints.load_checkpoint(path)  # cached again
    assert count_dequantize[0] == 0


def test_a_gguf_whose_tokenizer_fails_leaves_no_cache_entry(hf_dirs, tmp_path, monkeypatch, fresh_cache):
    """An entry is written only for a file that loads whole: params dequantized, tokenizer built."""
    directory, state_dict = hf_dirs["llama-untied"]
    monkeypatch.setattr(fx, "MERGES", ["t o x", "to k"])  # "t o x" is not a merge of two tokens
    path = tmp_path / "bad-merges.gguf"
    fx.write_gguf(path, state_dict, fx.hf_config(directory))
    with pytest.raises(CheckpointError, match="tokenizer.ggml.merges"):
        checkpoints.load_checkpoint(path)
    assert not store.gguf_cache_entry(path).exists()


def test_a_file_that_fails_to_parse_does_not_wait_for_its_hash(tmp_path, fresh_cache):
    """The hash runs beside the parse; a parse that fails cancels it. A 32 GB file (sparse: no
    disk used) with a bad header must be refused at once, not after 32 GB have been read."""
    path = tmp_path / "huge.gguf"
    with open(path, "wb") as handle:
        handle.write(b"NOPE")
        handle.truncate(32 << 30)
    start = time.perf_counter()
    with pytest.raises(CheckpointError, match="not a GGUF file|magic"):
        checkpoints.load_checkpoint(path)
    assert time.perf_counter() - start < 5.0
    assert not (fresh_cache / "params").exists() or not any((fresh_cache / "params").iterdir())


def test_interrupted_cache_write_leaves_no_entry(tiny_gguf, monkeypatch, count_dequantize, fresh_cache):
    path, expected = tiny_gguf
    entry = store.gguf_cache_entry(path)
    real_save = store.save_params

    def interrupted(params, target):
        real_save(params, target)
        raise KeyboardInterrupt  # after orbax wrote everything, before our rename

    monkeypatch.setattr(store, "save_params", interrupted)
    with pytest.raises(KeyboardInterrupt):
        checkpoints.load_checkpoint(path)
    assert not entry.exists()
    assert not list(entry.parent.glob(".tmp-*"))
    monkeypatch.setattr(store, "save_params", real_save)
    fx.assert_params_equal(checkpoints.load_checkpoint(path).params, expected)
    count_dequantize[0] = 0
    checkpoints.load_checkpoint(path)
    assert count_dequantize[0] == 0


@pytest.fixture
def converted(tiny_gguf, tmp_path) -> pathlib.Path:
    return checkpoints.convert(tiny_gguf[0], tmp_path / "converted")


def rewrite_meta(directory: pathlib.Path, **changes) -> None:
    meta = json.loads((directory / checkpoints.JAXSPEC_META).read_text())
    meta.update(changes)
    meta = {key: value for key, value in meta.items() if value is not None}
    (directory / checkpoints.JAXSPEC_META).write_text(json.dumps(meta))


def test_converted_directory_records_its_family(converted, tiny_gguf):
    meta = json.loads((converted / checkpoints.JAXSPEC_META).read_text())
    assert (meta["format"], meta["format_version"], meta["family"]) == ("jaxspec", store.FORMAT_VERSION, "llama")
    assert (converted / store.GGUF_TOKENIZER_FILE).is_file()
    # Directories written before families existed have no "family": they hold a Llama config.
    rewrite_meta(converted, family=None)
    fx.assert_params_equal(checkpoints.load_checkpoint(converted).params, tiny_gguf[1])


@pytest.mark.parametrize("changes, error, message", [
    (dict(format_version=99), CheckpointError, f"format_version 99; this jaxspec reads {store.FORMAT_VERSION}"),
    (dict(family="rwkv"), UnsupportedModelError, "model family 'rwkv' is not known"),
    (dict(config={"dim": 8}), CheckpointError, "holds no valid llama config"),
])
def test_converted_directory_metadata_errors_are_named(converted, changes, error, message):
    rewrite_meta(converted, **changes)
    with pytest.raises(error, match=message):
        checkpoints.load_checkpoint(converted)


@pytest.mark.real_model
@requires_default_model
def test_default_model(fresh_cache, count_dequantize):
    """The real default GGUF: its config, tokenizer metadata, a cache hit, and values checked
    against gguf's own reader. The first load is a cache miss (a fresh cache); the hit is
    proved by the work it does not do (no dequantization). Its time is printed beside the miss's,
    not asserted: since the miss saves from device arrays, the two are close enough on shared
    cores for load from other work to order them either way."""
    start = time.perf_counter()
    ckpt = checkpoints.load_checkpoint("smollm2-135m")
    jax.block_until_ready(ckpt.params)
    first_s = time.perf_counter() - start
    assert count_dequantize[0] >= 272  # every tensor of the file (and maybe dequantizable probes): a miss
    cfg = ckpt.config
    assert cfg.architecture is Architecture.LLAMA
    assert (cfg.num_layers, cfg.dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 576, 9, 3, 64)
    assert (cfg.vocab_size, cfg.ffn_dim, cfg.rotary_dim) == (49152, 1536, 64)
    assert cfg.tie_embeddings and ckpt.params.lm_head is None
    assert cfg.rope_theta == 100000.0 and cfg.norm_eps == 1e-5
    assert (cfg.bos_token_id, cfg.eos_token_ids, cfg.max_position_embeddings) == (1, (2,), 8192)
    assert ckpt.source.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert checkpoints.resolve_model("SmolLM2-135M-Instruct") == ckpt.source
    assert len(ckpt.tokenizer_source["tokenizer.ggml.tokens"]) == 49152
    assert len(ckpt.tokenizer_source["tokenizer.ggml.merges"]) == 48900
    assert ckpt.tokenizer_source["tokenizer.ggml.tokens"][:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

    # Cache hit: no dequantization at all.
    count_dequantize[0] = 0
    second_s = []
    for _ in range(2):
        start = time.perf_counter()
        again = checkpoints.load_checkpoint("smollm2-135m")
        jax.block_until_ready(again.params)
        second_s.append(time.perf_counter() - start)
    print(f"default model: first load {first_s:.2f} s, cached loads {', '.join(f'{s:.2f}' for s in second_s)} s")
    assert count_dequantize[0] == 0

    # An independent path: gguf's own reader and dequantizer, with the test's own unpermute.
    reader = gguf.GGUFReader(ckpt.source)
    by_name = {t.name: t for t in reader.tensors}
    layer = again.params.layers[7]
    pairs = {
        "token_embd.weight": again.params.embed,  # Q8_0
        "blk.7.ffn_down.weight": layer.mlp.down_proj,  # Q4_1
        "blk.7.attn_norm.weight": layer.attn_norm,  # F32
        "output_norm.weight": again.params.final_norm,
    }
    for name, got in pairs.items():
        tensor = by_name[name]
        want = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(got.shape)
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=name)
    for name, got, heads in [("blk.7.attn_q.weight", layer.attention.q_proj, 9),
                              ("blk.7.attn_k.weight", layer.attention.k_proj, 3)]:
        tensor = by_name[name]
        stored = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        np.testing.assert_array_equal(fx.llama_cpp_permute(np.asarray(got), heads), stored, err_msg=name)
    summary = checkpoints.info("smollm2-135m")
    assert summary["tensor_types"] == {"F32": 61, "Q4_1": 210, "Q8_0": 1}
    assert summary["param_count"] == 134515008
    assert summary["file_size_bytes"] == os.path.getsize(ckpt.source)

