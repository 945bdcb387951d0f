"""A corpus directory's files: their names, atomic writes, and the claims that let several
workers build one corpus at once.

The JSONL files (prompts, answer and second-turn shards) are gzip-compressed (NAME.jsonl.gz,
the standard library's gzip format, about a sixth of the text's size), written with nothing of
the moment in them (no time stamp, no file name) so that the same records give the same bytes.
A corpus built before that holds plain NAME.jsonl files: every reader takes either (`_stored`),
so such a corpus still resumes, its finished files left as they are and new ones compressed.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import os
import pathlib
import socket
import struct
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jaxspec.errors import CheckpointError


PLAN_FILE, PROMPTS_FILE, PROMPTS_REPORT_FILE = "plan.json", "prompts.jsonl.gz", "prompts_report.json"
MAGPIE_FILE, PASSAGES_FILE = "pool/magpie.json", "pool/passages.json"
ANSWERS_DIR, TURN2_DIR, SELECTION_FILE = "answers", "turn2", "turn2/selection.json"
DATASET_FILE, MANIFEST_FILE, TIMINGS_FILE = "dataset.npz", "manifest.json", "timings.json"
FORMAT_VERSION = 2  # 2: rounds; the target named by its file name and weight format
ROUND_DIR = "round_{:03d}"
JSONL_SUFFIX, LEGACY_JSONL_SUFFIX = ".jsonl.gz", ".jsonl"  # written; read too (a corpus from before gzip)


def _write_atomic(path: pathlib.Path, write: Callable[[Any], None], binary: bool = False) -> None:
    """Write via a temporary file and a rename: a killed run never leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(temporary, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as handle:
        write(handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def _write_json(path: pathlib.Path, value: Any) -> None:
    _write_atomic(path, lambda handle: json.dump(value, handle, indent=1, ensure_ascii=False))


def _gzip_bytes(data: bytes) -> bytes:
    """`data` as one gzip member (RFC 1952) with nothing of the moment in it: mtime 0, no file
    name, OS "unknown" (255), deflated at level 9 in one call, so the same data gives the same
    bytes (under one zlib version) on any machine and at any time. The header is the one
    `gzip.GzipFile(filename="", mtime=0)` writes; `gzip.decompress` and the gzip tool read it."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    body = compressor.compress(data) + compressor.flush()
    header = b"\x1f\x8b\x08\x00" + struct.pack("<I", 0) + b"\x02\xff"  # magic, deflate, no flags, mtime, xfl, OS
    return header + body + struct.pack("<II", zlib.crc32(data), len(data) & 0xFFFFFFFF)


def _write_jsonl(path: pathlib.Path, records: Sequence[Mapping[str, Any]]) -> None:
    """One JSON object a line; gzip-compressed (`_gzip_bytes`) when the name ends in .gz, as
    every corpus JSONL file's name does (`PROMPTS_FILE`, `_shard_path`)."""
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")
    data = _gzip_bytes(text) if path.name.endswith(".gz") else text
    _write_atomic(path, lambda handle: handle.write(data), binary=True)


def _legacy_path(path: pathlib.Path) -> pathlib.Path:
    """The plain NAME.jsonl a corpus built before gzip holds where this one writes NAME.jsonl.gz."""
    if path.name.endswith(JSONL_SUFFIX):
        return path.with_name(path.name[: -len(JSONL_SUFFIX)] + LEGACY_JSONL_SUFFIX)
    return path


def _stored(path: pathlib.Path) -> pathlib.Path | None:
    """The file that holds `path`'s records: `path` itself, or its plain legacy form
    (`_legacy_path`); None if neither is there."""
    for candidate in dict.fromkeys((path, _legacy_path(path))):
        if candidate.is_file():
            return candidate
    return None


def _is_made(path: pathlib.Path) -> bool:
    """Whether the file `path` names is there, in either form (`_stored`)."""
    return _stored(path) is not None


def _read_json(path: pathlib.Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{path} is not readable JSON ({error}); delete it to rebuild that stage") from None


def _jsonl_text(path: pathlib.Path) -> tuple[pathlib.Path, str]:
    """(the file read, its text): `path`, or its plain legacy form (`_stored`), decompressed if
    gzip; a missing file raises FileNotFoundError naming `path`."""
    stored = _stored(path)
    if stored is None:
        raise FileNotFoundError(f"no such file: {path} (nor {_legacy_path(path).name})")
    data = stored.read_bytes()
    if stored.name.endswith(".gz"):
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as error:
            raise CheckpointError(f"{stored} is not readable gzip ({error}); delete the file to regenerate "
                                  "it") from None
    try:
        return stored, data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise CheckpointError(f"{stored} is not UTF-8 text ({error}); delete the file to regenerate it") from None


def _read_jsonl(path: pathlib.Path) -> list[dict[str, Any]]:
    """The records of a JSONL file: NAME.jsonl.gz, or the plain NAME.jsonl of a corpus built
    before gzip (`_stored`)."""
    path, text = _jsonl_text(path)
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as error:
            raise CheckpointError(f"{path}:{number}: not valid JSON ({error.msg}); delete the file to "
                                  "regenerate it") from None
    return records


class _Busy(Exception):
    """A file this build needs is being made by another live worker."""


CLAIM_POLL_SECONDS = 30.0
_EMPTY_CLAIM_SECONDS = 60.0  # a claim file still empty after this long: its writer died creating it


def _claim_path(path: pathlib.Path) -> pathlib.Path:
    return path.with_name(f".{path.name}.claim")


def _claimant_alive(claim: pathlib.Path) -> bool:
    """Whether the worker that wrote `claim` ("host pid") may still be making its file: a process
    of this host that is gone is not; one of another host (a shared directory) is assumed alive."""
    try:
        text = claim.read_text(encoding="utf-8").split()
        age = time.time() - claim.stat().st_mtime
    except FileNotFoundError:
        return False
    if len(text) != 2 or not text[1].isdigit():
        return age < _EMPTY_CLAIM_SECONDS
    host, pid = text[0], int(text[1])
    if host != socket.gethostname():
        return True
    if pid == os.getpid():
        return False  # our own, left by an interrupted attempt in this process
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def _claim(path: pathlib.Path):
    """Claim the making of `path` for this process, or raise _Busy if a live worker holds it.

    Several processes may build one corpus at once: each claims a file before it makes it (a
    `.NAME.claim` beside it, created exclusively, holding host and pid) and releases it once the
    file is written; a claim whose process is gone is taken over. Two workers taking over the
    same dead claim at the same instant may both make the file: the work is repeated, never
    wrong (the same deterministic content, each write atomic)."""
    claim = _claim_path(path)
    claim.parent.mkdir(parents=True, exist_ok=True)
    while True:
        try:
            handle = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            break
        except FileExistsError:
            if _claimant_alive(claim):
                raise _Busy(path) from None
            claim.unlink(missing_ok=True)
    with os.fdopen(handle, "w", encoding="utf-8") as out:
        out.write(f"{socket.gethostname()} {os.getpid()}\n")
    try:
        yield
    finally:
        claim.unlink(missing_ok=True)


def _made_once(path: pathlib.Path, read: Callable[[pathlib.Path], Any], make: Callable[[], None]) -> Any:
    """`read(path)`, `make()` writing it first unless it is there (claimed while it is made; a
    JSONL file in either form, `_is_made`)."""
    if not _is_made(path):
        with _claim(path):
            if not _is_made(path):  # another worker may have finished it meanwhile
                make()
    return read(path)


def _file_sha256(path: str | os.PathLike[str]) -> str:
    return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()


def _shard_path(out_dir: pathlib.Path, stage: str, number: int) -> pathlib.Path:
    """Where shard `number` of `stage` is written (shard_NNNNN.jsonl.gz; a corpus from before gzip
    holds shard_NNNNN.jsonl: `_stored`)."""
    return out_dir / stage / f"shard_{number:05d}{JSONL_SUFFIX}"


def _shard_numbers(out_dir: pathlib.Path, stage: str) -> set[int]:
    """The numbers of the shards of `stage` written, in either form."""
    numbers = set()
    for suffix in (JSONL_SUFFIX, LEGACY_JSONL_SUFFIX):
        for path in (out_dir / stage).glob(f"shard_*{suffix}"):
            number = path.name[len("shard_"): -len(suffix)]
            if number.isdigit():
                numbers.add(int(number))
    return numbers


def _add_seconds(out_dir: pathlib.Path, stage: str, seconds: float) -> None:
    path = out_dir / TIMINGS_FILE
    timings = _read_json(path) if path.is_file() else {}
    timings[stage] = round(timings.get(stage, 0.0) + seconds, 3)
    _write_json(path, timings)
