"""jaxspec's own storage: the orbax weight cache and converted directories.

GGUF params cost seconds to dequantize, so `load_gguf` caches them with orbax under
`cache_dir()` (~/.cache/jaxspec), keyed by the file's sha256 and the weight format: a second
load restores instead. Each entry holds the weights in their format (jaxspec.models.quant):
float32, bfloat16, or int8 codes with per-row scales (about a quarter of float32's bytes).
HF safetensors are not cached: they are already float, read about as fast as an orbax restore,
and a float32 copy would double (for bf16: triple) their disk footprint.

A converted directory (`jaxspec convert`) is self-contained: `jaxspec.json` (format version,
family, config, weight format, source), `params/` (orbax, in that weight format), and the
tokenizer (the HF tokenizer files, or `gguf_tokenizer.json` holding a GGUF's `tokenizer.*`
metadata). Cache entries and converted
directories are written to a temp sibling and renamed, so neither is ever half there.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import hashlib
import json
import logging
import os
import pathlib
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxspec import models
from jaxspec.checkpoints import gguf as gguf_reader
from jaxspec.checkpoints.assemble import Checkpoint, config_values_checked, to_jax_consuming
from jaxspec.checkpoints.resolve import JAXSPEC_META, cache_dir
from jaxspec.checkpoints.safetensors import read_json
from jaxspec.errors import CheckpointError, JaxspecError
from jaxspec.hostmem import release_freed_memory
from jaxspec.models import quant
from jaxspec.models.family import Family
from jaxspec.models.quant import WeightFormat

logger = logging.getLogger(__name__)

GGUF_TOKENIZER_FILE = "gguf_tokenizer.json"
PARAMS_DIR = "params"
# Version 4: params stored as the families' typed trees (layers.0.attention.q_proj, ...), with
# the fused-projection fields (empty) and a weight format, int8 codes in the Hadamard-rotated
# basis (jaxspec.models.quant); an older directory is refused by name rather than misread.
FORMAT_VERSION = 4
# Bump when GGUF -> params conversion, a weight format's encoding or the stored tree changes, so
# stale cache entries are never reused (v2: the typed params trees; v3: fused-projection fields,
# weight formats; v4: int8 codes rotated).
CACHE_VERSION = 4
# Tokenizer material an HF directory may carry; a converted directory copies whichever exist.
HF_TOKENIZER_FILES = (
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


class _Cancelled(Exception):
    """The hash was no longer wanted (the file failed to parse)."""


def file_sha256(path: pathlib.Path, cancel: threading.Event | None = None) -> str:
    """The file's sha256, read in 4 MB chunks; `cancel` set stops it between chunks (a load that
    fails to parse a 100 GB file must not wait for its hash)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 22):
            if cancel is not None and cancel.is_set():
                raise _Cancelled(path)
            digest.update(chunk)  # releases the GIL: the parse goes on beside it
    return digest.hexdigest()


def gguf_cache_entry(gguf_path: pathlib.Path, digest: str | None = None,
                     weight_format: WeightFormat = WeightFormat.F32) -> pathlib.Path:
    """The cache directory holding a GGUF file's params in `weight_format` (whether or not it
    exists yet)."""
    return cache_dir() / "params" / f"{digest or file_sha256(gguf_path)}-v{CACHE_VERSION}-{weight_format.value}"


def _checkpointer() -> Any:
    """An orbax PyTree checkpointer that stores arrays uncompressed.

    Dequantized weights do compress (318 vs 514 MB for the default model), but decompressing
    them slows the cached load, and the cache exists for load time.
    """
    # Imported here: orbax is slow to import, and only orbax readers/writers need it, so
    # `import jaxspec` does not pay for it.
    import orbax.checkpoint as ocp

    return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False))


def save_params(params: Any, path: pathlib.Path) -> None:
    """Write params with orbax to a fresh `path` (orbax refuses an existing one)."""
    import orbax.checkpoint as ocp

    with _checkpointer() as checkpointer:
        checkpointer.save(path.absolute(), args=ocp.args.PyTreeSave(params))


