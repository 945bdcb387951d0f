"""Draft-head checkpoints: EAGLE-3 heads, and MTP heads in both formats jaxspec reads.

  * EAGLE-3: a directory of config.json + model.safetensors (`fc`, `midlayer.*`, `norm`,
    `lm_head`, the draft->target vocabulary map `d2t`), as the EAGLE-3 reference code saves it;
  * an MTP head inside its target's HF directory (`num_nextn_predict_layers`), in DeepSeek-V3's
    `model.layers.{L}.*` layout or the `mtp.*` tree of Qwen3-Next / Qwen3.5 / Mellum;
  * an MTP head on its own, as jaxspec.train writes it (`mtp_head.json` + model.safetensors).

Every tensor's presence, float dtype and shape is checked against what the head's config implies
before anything is built; a head's params are float32 jax arrays (`d2t` int32).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
from typing import Any

import jax
import numpy as np

from jaxspec.checkpoints.assemble import config_values_checked, to_jax
from jaxspec.checkpoints.resolve import HF_CONFIG, MTP_HEAD_META
from jaxspec.checkpoints.safetensors import SafetensorsReader, hf_prefix, hf_weight_files, read_json
from jaxspec.config import config_from_dict, config_to_dict, flag
from jaxspec.errors import CheckpointError, UnsupportedModelError
from jaxspec.models import assistant, eagle3, llama, mtp
from jaxspec.models.params import is_shape

# ----------------------------------------------------------------------------------------------
# EAGLE-3 draft heads
# ----------------------------------------------------------------------------------------------


# eagle3.TENSOR_NAMES name -> (tensor name in the checkpoint, shape as a function of the config); d2t apart
_EAGLE3_TENSORS = {
    "fc": ("fc.weight", lambda c: (c.dim, 3 * c.dim)),
    "input_layernorm": ("midlayer.input_layernorm.weight", lambda c: (c.dim,)),
    "hidden_norm": ("midlayer.hidden_norm.weight", lambda c: (c.dim,)),
    "q_proj": ("midlayer.self_attn.q_proj.weight", lambda c: (c.num_heads * c.head_dim, 2 * c.dim)),
    "k_proj": ("midlayer.self_attn.k_proj.weight", lambda c: (c.num_kv_heads * c.head_dim, 2 * c.dim)),
    "v_proj": ("midlayer.self_attn.v_proj.weight", lambda c: (c.num_kv_heads * c.head_dim, 2 * c.dim)),
    "o_proj": ("midlayer.self_attn.o_proj.weight", lambda c: (c.dim, c.num_heads * c.head_dim)),
    "post_attention_layernorm": ("midlayer.post_attention_layernorm.weight", lambda c: (c.dim,)),
    "gate_proj": ("midlayer.mlp.gate_proj.weight", lambda c: (c.ffn_dim, c.dim)),
    "up_proj": ("midlayer.mlp.up_proj.weight", lambda c: (c.ffn_dim, c.dim)),
    "down_proj": ("midlayer.mlp.down_proj.weight", lambda c: (c.dim, c.ffn_dim)),
    "norm": ("norm.weight", lambda c: (c.dim,)),
    "lm_head": ("lm_head.weight", lambda c: (c.draft_vocab_size, c.dim)),
}


def _read_float_tensor(reader: SafetensorsReader, directory: pathlib.Path, tensor: str,
                       shape: tuple[int, ...], kind: str) -> np.ndarray:
    """One float tensor of a draft head (`kind`: "EAGLE-3", "MTP", ...), its presence, dtype and
    shape checked against what the config implies."""
    if tensor not in reader.files:
        raise CheckpointError(f"{directory} lacks {kind} tensor {tensor!r}")
    value = reader.read(tensor)  # a float type, else a CheckpointError naming it
    if value.shape != tuple(shape):
        raise CheckpointError(f"{kind} tensor {tensor!r} has shape {value.shape}, the config implies "
                              f"{tuple(shape)} (in {directory})")
    return value


def is_eagle3_dir(path: pathlib.Path) -> bool:
    """Whether `path` is an EAGLE-3 head directory (by its config.json)."""
    return path.is_dir() and (path / HF_CONFIG).is_file() and eagle3.is_eagle3_config(
        read_json(path / HF_CONFIG))


def load_eagle3(directory: str | os.PathLike[str]) -> tuple[Any, eagle3.Eagle3Params]:
    """An EAGLE-3 head directory: config.json + model.safetensors (fc, midlayer.*, norm, lm_head,
    d2t int64, t2d bool). Returns (Eagle3Config, params) with d2t as int32."""
    directory = pathlib.Path(directory)
    hf = read_json(directory / HF_CONFIG)
    if not isinstance(hf, dict):
        raise CheckpointError(f"{directory / HF_CONFIG} is not a JSON object")
    with config_values_checked(directory / HF_CONFIG):
        cfg = eagle3.config_from_hf(hf)
    files = hf_weight_files(directory)
    arrays: dict[str, np.ndarray] = {}
    with contextlib.ExitStack() as stack:
        reader = SafetensorsReader(files, stack)
        for name, (tensor, shape_of) in _EAGLE3_TENSORS.items():
            arrays[name] = _read_float_tensor(reader, directory, tensor, shape_of(cfg), "EAGLE-3")
        if "d2t" not in files:
            raise CheckpointError(f"{directory} lacks EAGLE-3 tensor 'd2t'")
        d2t = reader.read_integer("d2t")
    if d2t.shape != (cfg.draft_vocab_size,):
        raise CheckpointError(f"EAGLE-3 tensor 'd2t' in {directory} has shape {d2t.shape}, expected "
                              f"({cfg.draft_vocab_size},)")
    target_ids = np.arange(cfg.draft_vocab_size) + d2t
    if target_ids.min() < 0 or target_ids.max() >= cfg.vocab_size:
        bad = int(np.argmax((target_ids < 0) | (target_ids >= cfg.vocab_size)))
        raise CheckpointError(
            f"EAGLE-3 'd2t' in {directory} maps draft id {bad} to {int(target_ids[bad])}, outside the target vocabulary [0, {cfg.vocab_size})")
    if len(np.unique(target_ids)) != len(target_ids):
        raise CheckpointError(f"EAGLE-3 'd2t' in {directory} maps two draft ids to the same target id")
    arrays["d2t"] = d2t.astype(np.int32)
    return cfg, to_jax(eagle3.params_from(arrays.__getitem__))


def save_eagle3(directory: str | os.PathLike[str], cfg: Any, params: eagle3.Eagle3Params, *,
                dtype=np.float32) -> None:
    """Write a head in the checkpoint format `load_eagle3` reads (tests, training)."""
    from safetensors.numpy import save_file

    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    arrays = eagle3.named_leaves(params)
    tensors = {tensor: np.asarray(arrays[name], dtype) for name, (tensor, _) in _EAGLE3_TENSORS.items()}
    d2t = np.asarray(arrays["d2t"], np.int64)
    tensors["d2t"] = d2t
    t2d = np.zeros(cfg.vocab_size, bool)
    target_ids = np.arange(cfg.draft_vocab_size) + d2t
    t2d[target_ids[(target_ids >= 0) & (target_ids < cfg.vocab_size)]] = True
    tensors["t2d"] = t2d
    save_file(tensors, str(directory / "model.safetensors"))
    hf = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": cfg.dim,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "intermediate_size": cfg.ffn_dim, "draft_vocab_size": cfg.draft_vocab_size, "vocab_size": cfg.vocab_size,
        "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.norm_eps, "num_hidden_layers": 1,
        "max_position_embeddings": cfg.max_position_embeddings,
        "partial_rotary_factor": cfg.rotary_dim / cfg.head_dim,
    }
    if cfg.rope_scaling is not None:  # in transformers' form, which config._rope_settings reads back
        hf["rope_scaling"] = {name: value for name, value in dataclasses.asdict(cfg.rope_scaling).items()
                              if value is not None}
    if cfg.aux_layer_ids is not None:
        hf["eagle_config"] = {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids)}
    (directory / HF_CONFIG).write_text(json.dumps(hf, indent=2), encoding="utf-8")


# ----------------------------------------------------------------------------------------------
# MTP heads on their own (what jaxspec.train writes)
# ----------------------------------------------------------------------------------------------


def is_mtp_head_dir(path: pathlib.Path) -> bool:
    """Whether `path` is an MTP head written by `save_mtp_head`."""
    return path.is_dir() and (path / MTP_HEAD_META).is_file()


def save_mtp_head(directory: str | os.PathLike[str], cfg: Any, params: mtp.MtpParams, *, dtype=np.float32) -> None:
    """A trained MTP head without its target: model.safetensors (`enorm`, `block.q_proj`, ...) and
    mtp_head.json (the block's config). The embedding and lm_head stay the target's."""
    from safetensors.numpy import save_file

    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: np.asarray(value, dtype) for name, value in mtp.named_leaves(params, cfg).items()}
    save_file(tensors, str(directory / "model.safetensors"))
    meta = {"format": "jaxspec-mtp-head", "block": config_to_dict(cfg.block), "hidden_first": cfg.hidden_first}
    (directory / MTP_HEAD_META).write_text(json.dumps(meta, indent=2), encoding="utf-8")


def load_mtp_head(directory: str | os.PathLike[str]) -> tuple[Any, mtp.MtpParams]:
    """A head written by `save_mtp_head`: (MtpConfig, params), every tensor's shape and dtype checked."""
    directory = pathlib.Path(directory)
    meta = read_json(directory / MTP_HEAD_META)
    try:
        cfg = mtp.MtpConfig(block=config_from_dict(meta["block"]), hidden_first=bool(meta["hidden_first"]))
    except (KeyError, TypeError, ValueError) as error:
        raise CheckpointError(f"{directory / MTP_HEAD_META} is not a jaxspec MTP head config: {error!r}") from None
    shapes = mtp.leaf_shapes(cfg)
    files = hf_weight_files(directory)
    with contextlib.ExitStack() as stack:
        reader = SafetensorsReader(files, stack)
        params = mtp.params_from(
            cfg, lambda name: _read_float_tensor(reader, directory, name, shapes[name], "MTP head"))
    return cfg, to_jax(params)


# ----------------------------------------------------------------------------------------------
# MTP heads (inside their target's HF directory)
# ----------------------------------------------------------------------------------------------

# The head's own tensors per checkpoint layout; the block's follow llama.HF_NAMES under a prefix.
# DeepSeek-V3 / GLM: the MTP layer is `model.layers.{L}` (L = num_hidden_layers), beside the block.
# Qwen3-Next / Qwen3.5 / Mellum: an `mtp.` tree, the block under `mtp.layers.0.`.
_MTP_LAYOUTS = {
    "deepseek": {"enorm": "{L}.enorm.weight", "hnorm": "{L}.hnorm.weight", "eh_proj": "{L}.eh_proj.weight",
                 "post_norm": "{L}.shared_head.norm.weight", "block": "{L}."},
    "mtp_tree": {"enorm": "mtp.pre_fc_norm_embedding.weight", "hnorm": "mtp.pre_fc_norm_hidden.weight",
                 "eh_proj": "mtp.fc.weight", "post_norm": "mtp.norm.weight", "block": "mtp.layers.0."},
}


def _mtp_names(layout: str, prefix: str, num_layers: int) -> dict[str, str]:
    deepseek_layer = f"{prefix}layers.{num_layers}"
    return {key: name.replace("{L}", deepseek_layer) for key, name in _MTP_LAYOUTS[layout].items()}


def has_mtp(path: pathlib.Path) -> bool:
    """Whether an HF directory's config declares MTP layers."""
    if not (path.is_dir() and (path / HF_CONFIG).is_file()):
        return False
    hf = read_json(path / HF_CONFIG)
    return bool(hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers")))


def load_mtp(directory: str | os.PathLike[str]) -> tuple[Any, mtp.MtpParams]:
    """The first MTP layer of an HF checkpoint that carries one (see jaxspec.models.mtp).

    Reads either layout (`model.layers.{L}.*` as DeepSeek-V3 and GLM store it, or the `mtp.*`
    tree of Qwen3-Next and Mellum), checking every shape against the config.
    """
    directory = pathlib.Path(directory)
    cfg = mtp.config_from_hf(read_json(directory / HF_CONFIG))
    files = hf_weight_files(directory)
    prefix = hf_prefix(llama.FAMILY, files, directory)
    target_layers = int(read_json(directory / HF_CONFIG)["num_hidden_layers"])
    for layout in _MTP_LAYOUTS:
        names = _mtp_names(layout, prefix, target_layers)
        if names["eh_proj"] in files:
            break
    else:
        candidates = [_mtp_names(layout, prefix, target_layers)["eh_proj"] for layout in _MTP_LAYOUTS]
        raise CheckpointError(f"{directory} declares MTP layers but holds none of {candidates}")
    shapes = mtp.leaf_shapes(cfg)

    def tensor_name(name: str) -> str:
        if name.startswith("block."):
            return names["block"] + llama.HF_NAMES[name.removeprefix("block.")]
        return names[name]

    with contextlib.ExitStack() as stack:
        reader = SafetensorsReader(files, stack)
        params = mtp.params_from(
            cfg, lambda name: _read_float_tensor(reader, directory, tensor_name(name), shapes[name], "MTP"))
    return cfg, to_jax(params)


# ----------------------------------------------------------------------------------------------
# Gemma 4 shared-KV assistants (transformers' gemma4_assistant)
# ----------------------------------------------------------------------------------------------


def is_assistant_dir(path: pathlib.Path) -> bool:
    """Whether `path` is a Gemma 4 assistant checkpoint (config.json model_type gemma4_assistant)."""
    if not (path.is_dir() and (path / HF_CONFIG).is_file()):
        return False
    hf = read_json(path / HF_CONFIG)
    return isinstance(hf, dict) and hf.get("model_type") == "gemma4_assistant"


def load_assistant(directory: str | os.PathLike[str]) -> tuple[Any, assistant.AssistantParams]:
    """A `Gemma4AssistantForCausalLM` directory: (AssistantConfig, params). Every tensor the config
    implies must be there with its shape (floats; `token_ordering` an integer permutation of the
    vocabulary); the LM head is the tied embedding."""
    directory = pathlib.Path(directory)
    hf = read_json(directory / HF_CONFIG)
    with config_values_checked(directory / HF_CONFIG):
        cfg = assistant.config_from_hf(hf)
        if not flag(hf.get("tie_word_embeddings", True), "tie_word_embeddings"):
            raise UnsupportedModelError("a Gemma 4 assistant's LM head is its tied embedding; "
                                        "this config sets tie_word_embeddings false")
    shapes, names = assistant.param_shapes(cfg), assistant.hf_names(cfg)
    files = hf_weight_files(directory)
    with contextlib.ExitStack() as stack:
        reader = SafetensorsReader(files, stack)

        def read(shape: tuple[int, ...], name: str) -> np.ndarray:
            if name != assistant.HF_TOP["token_ordering"]:
                return _read_float_tensor(reader, directory, name, shape, "Gemma 4 assistant")
            if name not in files:
                raise CheckpointError(f"{directory} lacks Gemma 4 assistant tensor {name!r} "
                                      "(use_ordered_embeddings is true)")
            ordering = reader.read_integer(name)
            if ordering.shape != shape or not np.array_equal(np.sort(ordering), np.arange(shape[0])):
                raise CheckpointError(f"{name!r} in {directory} is not a permutation of the {shape[0]} token ids")
            return ordering.astype(np.int32)

        params = jax.tree.map(read, shapes, names, is_leaf=is_shape)
    return cfg, to_jax(params)
