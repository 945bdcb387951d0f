"""Building the native CPU kernels: at first use, with the system C++ compiler, into jaxspec's cache.

Why at first use and not at install: the kernels compile against XLA's FFI headers, which ship
inside the installed jaxlib (`jax.ffi.include_dir()`). A setuptools extension would need jaxlib
inside pip's isolated build environment (a second copy, of whatever version pip resolves there),
and a wheel built on one machine would carry that machine's compiler flags. Built here, the
library matches the jaxlib that loads it, the README's set-up commands stay as they are, and a
machine without a compiler still runs (on XLA's products, saying so once).

The library is one shared object holding every instruction-set path; each path is a function
compiled for its own target (`__attribute__((target(...)))`) and the path is chosen at run time
(`jaxspec.cpu.kernels.detected_isa`), so the binary itself needs nothing beyond baseline x86-64
and a kernel refuses a path the CPU lacks. It is cached under
`<cache dir>/cpu/<key>/libjaxspec_cpu.so`, the key hashing the sources, the compiler's version,
the flags, the machine architecture and the jaxlib version: a changed source, compiler or jaxlib
builds anew, and a build is written to a temporary name and renamed, so concurrent first uses
(test workers) never load half a file.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile

import jax

SOURCE_DIR = pathlib.Path(__file__).resolve().parent
SOURCES = ("isa.cc", "f32_matmul.cc", "int8_matmul.cc", "q4_matmul.cc", "attention.cc")
HEADERS = ("common.h",)
LIBRARY_NAME = "libjaxspec_cpu.so"
FLAGS = ("-O3", "-std=c++17", "-fPIC", "-shared", "-fno-math-errno")  # -shared is ignored with -c
COMPILER_ENV = "CXX"  # the compiler to use; default: c++, then g++


class BuildError(RuntimeError):
    """The kernels could not be built here (no compiler, or it failed); the message says why."""


def compiler() -> str:
    """The C++ compiler: $CXX, else the first of c++ and g++ on PATH."""
    chosen = os.environ.get(COMPILER_ENV)
    if chosen:
        return chosen
    for name in ("c++", "g++"):
        if shutil.which(name):
            return name
    raise BuildError("no C++ compiler found (set CXX, or install g++)")


def _compiler_version(cxx: str) -> str:
    try:
        done = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as error:
        raise BuildError(f"the C++ compiler {cxx!r} does not run: {error}") from None
    if done.returncode != 0:
        raise BuildError(f"the C++ compiler {cxx!r} does not run: {done.stderr.strip()[:200]}")
    return done.stdout.strip()


def build_key(cxx: str) -> str:
    """What a cached library must match: sources, compiler, flags, architecture, jaxlib."""
    digest = hashlib.sha256()
    for name in SOURCES + HEADERS:
        digest.update(name.encode() + b"\0" + (SOURCE_DIR / name).read_bytes() + b"\0")
    import jaxlib

    for part in (_compiler_version(cxx), " ".join(FLAGS), platform.machine(), jaxlib.__version__):
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()[:24]


def _run_all(commands: list[list[str]], cxx: str) -> None:
    """Run the compiler commands side by side; BuildError with the first failure's last line."""
    try:
        running = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                   for command in commands]
    except OSError as error:
        raise BuildError(f"{cxx} failed to run: {error}") from None
    failures = []
    for process in running:
        try:
            _, stderr = process.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            process.kill()
            stderr = "timed out after 600 s"
        if process.returncode != 0:
            last = stderr.strip().splitlines()[-1:] or ["(no message)"]
            failures.append(f"{cxx} failed (exit {process.returncode}): {last[0][:300]}")
    if failures:
        raise BuildError(failures[0])


def library_path(cache_root: pathlib.Path) -> pathlib.Path:
    """The built library, compiling it first if this key has none yet. Raises BuildError."""
    cxx = compiler()
    target = cache_root / "cpu" / build_key(cxx) / LIBRARY_NAME
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        # One compiler per source, all at once (the cores share the first use's wait), then a link.
        objects = [pathlib.Path(scratch) / f"{pathlib.Path(source).stem}.o" for source in SOURCES]
        _run_all([[cxx, *FLAGS, "-c", "-isystem", jax.ffi.include_dir(), str(SOURCE_DIR / source), "-o", str(obj)]
                  for source, obj in zip(SOURCES, objects, strict=True)], cxx)
        partial = pathlib.Path(scratch) / LIBRARY_NAME
        _run_all([[cxx, *FLAGS, *(str(obj) for obj in objects), "-o", str(partial)]], cxx)
        os.replace(partial, target)
    return target