def restore_params(path: pathlib.Path, family: Family, cfg: Any,
                   weight_format: WeightFormat = WeightFormat.F32) -> Any:
    """Read params written by save_params, as jax arrays shaped by the family's `cfg` and typed
    by `weight_format` (jaxspec.models.quant.shape_structs).

    The target tree comes from the config, so an entry of the wrong structure, shapes or dtypes
    fails here (and a cache entry is rebuilt) instead of reaching a model.
    """
    import orbax.checkpoint as ocp

    target = quant.shape_structs(family.param_shapes(cfg), weight_format)
    stored = _stored_leaf_count(path)
    if stored is not None and stored != len(jax.tree.leaves(target)):
        # orbax restores the leaves asked for and ignores the rest: a config that lost a leaf (a
        # tie flag turned on over stored untied params) would silently drop a stored array.
        raise CheckpointError(f"{path} holds a params tree of another structure than the {family.name} config "
                              f"implies ({stored} arrays where it implies {len(jax.tree.leaves(target))})")
    # Restored to host numpy a group of arrays at a time (orbax's reads hold a copy of what they
    # read, and numpy's arrays are not aligned for jax to adopt), each array copied to the device
    # and dropped before the next group: the whole tree at once peaked at 1.6x its size.
    wanted, treedef = jax.tree.flatten(target)
    skip = getattr(ocp, "PLACEHOLDER", None)  # restores nothing at its leaf (orbax >= 0.11)
    leaves: list[Any] = [None] * len(wanted)
    with _checkpointer() as checkpointer:
        for group in _restore_groups(wanted, RESTORE_GROUP_BYTES if skip is not None else None):
            item = jax.tree.unflatten(treedef, [want if index in group else skip for index, want in enumerate(wanted)])
            restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), item)
            restored = checkpointer.restore(
                path.absolute(), args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args))
            if jax.tree.structure(restored) != treedef:
                raise CheckpointError(f"{path} holds a params tree of another structure than the {family.name} "
                                      "config implies")
            got = jax.tree.leaves(restored)
            del restored
            for index in group:
                array, want = got[index], wanted[index]
                if array.shape != want.shape or array.dtype != want.dtype:
                    raise CheckpointError(f"{path} holds a {array.dtype}{list(array.shape)} array where "
                                          f"{want.dtype}{list(want.shape)} belongs")
                got[index] = None
                leaves[index] = jax.block_until_ready(jax.device_put(array, may_alias=True))
                del array
            del got
            release_freed_memory()
    return jax.tree.unflatten(treedef, leaves)


RESTORE_GROUP_BYTES = 512 << 20  # arrays restored together (one larger than this alone)


def _restore_groups(wanted: list[Any], limit: int | None) -> list[range]:
    """Consecutive index ranges of `wanted` (ShapeDtypeStructs) of at most `limit` bytes each
    (an array larger than that alone); one range of all with no limit."""
    if limit is None:
        return [range(len(wanted))]
    groups, start, size = [], 0, 0
    for index, want in enumerate(wanted):
        nbytes = int(np.prod(want.shape, dtype=np.int64)) * np.dtype(want.dtype).itemsize
        if index > start and size + nbytes > limit:
            groups.append(range(start, index))
            start, size = index, 0
        size += nbytes
    return [*groups, range(start, len(wanted))] if wanted else []


def _stored_leaf_count(path: pathlib.Path) -> int | None:
    """How many arrays an orbax PyTree checkpoint holds, from its _METADATA (None when unreadable:
    the restore itself then decides)."""
    try:
        tree = json.loads((path / "_METADATA").read_text(encoding="utf-8"))["tree_metadata"]
        return sum(1 for leaf in tree.values() if not leaf["value_metadata"].get("skip_deserialize", False)
                   and leaf["value_metadata"].get("value_type") != "None")
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return None


