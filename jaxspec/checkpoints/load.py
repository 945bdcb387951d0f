"""The entry points: load any checkpoint, summarise one from its headers, convert one.

Each dispatches on the source's format (GGUF file, HF directory, converted directory) and
then on its family (jaxspec.models.family), so every family any reader supports gets `load`,
`info` and `convert` alike.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import shutil
from collections import Counter
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.checkpoints import gguf as gguf_reader
from jaxspec.checkpoints import parts, safetensors, store
from jaxspec.checkpoints.assemble import Checkpoint, to_jax
from jaxspec.checkpoints.resolve import HF_CONFIG, JAXSPEC_META, resolve_model
from jaxspec.errors import CheckpointError
from jaxspec.models import quant
from jaxspec.models.quant import WeightFormat
from jaxspec.models.params import is_shape


# How `info` names a converted directory's stored dtypes (as GGUF and safetensors name theirs).
STORED_TYPE_NAMES = {np.dtype(np.float32): "F32", np.dtype(jnp.bfloat16): "BF16", np.dtype(np.int8): "I8"}


def load_checkpoint(
    name_or_path: str | os.PathLike[str], *, use_cache: bool = True, progress: bool = False,
    weight_format: WeightFormat | str = WeightFormat.AUTO,
) -> Checkpoint:
    """Load a model by name ("smollm2-135m") or path (GGUF, HF directory, converted directory),
    its linear weights in `weight_format` (jaxspec.models.quant). "auto": a converted directory's
    own format, else this platform's default (f32 on CPU, bf16 on GPU).

    GGUF params are cached (orbax, keyed by the file's sha256 and the format, under
    `store.cache_dir()`) unless `use_cache=False`, so a second load skips dequantization and
    quantization; HF and converted directories are read directly either way. `progress` shows a
    bar over tensors while converting.
    """
    weight_format = WeightFormat.parse(weight_format)
    path = resolve_model(name_or_path)
    if path.is_dir() and (path / JAXSPEC_META).is_file():
        checkpoint = store.load_converted(path)
        if weight_format is WeightFormat.AUTO:
            return checkpoint
        return dataclasses.replace(checkpoint, params=quant.convert(checkpoint.params, weight_format))
    weight_format = weight_format.resolve()
    if path.is_dir():
        cfg, host_params = safetensors.load_hf_dir(path, progress=progress)
        return Checkpoint(config=cfg, params=to_jax(quant.convert(host_params, weight_format)),
                          tokenizer_source=path, source=path)
    return store.load_gguf(path, use_cache=use_cache, progress=progress, weight_format=weight_format,
                           expected_sha256=parts.expected_sha256(path))


def info(name_or_path: str | os.PathLike[str]) -> dict[str, Any]:
    """A summary read from headers only (no dequantizing): for `jaxspec.cli info`."""
    path = resolve_model(name_or_path)
    tensor_types: Counter[str] = Counter()
    if path.is_dir() and (path / JAXSPEC_META).is_file():
        source_format = "jaxspec"
        family, cfg = store.converted_family(path)
        shapes = jax.tree.leaves(family.param_shapes(cfg), is_leaf=is_shape)
        stored = jax.tree.leaves(quant.shape_structs(family.param_shapes(cfg), store.converted_weight_format(path)))
        tensor_types.update(STORED_TYPE_NAMES[np.dtype(leaf.dtype)] for leaf in stored)
        param_count = sum(int(np.prod(shape)) for shape in shapes)
        file_size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    elif path.is_dir():
        source_format = "hf"
        files = safetensors.hf_weight_files(path)
        family, cfg = safetensors.hf_family(path, files)
        param_count = 0
        with contextlib.ExitStack() as stack:
            reader = safetensors.SafetensorsReader(files, stack)
            for name in files:
                tensor_types[reader.dtype(name)] += 1
                param_count += int(np.prod(reader.shape(name)))
        file_size = sum(p.stat().st_size for p in {*files.values(), path / HF_CONFIG})
    else:
        source_format = "gguf"
        gf = gguf_reader.read_gguf(path)
        family, cfg = gguf_reader.gguf_family(gf), gguf_reader.config_from_gguf(gf)
        tensor_types.update(t.qtype.name for t in gf.tensors.values())
        param_count = sum(t.num_elements for t in gf.tensors.values())
        file_size = gf.file_size
    return {
        "source": str(path),
        "format": source_format,
        "family": family.name,
        "architecture": family.architecture(cfg),
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


def convert(
    src: str | os.PathLike[str], out_dir: str | os.PathLike[str], *, overwrite: bool = False,
    progress: bool = False, weight_format: WeightFormat | str = WeightFormat.F32,
) -> pathlib.Path:
    """Write a self-contained jaxspec directory that `load_checkpoint(out_dir)` reads back, its
    weights stored in `weight_format` (f32, bf16 or int8).

    Any source `load_checkpoint` reads, of any family; the layout is `store`'s docstring. Written
    to a temp sibling and renamed, so it is never half there.
    """
    weight_format = WeightFormat.parse(weight_format).resolve()
    out = pathlib.Path(out_dir).expanduser().absolute()
    if out.exists() and not overwrite and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"{out} already exists and is not empty (pass overwrite=True, or --overwrite to the "
                              f"CLI, to replace it)")
    if out.exists() and resolve_model(src) == out.resolve():
        raise CheckpointError(f"cannot convert {out} onto itself")
    checkpoint = load_checkpoint(src, use_cache=False, progress=progress, weight_format=weight_format)
    if out.is_dir():
        shutil.rmtree(out)
    elif out.exists():
        out.unlink()
    store.save_converted(checkpoint, out)
    return out
