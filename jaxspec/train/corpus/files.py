"""A corpus directory's files: their names, atomic writes, and the claims that let several
workers build one corpus at once.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pathlib
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jaxspec.errors import CheckpointError


PLAN_FILE, PROMPTS_FILE, PROMPTS_REPORT_FILE = "plan.json", "prompts.jsonl", "prompts_report.json"
MAGPIE_FILE, PASSAGES_FILE = "pool/magpie.json", "pool/passages.json"
ANSWERS_DIR, TURN2_DIR, SELECTION_FILE = "answers", "turn2", "turn2/selection.json"
DATASET_FILE, MANIFEST_FILE, TIMINGS_FILE = "dataset.npz", "manifest.json", "timings.json"
FORMAT_VERSION = 2  # 2: rounds; the target named by its file name and weight format
ROUND_DIR = "round_{:03d}"


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


def _write_jsonl(path: pathlib.Path, records: Sequence[Mapping[str, Any]]) -> None:
    _write_atomic(path, lambda handle: handle.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


def _read_json(path: pathlib.Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{path} is not readable JSON ({error}); delete it to rebuild that stage") from None


def _read_jsonl(path: pathlib.Path) -> list[dict[str, Any]]:
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
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
    """`read(path)`, `make()` writing it first unless it is there (claimed while it is made)."""
    if not path.is_file():
        with _claim(path):
            if not path.is_file():  # another worker may have finished it meanwhile
                make()
    return read(path)


def _file_sha256(path: str | os.PathLike[str]) -> str:
    return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()


def _shard_path(out_dir: pathlib.Path, stage: str, number: int) -> pathlib.Path:
    return out_dir / stage / f"shard_{number:05d}.jsonl"


def _add_seconds(out_dir: pathlib.Path, stage: str, seconds: float) -> None:
    path = out_dir / TIMINGS_FILE
    timings = _read_json(path) if path.is_file() else {}
    timings[stage] = round(timings.get(stage, 0.0) + seconds, 3)
    _write_json(path, timings)
