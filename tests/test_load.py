"""The entry points (jaxspec.checkpoints.load): load, info and convert, for every family and format.

Done means: `info` and `convert` work on a GGUF file, a Llama HF directory and a Qwen3.5 HF
directory, and the converted copy generates exactly the source's tokens.
"""

from __future__ import annotations

import pathlib

import jax
import pytest

import ckpt_fixtures as fx
import jaxspec
from ckpt_fixtures import hf_dirs, isolated_cache, tiny_gguf  # noqa: F401 (fixtures)
from jaxspec import checkpoints
from conftest import requires_default_model
from jaxspec.errors import CheckpointError
from jaxspec.models import backends


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



# ---------------------------------------------------------------------------------------------
# Every family and format: info, convert, and the converted copy generates the same tokens
# ---------------------------------------------------------------------------------------------

PROMPT = [[5, 17, 42, 9, 3, 11]]  # token ids: the HF directories here carry no tokenizer


def greedy_tokens(model: jaxspec.Model) -> list[list[int]]:
    return jaxspec.generate(model, prompt=PROMPT, max_new_tokens=8, ignore_eos=True).tokens


@pytest.fixture(scope="module")
def sources(hf_dirs, tmp_path_factory) -> dict[str, pathlib.Path]:
    """One small checkpoint per (format, family): a GGUF, a Llama HF dir, a Qwen3.5 HF dir."""
    root = tmp_path_factory.mktemp("sources")
    llama_dir, state_dict = hf_dirs["llama-untied"]
    gguf_path = root / "llama.gguf"
    fx.write_gguf(gguf_path, state_dict, fx.hf_config(llama_dir))
    llama_hf = fx.copy_dir(llama_dir, root / "llama-hf")
    (llama_hf / "tokenizer.json").unlink()  # no tokenizer at all: loads with none
    qwen35_hf = root / "qwen35-hf"
    fx.make_qwen35_checkpoint(qwen35_hf)
    return {"gguf": gguf_path, "llama-hf": llama_hf, "qwen35-hf": qwen35_hf}


@pytest.mark.parametrize("name, fmt, family, architecture", [
    ("gguf", "gguf", "llama", "llama"),
    ("llama-hf", "hf", "llama", "llama"),
    ("qwen35-hf", "hf", "qwen3_5", "qwen3_5"),
])
def test_info_convert_and_the_copy_generates_the_same_tokens(sources, tmp_path, name, fmt, family, architecture):
    source = sources[name]
    summary = checkpoints.info(source)
    assert (summary["format"], summary["family"], summary["architecture"]) == (fmt, family, architecture)
    original = jaxspec.load(str(source))
    # (counted in the standard layout: weights packed for the native CPU kernels carry padding rows)
    standard = backends.standard(original.params)
    assert summary["param_count"] == sum(leaf.size for leaf in jax.tree.leaves(standard))

    out = checkpoints.convert(source, tmp_path / "converted")
    converted_summary = checkpoints.info(out)
    assert (converted_summary["format"], converted_summary["family"]) == ("jaxspec", family)
    assert converted_summary["param_count"] == summary["param_count"]
    copy = jaxspec.load(str(out))
    assert copy.config == original.config
    assert (copy.tokenizer is None) == (original.tokenizer is None) == (name != "gguf")
    fx.assert_params_equal(copy.params, jax.device_get(original.params))
    assert greedy_tokens(copy) == greedy_tokens(original)


@pytest.mark.real_model
@requires_default_model
def test_default_model_info_convert_round_trip(tmp_path):
    """The real default GGUF (the one test that converts it: ~0.5 GB of float32 written)."""
    summary = checkpoints.info("smollm2-135m")
    assert (summary["format"], summary["family"], summary["num_layers"]) == ("gguf", "llama", 30)
    original = jaxspec.load("smollm2-135m")
    out = checkpoints.convert("smollm2-135m", tmp_path / "smollm2")
    assert checkpoints.info(out)["param_count"] == sum(leaf.size for leaf in jax.tree.leaves(original.params))
    copy = jaxspec.load(str(out))
    assert copy.config == original.config and copy.products == original.products
    prompt = "The capital of France is"
    assert copy.tokenizer.encode(prompt) == original.tokenizer.encode(prompt)
    fx.assert_params_equal(copy.params, jax.device_get(original.params))  # all 30 layers, bit for bit
    # and the copy generates: through its first 4 layers, final norm and head (one program for both,
    # a seventh of the whole model's compile; the params above are the same in every layer)
    assert (jaxspec.generate(jaxspec.layer_skip(copy, 4), prompt=prompt, max_new_tokens=8).tokens
            == jaxspec.generate(jaxspec.layer_skip(original, 4), prompt=prompt, max_new_tokens=8).tokens)


def test_a_checkpoint_without_a_tokenizer_serves_token_ids_only(sources):
    model = jaxspec.load(str(sources["llama-hf"]))
    assert model.tokenizer is None
    with pytest.raises(jaxspec.InvalidRequestError, match="no tokenizer: pass token ids"):
        jaxspec.generate(model, prompt="hello", max_new_tokens=2)
