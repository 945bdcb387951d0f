"""Shared by the bench scripts: bench/RESULTS.md holds one `## ` section per script, each script
replacing only its own; the output options every script takes (`add_output_options`); the peer
library versions a report names; and the `--formats` option (which weight formats a script runs)."""

from __future__ import annotations

import datetime
import os
import pathlib
import platform
import re
import sys

RESULTS = pathlib.Path(__file__).with_name("RESULTS.md")


def add_output_options(parser, *, calls: int | None = None) -> None:
    """The options every bench script takes: `--results` (the RESULTS.md its section goes to),
    `--no-write` (print only), and, for a script that times each program as a median of repeated
    calls, `--calls` with its default."""
    if calls is not None:
        parser.add_argument("--calls", type=int, default=calls, help=f"timed calls per measured program, "
                            f"whose median is reported (default {calls})")
    parser.add_argument("--results", type=pathlib.Path, default=RESULTS,
                        help="the results file whose section this script replaces (default bench/RESULTS.md)")
    parser.add_argument("--no-write", action="store_true", help="print the results; leave the results file alone")


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


def publish(section: str, heading: str, path: pathlib.Path, write: bool = True) -> None:
    """Print a script's table; unless told not to (`--no-write`), put it in RESULTS.md as its section."""
    print(section)
    if write:
        replace_section(path, heading, section)
        print(f"wrote {path}")


def command_line(script: str, argv: list[str] | None) -> str:
    """A section's last line: the command that wrote it, `script` (e.g. "heads.py") with its
    arguments (`argv`, or the process's own when None)."""
    return "Command: `" + " ".join([f"python bench/{script}", *(sys.argv[1:] if argv is None else argv)]) + "`"


def run_stamp(load: tuple[float, float], *, commit: str | None = None, detail: str = "") -> str:
    """A section's first words: the date (and the jaxspec commit measured, when given), the
    machine and how loaded it was (the 1-minute load average at the start and the end of the
    run), then `detail` about how the run was timed, inside the same parenthesis."""
    measured = f", jaxspec {commit}" if commit else ""
    how = f"; {detail}" if detail else ""
    return (f"{datetime.date.today().isoformat()}{measured}; {platform.machine()}, {os.cpu_count()} cores, shared "
            f"(1-minute load average {load[0]:.1f} at the start, {load[1]:.1f} at the end{how}).")


def peer_versions() -> str:
    """"torch X, transformers Y" for a report's header (the HF peers' versions)."""
    try:
        import torch
        import transformers

        return f"torch {torch.__version__}, transformers {transformers.__version__}"
    except ImportError:
        return "transformers not installed"


def weight_formats(text: str) -> list[str]:
    """argparse type for `--formats`: "f32,bf16,int8" -> ["f32", "bf16", "int8"], each a concrete
    jaxspec weight format ("auto" resolved for this backend), duplicates dropped, order kept."""
    import argparse

    from jaxspec.errors import InvalidRequestError
    from jaxspec.models.quant import WeightFormat

    names = []
    for item in text.split(","):
        try:
            name = WeightFormat.parse(item.strip().lower()).resolve().value
        except InvalidRequestError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
        if name not in names:
            names.append(name)
    return names
