"""The decode kernel's tuned table: where `attention="auto"` runs `flash_decode` on a GPU, and how.

A row is what bench/gpu_run.py's sweep measured on one GPU kind (`jax.devices()[0].device_kind`):
for a shape class (decode or verify) and a K/V format, the best kernel parameters it found and
XLA's attention time over the kernel's at those parameters (`speedup`; for decode the worse of
full and ragged rows, since which one a batch is becomes known only when it runs). "auto" takes
the kernel where a row's speedup reaches WIN_MARGIN, and XLA's attention (the reference)
everywhere else. On a GPU kind without any row it says so once, in a logged warning: an
untuned kernel was slower than XLA there (bench/RESULTS.md, "Pallas kernels on a GPU").

The sweep prints its rows in exactly `Tuned(...)`'s form, to paste into TUNED; `GRID` is the
parameter grid it searches and tests/test_tuning.py lowers for CUDA.
"""

from __future__ import annotations

import dataclasses
import logging

import jax

from jaxspec.choice import Choice
from jaxspec.pallas.kv_quant import Format

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelParams:
    """`flash_decode`'s tiling and its Triton compile options; the defaults are its own."""

    block_s: int = 64  # cache slots per inner step of a program
    split_size: int = 512  # cache slots per program (S is split across programs, merged after)
    num_warps: int = 4
    num_stages: int = 2  # Triton's software-pipelining depth over the block loop


class ShapeClass(Choice):
    """What a call looks like when it is traced: its length per row is known only at run time."""

    DECODE = "decode"  # T = 1: a plain decode step
    VERIFY = "verify"  # T > 1: a chain's or a tree's verify

    @classmethod
    def of(cls, steps: int) -> "ShapeClass":
        return cls.DECODE if steps == 1 else cls.VERIFY


@dataclasses.dataclass(frozen=True)
class Tuned:
    device_kind: str  # as jax.devices()[0].device_kind names it, e.g. "NVIDIA H100 80GB HBM3"
    shape_class: ShapeClass
    kv_format: str  # "keys/values", e.g. "q8_0/q5_1" (as jaxspec.KVFormat prints)
    params: KernelParams
    speedup: float  # XLA's time / the kernel's, measured with `params`


# The kernel must beat XLA by more than run-to-run noise before "auto" trades XLA for it.
WIN_MARGIN = 1.05

# Measured rows, pasted from bench/gpu_run.py's sweep; none yet (no GPU run of the sweep so far).
TUNED: tuple[Tuned, ...] = ()

# The sweep's search space (bench/gpu_run.py: block_s x split_size first, then warps x stages).
GRID = {"block_s": (16, 32, 64, 128), "split_size": (256, 512, 1024, 2048), "num_warps": (2, 4, 8),
        "num_stages": (1, 2, 3)}

_told: set[str] = set()  # the GPU kinds already warned about


def device_kind() -> str:
    return jax.devices()[0].device_kind


def kv_format_name(key_format: Format, value_format: Format) -> str:
    return f"{key_format.value}/{value_format.value}"


def lookup(kind: str, shape_class: ShapeClass, kv_format: str) -> Tuned | None:
    """The table's row for this GPU kind, shape class and K/V format, or None."""
    for row in TUNED:
        if (row.device_kind, row.shape_class, row.kv_format) == (kind, shape_class, kv_format):
            return row
    return None


def auto_params(steps: int, key_format: Format, value_format: Format) -> KernelParams | None:
    """The kernel's parameters where the table says it beats XLA on this GPU, else None (XLA).

    A GPU kind with no row at all is logged once: "auto" then means XLA's attention there."""
    kind = device_kind()
    if not any(row.device_kind == kind for row in TUNED):
        if kind not in _told:
            _told.add(kind)
            logger.warning("jaxspec: the decode kernel is not tuned for %r (jaxspec/pallas/tuning.py); "
                           "attention='auto' runs XLA's attention on it (bench/gpu_run.sh tunes it)", kind)
        return None
    row = lookup(kind, ShapeClass.of(steps), kv_format_name(key_format, value_format))
    return row.params if row is not None and row.speedup >= WIN_MARGIN else None
