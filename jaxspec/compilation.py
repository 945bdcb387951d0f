"""Compiled programs: kept in memory by jit, on disk by XLA's persistent cache, and measured.

Memory: the loop's entry points are module-level `jax.jit` functions with the `LoopSpec`
static, so jit's own cache keeps one program per (spec, argument shapes); nothing else does.
`jax.clear_caches()` empties it.

Disk: `enable_persistent_cache()` (called by `generate` and `stream`) points JAX's persistent
compilation cache at `$JAXSPEC_XLA_CACHE_DIR`, else `<jaxspec cache dir>/xla`
(`jaxspec.paths.cache_dir()`: `$JAXSPEC_CACHE_DIR` or ~/.cache/jaxspec). `JAXSPEC_XLA_CACHE_DIR=off`
disables it; a cache directory the user already set in JAX's own config is left alone. JAX
stores a program only when it took at least `jax_persistent_cache_min_compile_time_secs` (default
1 s) to compile: the real models' programs, not the unit tests' tiny ones.

Measurement: `CompileWatch` sums the compile-time events JAX reports through `jax.monitoring`
while a call runs (tracing, lowering, and the XLA compile or its load from the disk cache), so
stats can report compile seconds apart from run time without a cache of our own. When the first
such event arrives it starts a notice on stderr (`jaxspec: preparing <what> ...`), and when the
call ends it finishes that line with what happened: compiled, or loaded from the disk cache (JAX
reports each persistent-cache hit as an event, which is only known once the lookup is done).
`set_compile_notices(False)` (the CLI's --quiet) turns the notices off.

Numerics: on a GPU every engine program (`full_precision_products`) traces with float32
products at full float32 precision. There XLA's default float32 product is TF32 (a 10-bit
mantissa), which rounds a T = 1 step and a T = k + 1 verify differently, enough for speculative
greedy output to leave plain greedy's and for attention's reference to move from exact
(bench/RESULTS.md, "Pallas kernels on a GPU"). XLA:CPU's float32 products are full precision
already, and the setting is left off there: it changes some of its programs' code, and so the
logits they give.
"""

from __future__ import annotations

import functools
import os
import pathlib
import sys
import threading

import jax
from jax import monitoring
from jax.experimental.compilation_cache import compilation_cache as jax_compilation_cache

from jaxspec.paths import cache_dir

XLA_CACHE_ENV = "JAXSPEC_XLA_CACHE_DIR"
XLA_CACHE_OFF = "off"

# jax.monitoring duration events that together make up a compile (jax/_src/dispatch.py):
# tracing to a jaxpr, lowering to MLIR, and the backend compile, which on a persistent cache hit
# is the time to read the executable back (that read is inside it, so it is not counted apart).
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
COMPILE_EVENTS = frozenset({
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    BACKEND_COMPILE_EVENT,
})
# The event JAX records when a backend compile was served by the persistent cache (jax/_src/compiler.py).
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"

_state = threading.local()
_notices = {"enabled": True}
_open_notice: dict[str, "CompileWatch | None"] = {"watch": None}  # the watch whose stderr line is unfinished
_listener = {"registered": False, "lock": threading.Lock()}
_persistent_cache: dict[str, pathlib.Path | None] = {}


def pins_full_precision() -> bool:
    """Whether engine programs pin full-precision float32 products here: on a GPU (module
    docstring, Numerics). Read when a program is traced."""
    return jax.default_backend() == "gpu"


def full_precision_products(fn):
    """`fn`, traced under `jax.default_matmul_precision("highest")` where `pins_full_precision()`.

    The setting is read when a product is traced, so inside the function it holds whatever the
    caller's context; jit's signature handling (static and donated names) sees `fn`'s own."""

    @functools.wraps(fn)
    def traced_at_full_precision(*args, **kwargs):
        if not pins_full_precision():
            return fn(*args, **kwargs)
        with jax.default_matmul_precision("highest"):
            return fn(*args, **kwargs)

    return traced_at_full_precision


def set_compile_notices(enabled: bool) -> None:
    """Turn the one-line `compiling ...` notice on stderr on (the default) or off."""
    _notices["enabled"] = bool(enabled)


