"""HF checkpoint directories: config.json, safetensors weight files (single or sharded), params.

Tensors are read by name across shards to float32 (bf16 and fp8 through ml_dtypes, which
safetensors' numpy path cannot name). The directory's `model_type` picks the family
(jaxspec.models.family_for_hf) and the family's `hf_tensors` names every param. Nothing here
unpickles: a directory holding only `pytorch_model*.bin` is refused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import pathlib
import re
import struct
from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np

from jaxspec import models
from jaxspec.checkpoints.assemble import assemble_params, check_layer_count, config_values_checked
from jaxspec.checkpoints.resolve import HF_CONFIG
from jaxspec.errors import CheckpointError
from jaxspec.models.family import Family

# safetensors dtypes numpy cannot name; read from the raw bytes with ml_dtypes.
_RAW_DTYPES = {
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
INTEGER_DTYPES = ("I64", "I32", "I16", "I8", "U8")
# What a weight may be stored as: float types only. An integer or bool tensor read "as float32"
# would be its integers as numbers (an F32 header entry re-declared I32 loads its bit patterns).
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", *(name for name in _RAW_DTYPES if name.startswith("F8")))


def read_json(path: pathlib.Path) -> Any:
    """A JSON file's value; CheckpointError naming the file when it is absent or not JSON."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path.parent} lacks {path.name}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path} is not valid JSON: {err}") from None
    except RecursionError:  # json recurses per nesting level
        raise CheckpointError(f"{path} is not usable JSON: it is nested too deeply") from None


def open_safetensors(path: pathlib.Path):
    """safe_open over numpy; a file cut short or not safetensors at all (safetensors raises its
    own SafetensorError) is a CheckpointError naming it."""
    from safetensors import safe_open

    try:
        return safe_open(path, framework="numpy")
    except Exception as err:
        raise CheckpointError(f"{path} is not a readable safetensors file: {err}") from None


def hf_weight_files(directory: pathlib.Path) -> dict[str, pathlib.Path]:
    """tensor name -> safetensors file, from the shard index or the single model.safetensors."""
    index = directory / "model.safetensors.index.json"
    single = directory / "model.safetensors"
    if index.is_file():
        document = read_json(index)
        weight_map = document.get("weight_map") if isinstance(document, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index} has no 'weight_map' object naming each tensor's shard file")
        root = directory.resolve()
        files = {}
        for name, shard in weight_map.items():
            if not isinstance(shard, str) or not shard or "\x00" in shard:
                raise CheckpointError(f"{index}: weight_map[{name!r}] is {shard!r:.60}, not a shard file name")
            try:
                path = (directory / shard).resolve()
            except (OSError, ValueError, RuntimeError) as err:  # a symlink loop, an unencodable name
                raise CheckpointError(f"{index}: shard {shard!r:.60} of {name!r} cannot be resolved ({err})") from None
            # A shard is a file inside the model directory: an entry like "../../other/x.safetensors"
            # (or an absolute path, or a symlink out) would read weights the directory does not hold.
            if not path.is_relative_to(root):
                raise CheckpointError(f"{index}: shard {shard!r} of {name!r} lies outside {directory}")
            files[name] = path
        for shard in sorted(set(files.values())):
            if not shard.is_file():
                raise CheckpointError(f"shard {shard.name} listed in {index} is missing")
        return files
    if single.is_file():
        with open_safetensors(single) as handle:
            return {name: single for name in handle.keys()}
    if any(directory.glob("pytorch_model*.bin")):
        raise CheckpointError(
            f"{directory} holds only pytorch_model*.bin; jaxspec never unpickles weights, safetensors is "
            "required (re-save with save_pretrained(..., safe_serialization=True))"
        )
    raise CheckpointError(f"{directory} has no model.safetensors or model.safetensors.index.json")


@functools.cache
def _header(path: pathlib.Path, mtime_ns: int) -> tuple[dict[str, Any], int]:
    """(header, data start) of a safetensors file, for dtypes safe_open's numpy path lacks."""
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        return json.loads(handle.read(length)), 8 + length


