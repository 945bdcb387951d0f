"""bench/RESULTS.md holds one `## ` section per benchmark script; each script replaces only its own."""

from __future__ import annotations

import pathlib
import re


def replace_section(path: pathlib.Path, heading: str, section: str) -> None:
    """Replace the section starting at `heading` (up to the next `## `), or append it; keep the rest."""
    text = path.read_text(encoding="utf-8") if path.exists() else "# Benchmark results\n"
    pattern = re.compile(rf"^{re.escape(heading)}\n.*?(?=^## |\Z)", re.S | re.M)
    block = section.rstrip("\n") + "\n\n"
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text, count=1)
    else:
        text = text.rstrip("\n") + "\n\n" + block
    path.write_text(text.rstrip("\n") + "\n", encoding="utf-8")