def xla_cache_dir() -> pathlib.Path | None:
    """Where compiled programs persist across runs; None when disabled."""
    configured = os.environ.get(XLA_CACHE_ENV)
    if configured is not None:
        return None if configured.strip().lower() in (XLA_CACHE_OFF, "") else pathlib.Path(configured).expanduser()
    return cache_dir() / "xla"


def enable_persistent_cache() -> pathlib.Path | None:
    """Point JAX's persistent compilation cache at `xla_cache_dir()` (once per process) and
    return the directory in use; None when disabled. A directory already set in JAX's config wins."""
    if "dir" in _persistent_cache:
        return _persistent_cache["dir"]
    already = jax.config.jax_compilation_cache_dir
    if already:
        directory = pathlib.Path(already)
    else:
        directory = xla_cache_dir()
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
            jax.config.update("jax_compilation_cache_dir", str(directory))
            # JAX decides once per process, at its first compile, whether the cache is on; an
            # earlier compile (a model's random init, say) would have decided "off".
            jax_compilation_cache.reset_cache()
    _persistent_cache["dir"] = directory
    return directory


def _on_duration(event: str, duration: float, **_) -> None:
    watch = getattr(_state, "watch", None)
    if watch is not None and event in COMPILE_EVENTS:
        watch.record(event, duration)


def _on_event(event: str, **_) -> None:
    watch = getattr(_state, "watch", None)
    if watch is not None and event == CACHE_HIT_EVENT:
        watch.cache_hits += 1


class CompileWatch:
    """Context manager: compile seconds spent inside it, and a notice while it compiles.

        with CompileWatch("prefill") as watch:
            state = prefill_jit(...)
        watch.seconds  # 0.0 when jit's cache already held the program

    The notice is one line on stderr, begun at the first compile event and finished when the
    block ends: `jaxspec: preparing prefill [...] ... compiled in 2.1 s` or `... loaded from the
    XLA cache in 0.3 s`."""

    def __init__(self, what: str):
        self.what = what
        self.seconds = 0.0
        self.programs = 0  # XLA programs built or loaded inside the block
        self.cache_hits = 0  # of them, loaded from the persistent cache
        self._backend_seconds = 0.0
        self._announced = False

    def record(self, event: str, duration: float) -> None:
        if not self._announced:
            self._announced = _notices["enabled"]
            if self._announced:
                if _open_notice["watch"] is not None:  # an enclosing watch's line: end it here
                    print(file=sys.stderr)
                print(f"jaxspec: preparing {self.what} ...", end="", file=sys.stderr, flush=True)
                _open_notice["watch"] = self
        self.seconds += duration
        if event == BACKEND_COMPILE_EVENT:
            self.programs += 1
            self._backend_seconds += duration

    @property
    def outcome(self) -> str:
        """What the block's compiles came to, for the notice."""
        if self.programs and self.cache_hits >= self.programs:
            return f"loaded from the XLA cache in {self.seconds:.1f} s"
        done = f"compiled in {self.seconds:.1f} s"
        if self.cache_hits:
            return f"{done} ({self.cache_hits} of its {self.programs} programs loaded from the XLA cache)"
        # JAX keeps a program on disk only when its XLA compile took long enough to be worth it.
        kept = (_persistent_cache.get("dir") is not None
                and self._backend_seconds >= jax.config.jax_persistent_cache_min_compile_time_secs)
        return f"{done} (once per shape in a process{'; later runs load it from the XLA cache' if kept else ''})"

    def __enter__(self) -> "CompileWatch":
        with _listener["lock"]:  # one listener for the process; it reports to the innermost watch
            if not _listener["registered"]:
                monitoring.register_event_duration_secs_listener(_on_duration)
                monitoring.register_event_listener(_on_event)
                _listener["registered"] = True
        self._outer = getattr(_state, "watch", None)
        _state.watch = self
        return self

    def __exit__(self, exc_type, *exc) -> None:
        _state.watch = self._outer
        if self._announced:
            outcome = "failed" if exc_type is not None else self.outcome
            # On its own line again where a nested watch's notice came in between.
            start = " " if _open_notice["watch"] is self else f"jaxspec: {self.what}: "
            print(f"{start}{outcome}", file=sys.stderr, flush=True)
            _open_notice["watch"] = None
        if self._outer is not None:
            self._outer.seconds += self.seconds
