"""GGUF files: a lean header parser, dequantization, and a family's config and params from them.

The header is read by struct + numpy over an mmap, far faster than `gguf.GGUFReader` reads a
real model's; tensor data stays memory-mapped until a tensor is asked for, and is dequantized by
`gguf.quants.dequantize`. Which tensor fills which param, and how (llama.cpp's Q/K row
permutation undone), is the family's `gguf_tensors` (jaxspec.models.family); the file's
`general.architecture` picks the family. A truncated or corrupt file fails here, naming the file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.metadata
import math
import mmap
import os
import pathlib
import re
import struct
from typing import Any

import gguf
import jax
import numpy as np

from jaxspec import gguf_tokenizer, models
from jaxspec.checkpoints.assemble import assemble_params, check_layer_count, config_values_checked
from jaxspec.errors import CheckpointError, UnsupportedModelError
from jaxspec.models.family import Family, TensorSource

_GGUF_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
_MAX_DIMS = 4  # GGML_MAX_DIMS
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
        check_dequantizable(info)
        values = dequantize(self.raw(name), info.qtype)
        if np.may_share_memory(values, self._data):
            # F32 dequantizes to a view of the file map: copy, so no jax array aliases the file.
            values = values.copy()
        return values.astype(np.float32, copy=False).reshape(info.shape)


def dequantize(raw: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """float32 values of raw GGUF bytes `[rows, bytes_per_row]`: the one place GGUF data is decoded,
    so a test can count the calls (a cache hit makes none)."""
    if qtype == gguf.GGMLQuantizationType.F64:  # gguf.quants has no F64; it is a plain view
        return raw.view(np.float64).astype(np.float32)
    return gguf.quants.dequantize(raw, qtype)


@functools.cache
def dequantizable(qtype: gguf.GGMLQuantizationType) -> bool:
    """Whether gguf.quants can dequantize `qtype`, probed on one zero block (public API only)."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    try:
        dequantize(np.zeros((1, type_size), np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


_INTEGER_TYPES = frozenset(getattr(gguf.GGMLQuantizationType, name) for name in ("I8", "I16", "I32", "I64")
                           if hasattr(gguf.GGMLQuantizationType, name))


def check_dequantizable(info: GGUFTensorInfo) -> None:
    """UnsupportedModelError naming the tensor when this gguf release cannot decode its type;
    CheckpointError when the type is an integer one (a weight is float or quantized: an F32
    tensor re-declared I32 would otherwise load its bit patterns as numbers)."""
    if info.qtype in _INTEGER_TYPES:
        raise CheckpointError(
            f"tensor {info.name!r} is stored as ggml type {info.qtype.name}, an integer type; "
            "model weights are float or block-quantized")
    if not dequantizable(info.qtype):
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
        if not 1 <= n_dims <= _MAX_DIMS:
            raise CheckpointError(
                f"GGUF file {path} is corrupt: tensor {name!r} has {n_dims} dims (ggml tensors have 1 to {_MAX_DIMS})")
        ne = [cursor.unpack("<Q") for _ in range(n_dims)]
        raw_infos.append((name, tuple(reversed(ne)), cursor.unpack("<I"), cursor.unpack("<Q")))
    alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0 or alignment % 8:
        raise CheckpointError(
            f"GGUF file {path} is corrupt: general.alignment is {alignment!r} (expected a positive multiple of 8)")
    data_offset = -(-cursor.pos // alignment) * alignment
    tensors = {}
    # llama.cpp's own reader holds every file to one layout, and so do we: tensor data in the order
    # of the tensor infos, each starting where the previous one ends, padded to the alignment. A
    # shifted offset, a tensor type or shape changed in place (Q4_1 -> Q4_0 shrinks its bytes), or
    # two infos over the same bytes all break that chain and are refused here, before any read.
    expected_offset = 0
    for name, shape, type_id, rel_offset in raw_infos:
        if name in tensors:
            raise CheckpointError(f"GGUF file {path} is corrupt: tensor {name!r} is declared twice")
        try:
            qtype = gguf.GGMLQuantizationType(type_id)
        except ValueError:
            raise UnsupportedModelError(f"tensor {name!r} in {path} has unknown ggml type {type_id}") from None
        if min(shape) < 1:
            raise CheckpointError(f"GGUF file {path} is corrupt: tensor {name!r} has shape {shape}")
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        if shape[-1] % block_size:
            raise CheckpointError(
                f"GGUF file {path} is corrupt: tensor {name!r} rows of {shape[-1]} are not whole "
                f"{qtype.name} blocks of {block_size}"
            )
        nbytes = math.prod(shape) // block_size * type_size  # Python ints: a garbage dim cannot wrap
        if rel_offset != expected_offset:
            raise CheckpointError(
                f"GGUF file {path} is corrupt: tensor {name!r} ({qtype.name}, shape {shape}) starts at data "
                f"offset {rel_offset}, but the tensors before it end at {expected_offset} (a shifted offset, or "
                "a tensor's type or shape changed in place)")
        if data_offset + rel_offset + nbytes > cursor.size:
            raise CheckpointError(
                f"GGUF file {path} is truncated: tensor {name!r} ends at byte {data_offset + rel_offset + nbytes} "
                f"but the file has {cursor.size} bytes")
        expected_offset = -(-(rel_offset + nbytes) // alignment) * alignment
        tensors[name] = GGUFTensorInfo(
            name=name, shape=shape, qtype=qtype, offset=data_offset + rel_offset, nbytes=nbytes
        )
    return metadata, tensors, data_offset, version


def gguf_family(gf: GGUFFile) -> Family:
    """The trunk family of a GGUF file (by `general.architecture`); UnsupportedModelError otherwise."""
    return models.family_for_gguf(gf.architecture, str(gf.path))


_GGUF_LAYER = re.compile(r"blk\.(\d+)\.")


def config_from_gguf(gf: GGUFFile) -> Any:
    """The family's config from GGUF metadata and tensor shapes (the layer count checked against
    the file's `blk.{i}` tensors first)."""
    family = gguf_family(gf)
    block_count = f"{gf.architecture}.block_count"
    if block_count in gf.metadata:  # a family that needs it and finds none names it itself
        check_layer_count(gf.metadata[block_count], gf.tensors, _GGUF_LAYER, field=block_count, source=gf.path)
    shapes = {name: info.shape for name, info in gf.tensors.items()}
    with config_values_checked(gf.path):
        cfg = family.config_from_gguf(gf.metadata, shapes, str(gf.path))
    for info in gf.tensors.values():  # from the header: fail before minutes of dequantizing, not after
        check_dequantizable(info)
    # Every tensor the file holds is one the config's model reads, as llama.cpp requires: a
    # renamed tensor would otherwise be skipped silently (a renamed output.weight loads the model
    # as tied, with the embedding for a head).
    wanted = {source.name for source in jax.tree.leaves(family.gguf_tensors(cfg, gf.architecture),
                                                         is_leaf=lambda leaf: isinstance(leaf, TensorSource))}
    unused = sorted(set(gf.tensors) - wanted)
    if unused:
        raise CheckpointError(
            f"GGUF file {gf.path} holds {len(unused)} tensor(s) a {family.name} model of its config does not use: "
            f"{', '.join(map(repr, unused[:4]))}{'...' if len(unused) > 4 else ''}")
    return cfg


def gguf_tokenizer_metadata(gf: GGUFFile) -> dict[str, Any]:
    """The `tokenizer.*` metadata keys, verbatim: what jaxspec.tokenizer builds a tokenizer from.

    A file without `tokenizer.chat_template` gets its architecture's built-in one, where jaxspec
    has one (`gguf_tokenizer.builtin_chat_template`: Gemma 3's GGUFs carry none).
    """
    metadata = {key: value for key, value in gf.metadata.items() if key.startswith("tokenizer.")}
    if "tokenizer.chat_template" not in metadata:
        template = gguf_tokenizer.builtin_chat_template(gf.architecture)
        if template is not None:
            metadata["tokenizer.chat_template"] = template
    return metadata


def params_from_gguf(gf: GGUFFile, cfg: Any, *, progress: bool = False) -> Any:
    """The family's params tree as float32 numpy, every tensor dequantized and shape-checked."""
    family = gguf_family(gf)
    return assemble_params(family.param_shapes(cfg), family.gguf_tensors(cfg, gf.architecture), gf.tensor,
                           available=gf.tensors, source="GGUF file", path=gf.path, progress=progress)
