"""The native CPU kernels, registered with XLA through jax.ffi, and their call wrappers.

`available()` builds (`jaxspec.cpu.build`) and registers the library once per process. If that
fails, it prints one line saying why and returns False, and jaxspec keeps XLA's products
(`jaxspec.models.backends`). Each wrapper validates shapes and dtypes, names the kernel in its
errors, and emits one `ffi_call` that XLA runs inside the jitted program, on its intra-op thread
pool, with nothing to say to JAX's tracing but shapes.

The instruction-set path is chosen once (`detected_isa`): the widest this CPU supports, or the
one `JAXSPEC_CPU_ISA` names (scalar, avx2, avx512, avx512vnni), refused by name if the CPU lacks
it. A wrapper's `isa=` picks a path per call (tests run every path the machine has).
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.cpu import build
from jaxspec.cpu.packing import PackedWeight
from jaxspec.paths import cache_dir
from jaxspec.errors import InvalidRequestError

DISABLE_ENV = "JAXSPEC_CPU_KERNELS"  # "off": never build or use the native kernels
ISA_ENV = "JAXSPEC_CPU_ISA"
# The instruction-set paths, narrowest first; their numbers are common.h's `Isa`.
ISAS = ("scalar", "avx2", "avx512", "avx512vnni")
TARGETS = ("jaxspec_f32_matmul", "jaxspec_int8_matmul", "jaxspec_q4_matmul", "jaxspec_attention")
MAX_INT8_INPUT = 1 << 16  # an int32 dot of 255 * 127 per term stays exact up to 66,000 terms

_lock = threading.Lock()
_state: dict = {}


def _load() -> ctypes.CDLL:
    """Build (if needed) and register the library, once; raises build.BuildError with the reason."""
    if "library" in _state:
        return _state["library"]
    if "error" in _state:
        raise build.BuildError(_state["error"])
    if os.environ.get(DISABLE_ENV, "").lower() in ("0", "off", "false", "no"):
        _state["error"] = f"{DISABLE_ENV}={os.environ[DISABLE_ENV]}"
        raise build.BuildError(_state["error"])
    try:
        path = build.library_path(cache_dir())
        library = ctypes.cdll.LoadLibrary(str(path))
        for target in TARGETS:
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, target)), platform="cpu")
    except (build.BuildError, OSError, AttributeError) as error:
        _state["error"] = str(error)
        raise build.BuildError(_state["error"]) from None
    library.jaxspec_cpu_supports.restype = ctypes.c_int
    library.jaxspec_cpu_supports.argtypes = (ctypes.c_int64,)
    _state["library"] = library
    _state["path"] = path
    return library


def available(*, notice: bool = True) -> bool:
    """Whether the native kernels are built and registered here (building them on first call).
    When they cannot be, prints one line on stderr saying why (once per process)."""
    with _lock:
        try:
            _load()
            return True
        except build.BuildError as error:
            if notice and not _state.get("noticed"):
                _state["noticed"] = True
                print(f"jaxspec: native CPU kernels unavailable ({error}); using XLA's products", file=sys.stderr)
            return False


def unavailable_reason() -> str | None:
    """Why the native kernels are off, or None when they are in use."""
    return None if available(notice=False) else _state.get("error")


def library_file() -> str | None:
    return str(_state["path"]) if available(notice=False) else None


def supported_isas() -> tuple[str, ...]:
    """The instruction-set paths this CPU runs, narrowest first (needs the library)."""
    library = _load()
    return tuple(name for number, name in enumerate(ISAS) if library.jaxspec_cpu_supports(number))


@functools.cache
def detected_isa() -> str:
    """The path the kernels take: $JAXSPEC_CPU_ISA when set (and supported), else the widest."""
    supported = supported_isas()
    forced = os.environ.get(ISA_ENV)
    if forced:
        if forced not in ISAS:
            raise InvalidRequestError(f"{ISA_ENV}={forced!r}: expected one of {', '.join(ISAS)}")
        if forced not in supported:
            raise InvalidRequestError(f"{ISA_ENV}={forced!r}: this CPU supports only {', '.join(supported)}")
        return forced
    return supported[-1]


def _isa_number(isa: str | None) -> np.int64:
    name = detected_isa() if isa is None else isa
    if name not in ISAS:
        raise InvalidRequestError(f"isa must be one of {', '.join(ISAS)}; got {name!r}")
    if name not in supported_isas():
        raise InvalidRequestError(f"this CPU does not support the {name} path (it has {', '.join(supported_isas())})")
    return np.int64(ISAS.index(name))


def _check_activation(kernel: str, x, in_features: int) -> None:
    if x.ndim != 2 or x.shape[0] != in_features or x.dtype != jnp.float32:
        raise InvalidRequestError(
            f"{kernel}: x must be float32 [I={in_features}, N]; got {x.dtype}{list(x.shape)}")


def _product(kernel: str, weight: PackedWeight, x: jax.Array, operands: tuple, isa: str | None,
             threads: int) -> jax.Array:
    """One ffi_call of the product kernel `kernel` ("f32", "int8", "q4") on a weight packed for it."""
    if weight.kind != kernel:
        raise InvalidRequestError(f"{kernel}_matmul: expected a packed {kernel} weight; got {weight.kind}")
    if kernel != "f32" and weight.in_features > MAX_INT8_INPUT:
        raise InvalidRequestError(f"{kernel}_matmul: input width {weight.in_features} exceeds {MAX_INT8_INPUT}")
    _check_activation(f"{kernel}_matmul", x, weight.in_features)
    call = jax.ffi.ffi_call(f"jaxspec_{kernel}_matmul",
                            jax.ShapeDtypeStruct((weight.out_features, x.shape[1]), jnp.float32),
                            vmap_method="sequential")
    return call(*operands, x, isa=_isa_number(isa), threads=np.int64(threads))


def f32_matmul(weight: PackedWeight, x: jax.Array, *, isa: str | None = None, threads: int = 0) -> jax.Array:
    """float32 W [O, I] (packed) @ x [I, N] -> float32 [O, N] (f32_matmul.cc). `threads`: at most
    this many of XLA's intra-op threads (0: all); `isa`: a path (default `detected_isa()`)."""
    return _product("f32", weight, x, (weight.data,), isa, threads)