def write_atomically(final: pathlib.Path, write: Callable[[pathlib.Path], None]) -> None:
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
    it also keeps writeback of the fresh entry from stalling the next load's reads.
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


def _restore_entry(entry: pathlib.Path | None, family: Family, cfg: Any, weight_format: WeightFormat) -> Any:
    """A cache entry's params, or None when there is none; a damaged entry is removed, and so is a
    stray file at the entry's path (else it would block every later write there)."""
    if entry is not None and entry.exists() and not entry.is_dir():
        logger.warning("replacing %s: a file where a cache entry directory belongs", entry)
        entry.unlink()
    if entry is None or not entry.is_dir():
        return None
    try:
        return restore_params(entry, family, cfg, weight_format)
    except Exception as err:  # any damage means rebuild; the source of truth is the GGUF
        logger.warning("ignoring corrupt cache entry %s (%s); rebuilding", entry, err)
        shutil.rmtree(entry, ignore_errors=True)
        return None


def load_gguf(path: pathlib.Path, *, use_cache: bool = True, progress: bool = False,
              weight_format: WeightFormat = WeightFormat.F32, expected_sha256: str | None = None) -> Checkpoint:
    """A GGUF file in `weight_format`, its params restored from the cache when an entry of
    that format exists, else dequantized (from the float32 entry when there is one) and
    converted (and cached, unless `use_cache=False`). A damaged entry is rebuilt; an
    unwritable cache only logs a warning. With `expected_sha256` (a file jaxspec joined from
    parts, jaxspec.checkpoints.parts), a file of another hash is refused before any tensor is
    read."""
    entry = float_entry = None
    cancel = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        # hashlib releases the GIL: hash the file while this thread parses the header and
        # imports orbax (a large share of a cached load). A parse that fails stops the hash, or
        # leaving this block would wait for the whole file to be read.
        hashed = use_cache or expected_sha256 is not None
        digest = pool.submit(file_sha256, path, cancel) if hashed else None
        try:
            gf = gguf_reader.read_gguf(path)
            family = gguf_reader.gguf_family(gf)
            cfg = gguf_reader.config_from_gguf(gf)
            # Built from the header before any tensor is read: a corrupt tokenizer fails the load
            # at once (no cache entry, no progress bar before the error), and the Model reuses it.
            from jaxspec.tokenizer import Tokenizer

            tokenizer = Tokenizer.from_checkpoint_source(gguf_reader.gguf_tokenizer_metadata(gf), origin=path)
        except BaseException:
            cancel.set()
            raise
        if expected_sha256 is not None and digest.result() != expected_sha256:
            raise CheckpointError(
                f"{path} has sha256 {digest.result()}, not the {expected_sha256} it was joined with: it changed "
                "on disk since; delete it, and the next load joins it again from its parts")
        if use_cache:
            import orbax.checkpoint  # noqa: F401

            entry = gguf_cache_entry(path, digest.result(), weight_format)
            float_entry = gguf_cache_entry(path, digest.result())
    params = _restore_entry(entry, family, cfg, weight_format)
    if params is None:
        host_params = None
        if weight_format is not WeightFormat.F32:
            host_params = jax.device_get(_restore_entry(float_entry, family, cfg, WeightFormat.F32))
        if host_params is None:
            host_params = gguf_reader.params_from_gguf(gf, cfg, progress=progress)
        loaded = [host_params]
        del host_params  # converted weight by weight, each f32 weight dropped once its twin exists
        leaves, treedef = jax.tree.flatten(quant.convert_consuming(loaded, weight_format))
        # On the device before they are saved: jax adopts the dequantized arrays (aligned) without
        # a copy, and orbax writes device arrays without the host copy it makes of numpy ones (a
        # numpy tree of 2.4 GB took 1.9 GB more to save, its device twin nothing, in half the time).
        params = jax.tree.unflatten(treedef, to_jax_consuming(leaves))
        if entry is not None:
            try:
                _sweep_stale_tmp(entry.parent)
                write_atomically(entry, functools.partial(save_params, params))
            except Exception as err:  # a read-only or full cache must not stop the load
                logger.warning("could not write cache entry %s: %s", entry, err)
    return Checkpoint(config=cfg, params=params, tokenizer_source=gguf_reader.gguf_tokenizer_metadata(gf),
                      source=path, tokenizer=tokenizer)


