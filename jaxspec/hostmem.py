"""Host memory while weights load: arrays XLA:CPU adopts without a copy, and freed memory handed
back to the OS. A load that builds each weight once and drops what it replaced, piece by piece,
peaks near one copy of its weights (jaxspec.api.load, jaxspec.checkpoints.store); these make the
pieces cheap to hand over and the drops show in resident memory."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import numpy as np

HOST_ALIGNMENT = 64  # bytes: XLA:CPU adopts a host buffer aligned to this without copying it


def aligned_empty(shape: tuple[int, ...], dtype) -> np.ndarray:
    """An uninitialised numpy array whose data starts on a HOST_ALIGNMENT boundary, so that
    `jax.device_put` on a CPU adopts it instead of copying (numpy's own arrays start 16 bytes
    past one, and every device_put of them is a copy)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    buffer = np.empty(nbytes + HOST_ALIGNMENT, np.uint8)
    start = -buffer.ctypes.data % HOST_ALIGNMENT
    return buffer[start : start + nbytes].view(dtype).reshape(shape)


def aligned(array: np.ndarray) -> np.ndarray:
    """`array` as a C-contiguous numpy array on a HOST_ALIGNMENT boundary (itself if it is one)."""
    array = np.asarray(array)
    if array.flags.c_contiguous and array.ctypes.data % HOST_ALIGNMENT == 0:
        return array
    out = aligned_empty(array.shape, array.dtype)
    out[...] = array
    return out


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc's; absent elsewhere (musl, macOS)
    except (OSError, AttributeError):
        return None


def release_freed_memory() -> None:
    """Hand the host memory freed so far back to the OS (glibc's `malloc_trim`; a no-op without
    it). glibc keeps freed blocks in the arena of the thread that freed them, and the next large
    array may come from another: a load that replaces its weights piece by piece otherwise
    grows its resident memory by the weights it has already dropped."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