def int8_matmul(weight: PackedWeight, x: jax.Array, *, isa: str | None = None, threads: int = 0) -> jax.Array:
    """int8 W [O, I] (packed codes, per-row scales, in the rotated basis) @ x [I, N] -> float32
    [O, N]; the kernel rotates x (`quant.hadamard`) and quantizes it per token (int8_matmul.cc)."""
    return _product("int8", weight, x, (weight.data, weight.scales, weight.corrections), isa, threads)


def q4_matmul(weight: PackedWeight, x: jax.Array, *, isa: str | None = None, threads: int = 0) -> jax.Array:
    """q4 W [O, I] (packed 4-bit codes, per-block scales and minimums) @ x [I, N] -> float32
    [O, N]; the kernel quantizes x per token and block of 32 (q4_matmul.cc)."""
    return _product("q4", weight, x, (weight.data, weight.scales, weight.mins), isa, threads)


def attention(q: jax.Array, keys: jax.Array, values: jax.Array, start: jax.Array, visible: jax.Array, *,
              scale: float, isa: str | None = None, threads: int = 0) -> jax.Array:
    """Decode / verify attention (attention.cc): q float32 [B, T, K, G, H] against keys and values
    float32 [B, K, S, H]; query t of row b sees slots [0, start[b]) and each window slot
    start[b] + m (m < M) where visible[b, t, m] (bool [B, T, M]); q . k is scaled by `scale`.
    Returns float32 [B, T, K, G, H]; a query that sees no slot gets zeros."""
    if q.ndim != 5 or q.dtype != jnp.float32:
        raise InvalidRequestError(f"attention: q must be float32 [B, T, K, G, H]; got {q.dtype}{list(q.shape)}")
    batch, steps, kv_heads, _, head_dim = q.shape
    for name, buffer in (("keys", keys), ("values", values)):
        if buffer.dtype != jnp.float32 or buffer.ndim != 4 or (buffer.shape[0], buffer.shape[1], buffer.shape[3]) != (
                batch, kv_heads, head_dim):
            raise InvalidRequestError(f"attention: {name} must be float32 [B={batch}, K={kv_heads}, S, H={head_dim}]; "
                                      f"got {buffer.dtype}{list(buffer.shape)}")
    if keys.shape != values.shape:
        raise InvalidRequestError(f"attention: keys {list(keys.shape)} and values {list(values.shape)} differ")
    if start.shape != (batch,) or visible.ndim != 3 or visible.shape[:2] != (batch, steps):
        raise InvalidRequestError(f"attention: start must be [B={batch}] and visible [B={batch}, T={steps}, M]; "
                                  f"got {list(start.shape)} and {list(visible.shape)}")
    call = jax.ffi.ffi_call("jaxspec_attention", jax.ShapeDtypeStruct(q.shape, jnp.float32),
                            vmap_method="sequential")
    return call(q, keys, values, start.astype(jnp.int32), visible.astype(jnp.bool_), scale=np.float32(scale),
                isa=_isa_number(isa), threads=np.int64(threads))
