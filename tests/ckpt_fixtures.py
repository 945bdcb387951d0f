"""Tiny checkpoints the checkpoint tests write themselves: HF directories and GGUF files.

Also the fixtures the checkpoint test modules share (import them by name: `from ckpt_fixtures
import hf_dirs`): a private weight cache, the HF variants, a tiny GGUF. torch and transformers
are imported only inside the functions that write HF checkpoints.

The GGUF writer here mirrors llama.cpp's convert_hf_to_gguf.py (tensor names, metadata keys and
LlamaModel.permute of Q/K rows) independently of jaxspec.checkpoints, so a loader bug cannot hide
behind a shared helper.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import gguf
import jax
import numpy as np
import pytest

from jaxspec.models.layers import AttentionParams, LlamaLayer, MlpParams
from jaxspec.models.llama import LlamaParams

QT = gguf.GGMLQuantizationType

# Tiny shapes: D=64, F=128, N=4, K=2, H=16, V=128, L=2 (row lengths are whole 32-blocks).
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)

# model_type -> the transformers config class that writes it (looked up when a checkpoint is made,
# so importing these fixtures does not import torch).
_CONFIG_CLASSES = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}


def make_hf_checkpoint(
    directory: pathlib.Path,
    *,
    model_type: str = "llama",
    tie: bool = False,
    dtype: str = "float32",
    max_shard_size: str | None = None,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """Save a random tiny HF model; returns its state dict as float32 numpy (the ground truth).

    Every parameter, norms and biases included, is drawn at random so that a swapped or
    misnamed tensor cannot pass by being all ones or zeros. `dtype` names a torch dtype.
    """
    import torch
    import transformers

    extra: dict[str, Any] = {"tie_word_embeddings": tie, "rope_theta": 50000.0}
    if model_type == "qwen3":
        extra["head_dim"] = 32  # != D/N, as in real Qwen3: exercises attention.key_length
    if model_type == "qwen2":
        extra["use_sliding_window"] = False
    config = getattr(transformers, _CONFIG_CLASSES[model_type])(**TINY, **extra)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.5)
    model = model.to(getattr(torch, dtype))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, safe_serialization=True, **kwargs)
    (directory / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "BPE"}}))
    state = {name: tensor.float().numpy().copy() for name, tensor in model.state_dict().items()}
    if tie:  # state_dict() lists the tied head; the saved file (and jaxspec) do not
        state.pop("lm_head.weight", None)
    return state


def expected_params(state_dict: dict[str, np.ndarray], num_layers: int, *, tie: bool) -> LlamaParams:
    """The jaxspec params pytree written out by hand from HF names."""

    def optional(name: str) -> np.ndarray | None:
        return state_dict.get(name)

    layers = []
    for i in range(num_layers):
        p = f"model.layers.{i}."
        attention = AttentionParams(
            q_proj=state_dict[p + "self_attn.q_proj.weight"],
            k_proj=state_dict[p + "self_attn.k_proj.weight"],
            v_proj=state_dict[p + "self_attn.v_proj.weight"],
            o_proj=state_dict[p + "self_attn.o_proj.weight"],
            q_bias=optional(p + "self_attn.q_proj.bias"),
            k_bias=optional(p + "self_attn.k_proj.bias"),
            v_bias=optional(p + "self_attn.v_proj.bias"),
            q_norm=optional(p + "self_attn.q_norm.weight"),
            k_norm=optional(p + "self_attn.k_norm.weight"),
        )
        mlp = MlpParams(gate_proj=state_dict[p + "mlp.gate_proj.weight"], up_proj=state_dict[p + "mlp.up_proj.weight"],
                        down_proj=state_dict[p + "mlp.down_proj.weight"])
        layers.append(LlamaLayer(attn_norm=state_dict[p + "input_layernorm.weight"], attention=attention,
                                 mlp_norm=state_dict[p + "post_attention_layernorm.weight"], mlp=mlp))
    return LlamaParams(embed=state_dict["model.embed_tokens.weight"], layers=tuple(layers),
                       final_norm=state_dict["model.norm.weight"],
                       lm_head=None if tie else state_dict["lm_head.weight"])


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute, verbatim in numpy."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def quant_roundtrip(w: np.ndarray, qtype: QT) -> np.ndarray:
    """What a loader must return for `w` stored as `qtype`: dequantize(quantize(w))."""
    if qtype == QT.F32:
        return w.astype(np.float32)
    return gguf.quants.dequantize(gguf.quants.quantize(w.astype(np.float32), qtype), qtype).reshape(w.shape)


# HF tensor suffix -> (GGUF suffix, ggml type used in the tiny files)
_GGUF_LAYER = {
    "input_layernorm.weight": ("attn_norm.weight", QT.F32),
    "self_attn.q_proj.weight": ("attn_q.weight", QT.Q4_1),
    "self_attn.k_proj.weight": ("attn_k.weight", QT.Q8_0),
    "self_attn.v_proj.weight": ("attn_v.weight", QT.F16),
    "self_attn.o_proj.weight": ("attn_output.weight", QT.BF16),
    "self_attn.q_proj.bias": ("attn_q.bias", QT.F32),
    "self_attn.k_proj.bias": ("attn_k.bias", QT.F32),
    "self_attn.v_proj.bias": ("attn_v.bias", QT.F32),
    "self_attn.q_norm.weight": ("attn_q_norm.weight", QT.F32),
    "self_attn.k_norm.weight": ("attn_k_norm.weight", QT.F32),
    "post_attention_layernorm.weight": ("ffn_norm.weight", QT.F32),
    "mlp.gate_proj.weight": ("ffn_gate.weight", QT.Q8_0),
    "mlp.up_proj.weight": ("ffn_up.weight", QT.Q4_1),
    "mlp.down_proj.weight": ("ffn_down.weight", QT.F32),
}
_GGUF_TOP = {
    "model.embed_tokens.weight": ("token_embd.weight", QT.Q8_0),
    "model.norm.weight": ("output_norm.weight", QT.F32),
    "lm_head.weight": ("output.weight", QT.Q4_1),
}

# A loadable byte-level BPE vocabulary: "t o" and "to k" merge tokens of the list into "tok".
TOKENS = ["t", "o", "k", "to", "tok"]
TOKENS += [f"tok{i}" for i in range(TINY["vocab_size"] - len(TOKENS))]
MERGES = ["t o", "to k"]


def write_gguf(
    path: pathlib.Path,
    state_dict: dict[str, np.ndarray],
    hf_config: dict[str, Any],
    *,
    arch: str | None = None,
    all_f32: bool = False,
    extra_tensors: dict[str, tuple[np.ndarray, QT]] | None = None,
    skip: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Write a GGUF from HF weights as llama.cpp would; returns the expected jaxspec params.

    Q/K rows are permuted for the llama architecture only (llama.cpp's Qwen2/Qwen3 converters
    do not permute). The expected params are dequantize(quantize(w)) of the *HF* weights.
    """
    arch = arch or hf_config["model_type"]
    n_head, n_kv = hf_config["num_attention_heads"], hf_config["num_key_value_heads"]
    dim = hf_config["hidden_size"]
    head_dim = hf_config.get("head_dim") or dim // n_head
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(hf_config["num_hidden_layers"])
    writer.add_context_length(hf_config["max_position_embeddings"])
    writer.add_embedding_length(dim)
    writer.add_feed_forward_length(hf_config["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    rope = hf_config.get("rope_parameters") or {}
    writer.add_rope_freq_base(float(rope.get("rope_theta", hf_config.get("rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(hf_config["rms_norm_eps"])
    writer.add_rope_dimension_count(head_dim)
    if head_dim != dim // n_head:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(TOKENS)
    writer.add_token_types([1] * len(TOKENS))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(hf_config["bos_token_id"])
    writer.add_eos_token_id(hf_config["eos_token_id"])
    writer.add_add_bos_token(False)
    writer.add_chat_template("{{ messages }}")

    expected: dict[str, np.ndarray] = {}
    for hf_name, w in state_dict.items():
        if hf_name in _GGUF_TOP:
            gguf_name, qtype = _GGUF_TOP[hf_name]
        else:
            layer = int(hf_name.split(".")[2])
            suffix = hf_name.split(".", 3)[3]
            gguf_suffix, qtype = _GGUF_LAYER[suffix]
            gguf_name = f"blk.{layer}.{gguf_suffix}"
        if all_f32 or w.ndim == 1:
            qtype = QT.F32
        expected[hf_name] = quant_roundtrip(w, qtype)
        if gguf_name in skip:
            continue
        stored = w
        if arch == "llama" and suffix_is(hf_name, "q_proj"):
            stored = llama_cpp_permute(w, n_head)
        elif arch == "llama" and suffix_is(hf_name, "k_proj"):
            stored = llama_cpp_permute(w, n_kv)
        _add(writer, gguf_name, stored, qtype)
    for name, (data, qtype) in (extra_tensors or {}).items():
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected_params(expected, hf_config["num_hidden_layers"], tie="lm_head.weight" not in state_dict)


def suffix_is(hf_name: str, proj: str) -> bool:
    return f"self_attn.{proj}." in hf_name


def _add(writer: gguf.GGUFWriter, name: str, w: np.ndarray, qtype: QT) -> None:
    w = np.ascontiguousarray(w, dtype=np.float32)
    if qtype == QT.F32:
        writer.add_tensor(name, w)
    elif qtype == QT.F16:
        writer.add_tensor(name, w.astype(np.float16))
    else:
        writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)


def hf_config(directory: pathlib.Path) -> dict[str, Any]:
    return json.loads((directory / "config.json").read_text())


def assert_params_equal(actual: Any, expected: Any) -> None:
    """Same tree, float32 jax arrays, bit-identical values."""
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(actual), jax.tree.leaves(expected)):
        name = jax.tree_util.keystr(path)
        assert isinstance(got, jax.Array), name
        assert got.dtype == np.float32, name
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=name)


@pytest.fixture(scope="module", autouse=True)
def isolated_cache(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """Every test in a module that imports this caches under tmp, never in ~/.cache."""
    path = tmp_path_factory.mktemp("jaxspec-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JAXSPEC_CACHE_DIR", str(path))
        yield path


HF_VARIANTS = {
    "llama-untied": dict(model_type="llama", tie=False),
    "llama-tied": dict(model_type="llama", tie=True),
    "qwen2-bias": dict(model_type="qwen2", tie=False),
    "qwen3-qknorm-tied": dict(model_type="qwen3", tie=True),
    "llama-bf16": dict(model_type="llama", tie=False, dtype="bfloat16"),
    "llama-sharded": dict(model_type="llama", tie=False, max_shard_size="40KB"),
}


class HFDirs(dict):
    """HF_VARIANTS name -> (directory, ground-truth state dict), each written on first use."""

    def __init__(self, factory: pytest.TempPathFactory):
        super().__init__()
        self._factory = factory

    def __missing__(self, name: str) -> tuple[pathlib.Path, dict[str, np.ndarray]]:
        directory = self._factory.mktemp(name)
        self[name] = directory, make_hf_checkpoint(directory, **HF_VARIANTS[name])
        return self[name]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> HFDirs:
    return HFDirs(tmp_path_factory)


@pytest.fixture
def tiny_gguf(hf_dirs, tmp_path) -> tuple[pathlib.Path, dict]:
    """A GGUF written from the untied Llama variant, and the params it must load as."""
    directory, state_dict = hf_dirs["llama-untied"]
    path = tmp_path / "tiny.gguf"
    return path, write_gguf(path, state_dict, hf_config(directory))


def copy_dir(src: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
    """A copy of a (flat) checkpoint directory, for tests that damage it."""
    dst.mkdir()
    for file in src.iterdir():
        (dst / file.name).write_bytes(file.read_bytes())
    return dst


# A tiny Qwen3.5 hybrid: three Gated DeltaNet layers then one attention layer (HF's default
# pattern), partial RoPE, untied head.
QWEN35_TEXT = dict(vocab_size=96, hidden_size=48, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                   linear_key_head_dim=8, linear_value_head_dim=12, max_position_embeddings=256, rms_norm_eps=1e-5,
                   linear_conv_kernel_dim=4, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                   rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25))


def make_qwen35_checkpoint(directory: pathlib.Path, *, seed: int = 0) -> None:
    """Save a random tiny Qwen3.5 text model (transformers' qwen3_5) with safetensors."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**QWEN35_TEXT))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):  # decay rates in the range a trained model has
                param.copy_(torch.empty(param.shape).uniform_(0.05, 2.0).log())
            else:
                param.normal_(0.0, 0.3)
    model.save_pretrained(directory, safe_serialization=True)