class SafetensorsReader:
    """Reads tensors by name across shards, holding each shard open once until `stack` closes."""

    def __init__(self, files: Mapping[str, pathlib.Path], stack: contextlib.ExitStack):
        self.files = files  # tensor name -> shard
        self._stack = stack
        self._handles: dict[pathlib.Path, Any] = {}

    def _handle(self, path: pathlib.Path) -> Any:
        if path not in self._handles:
            handle = self._stack.enter_context(open_safetensors(path))
            self._handles[path] = handle, frozenset(handle.keys())
        return self._handles[path][0]

    def _slice(self, name: str) -> Any:
        """The tensor's slice in the shard the index names; a shard that lacks it (an index
        entry pointing at the wrong file) is a CheckpointError naming both."""
        path = self.files[name]
        handle = self._handle(path)
        if name not in self._handles[path][1]:
            raise CheckpointError(f"{path} does not hold tensor {name!r}, which the shard index places there")
        return handle.get_slice(name)

    def dtype(self, name: str) -> str:
        """The stored dtype's safetensors name ("F32", "BF16", "I64", ...)."""
        return self._slice(name).get_dtype()

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def read(self, name: str) -> np.ndarray:
        """A float tensor as float32 (bf16 and fp8 decoded from the raw bytes)."""
        path = self.files[name]
        dtype = self.dtype(name)
        if dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"tensor {name!r} in {path} is stored as {dtype}; a weight is a float type "
                                  f"({', '.join(FLOAT_DTYPES)})")
        if dtype not in _RAW_DTYPES:
            return self._handle(path).get_tensor(name).astype(np.float32, copy=False)
        header, data_start = _header(path, path.stat().st_mtime_ns)
        entry = header[name]
        begin, end = entry["data_offsets"]
        raw = np.fromfile(path, dtype=np.uint8, count=end - begin, offset=data_start + begin)
        return raw.view(_RAW_DTYPES[dtype]).reshape(entry["shape"]).astype(np.float32)

    def read_integer(self, name: str) -> np.ndarray:
        """An integer tensor as int64; CheckpointError when it is stored as anything else."""
        if self.dtype(name) not in INTEGER_DTYPES:
            raise CheckpointError(f"tensor {name!r} has dtype {self.dtype(name)}; expected an integer type "
                                  f"(in {self.files[name]})")
        return np.asarray(self._handle(self.files[name]).get_tensor(name)).astype(np.int64)


def hf_family(directory: pathlib.Path, files: Mapping[str, pathlib.Path]) -> tuple[Family, Any]:
    """(family, config) of an HF directory, from its config.json's `model_type`; `files` is its
    `hf_weight_files`, whose layers the config's count must match."""
    hf = read_json(directory / HF_CONFIG)
    if not isinstance(hf, dict):
        raise CheckpointError(f"{directory / HF_CONFIG} is not a JSON object")
    with config_values_checked(directory / HF_CONFIG):
        family = models.family_for_hf(hf)
    # The layer count against the weight files' layers, before the parse sizes anything by it.
    text = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else hf
    if "num_hidden_layers" in text:
        layer_name = re.compile(rf"{re.escape(hf_prefix(family, files, directory))}layers\.(\d+)\.")
        check_layer_count(text["num_hidden_layers"], files, layer_name, field="num_hidden_layers",
                          source=directory / HF_CONFIG)
    with config_values_checked(directory / HF_CONFIG):
        return family, family.config_from_hf(hf)



def hf_prefix(family: Family, names: Mapping[str, Any], directory: pathlib.Path) -> str:
    """The prefix under which a directory stores the trunk ("model." for *ForCausalLM saves)."""
    prefix = family.hf_prefix(names)
    if prefix is None:
        candidates = [f"{p}{family.hf_embed}" for p in family.hf_prefixes]
        raise CheckpointError(f"{directory} lacks the embedding: none of {candidates}")
    return prefix


def load_hf_dir(directory: pathlib.Path, *, progress: bool = False) -> tuple[Any, Any]:
    """An HF directory of any registered family -> (config, float32 numpy params)."""
    files = hf_weight_files(directory)
    family, cfg = hf_family(directory, files)
    tensors = family.hf_tensors(cfg, hf_prefix(family, files, directory))
    with contextlib.ExitStack() as stack:
        reader = SafetensorsReader(files, stack)
        params = assemble_params(family.param_shapes(cfg), tensors, reader.read, available=files,
                                 source="HF checkpoint", path=directory, progress=progress)
        # A tied model reads its head from the embedding, as transformers does. A stored lm_head that
        # is not the embedding means the file contradicts its config (a tie flag turned on over an
        # untied checkpoint): refused, where transformers would silently drop the trained head.
        if getattr(cfg, "tie_embeddings", False):
            # The head's name is the one an untied config of this family reads.
            head_name = family.hf_tensors(dataclasses.replace(cfg, tie_embeddings=False),
                                          hf_prefix(family, files, directory)).lm_head.name
            if head_name in files and not np.array_equal(reader.read(head_name), params.embed):
                raise CheckpointError(
                    f"{directory / HF_CONFIG} ties the embeddings (tie_word_embeddings) but {files[head_name]} "
                    f"holds a {head_name} that differs from the embedding: the file contradicts its config")
    return cfg, params