def _read_meta(directory: pathlib.Path) -> dict[str, Any]:
    meta = read_json(directory / JAXSPEC_META)
    if not isinstance(meta, dict):
        raise CheckpointError(f"{directory / JAXSPEC_META} is not a JSON object")
    return meta


def converted_family(directory: pathlib.Path) -> tuple[Family, Any]:
    """(family, config) of a converted directory, its format version checked."""
    meta = _read_meta(directory)
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{directory / JAXSPEC_META} has format_version {meta.get('format_version')!r}; this jaxspec "
            f"reads {FORMAT_VERSION}")
    with config_values_checked(directory / JAXSPEC_META):  # a refusal names the file
        family = models.family_named(meta.get("family", "llama"))
        try:
            return family, family.config_from_dict(meta["config"])
        except (KeyError, TypeError, ValueError, AttributeError, ArithmeticError) as err:
            raise CheckpointError(f"{directory / JAXSPEC_META} holds no valid {family.name} config: {err!r}") from None


def converted_weight_format(directory: pathlib.Path) -> WeightFormat:
    """The weight format a converted directory stores its params in."""
    name = _read_meta(directory).get("weight_format", WeightFormat.F32.value)
    try:
        return WeightFormat.parse(name).resolve("cpu")
    except JaxspecError:
        raise CheckpointError(f"{directory / JAXSPEC_META} names an unknown weight_format {name!r}") from None


def load_converted(directory: pathlib.Path) -> Checkpoint:
    """A directory written by `save_converted`, its params in the format it stores them in."""
    family, cfg = converted_family(directory)
    try:
        params = restore_params(directory / PARAMS_DIR, family, cfg, converted_weight_format(directory))
    except Exception as err:
        raise CheckpointError(f"cannot restore params from {directory / PARAMS_DIR}: {err}") from None
    gguf_tokenizer = directory / GGUF_TOKENIZER_FILE
    tokenizer_source: pathlib.Path | dict[str, Any]
    tokenizer_source = read_json(gguf_tokenizer) if gguf_tokenizer.is_file() else directory
    return Checkpoint(config=cfg, params=params, tokenizer_source=tokenizer_source, source=directory)


def save_converted(checkpoint: Checkpoint, out: pathlib.Path) -> None:
    """Write `checkpoint` as a converted directory at `out` (which must not exist), atomically."""
    family = models.family_of(checkpoint.config)

    def write(tmp: pathlib.Path) -> None:
        tmp.mkdir(parents=True)
        save_params(jax.device_get(checkpoint.params), tmp / PARAMS_DIR)
        tokenizer = checkpoint.tokenizer_source
        if isinstance(tokenizer, dict):
            (tmp / GGUF_TOKENIZER_FILE).write_text(json.dumps(tokenizer, ensure_ascii=False), encoding="utf-8")
        else:
            for file_name in HF_TOKENIZER_FILES:
                if (tokenizer / file_name).is_file():
                    shutil.copy2(tokenizer / file_name, tmp / file_name)
        meta = {
            "format": "jaxspec",
            "format_version": FORMAT_VERSION,
            "family": family.name,
            "config": family.config_to_dict(checkpoint.config),
            "weight_format": quant.format_of(checkpoint.params).value,
            "source": str(checkpoint.source),
        }
        (tmp / JAXSPEC_META).write_text(json.dumps(meta, indent=2), encoding="utf-8")

    write_atomically(out, write)
