"""Where jaxspec keeps what it derives on a machine: one cache directory for converted params,
assembled models, the native kernels' library and XLA's compiled programs."""

from __future__ import annotations

import os
import pathlib


def cache_dir() -> pathlib.Path:
    """$JAXSPEC_CACHE_DIR, else ~/.cache/jaxspec."""
    env = os.environ.get("JAXSPEC_CACHE_DIR")
    return pathlib.Path(env).expanduser() if env else pathlib.Path.home() / ".cache" / "jaxspec"
