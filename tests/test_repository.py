"""The repository itself: the tracked tree stays small enough to travel (the GPU machines the
benchmarks run on take a working tree of at most 64 MiB; issue 60)."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
TRACKED_LIMIT = 40 * 2**20  # bytes: room under the 64 MiB a device machine accepts


def tracked_sizes() -> dict[str, int]:
    """Every file `git ls-files` lists, with its size in bytes (a file deleted in the working tree,
    or a submodule, counts nothing); skips unless ROOT is the top of a git checkout."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    try:
        top = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--show-toplevel"], capture_output=True,
                             check=True, text=True).stdout.strip()
        listing = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not inside a git checkout")
    if pathlib.Path(top).resolve() != ROOT:
        pytest.skip(f"{ROOT} is not the top of its git checkout ({top})")
    sizes = {}
    for name in filter(None, listing.split(b"\0")):
        path = ROOT / os.fsdecode(name)
        if path.is_symlink() or path.is_file():
            sizes[os.fsdecode(name)] = path.lstat().st_size
    return sizes


def test_the_tracked_tree_stays_under_40_mib():
    sizes = tracked_sizes()
    assert sizes, "git ls-files listed no file"
    total = sum(sizes.values())
    largest = sorted(sizes.items(), key=lambda item: (-item[1], item[0]))[:10]
    listing = "\n".join(f"  {size:>12,} B  {name}" for name, size in largest)
    assert total <= TRACKED_LIMIT, (
        f"the files git ls-files lists sum to {total:,} bytes ({total / 2**20:.1f} MiB), over the "
        f"{TRACKED_LIMIT / 2**20:.0f} MiB that keeps the tree under a device machine's 64 MiB. The ten largest:\n"
        f"{listing}")
