"""Shared by the bench scripts: bench/RESULTS.md holds one `## ` section per script, each script
replacing only its own; the output options every script takes (`add_output_options`); the peer
library versions a report names; the CPU a figure ran on (model and ISA flags: the same code ran 2x
apart on two CPUs here); and the `--formats` option (which weight formats, on which product
backends, a script runs)."""

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
    return (f"{datetime.date.today().isoformat()}{measured}; {cpu_description()}, {os.cpu_count()} cores, shared "
            f"(1-minute load average {load[0]:.1f} at the start, {load[1]:.1f} at the end{how}).")


# The ISA flags (as /proc/cpuinfo names them) that decide a CPU's matmul speed.
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni", "avx512_bf16",
             "amx_int8", "amx_bf16")


def cpu_description() -> str:
    """"<CPU model> [flags ...]" from /proc/cpuinfo (the machine architecture where it has none)."""
    try:
        info = pathlib.Path("/proc/cpuinfo").read_text(encoding="utf-8")
    except OSError:
        return platform.machine()
    def field(name: str) -> str | None:
        found = re.search(rf"^{name}\s*:\s*(.+)$", info, re.M)
        return found.group(1).strip() if found else None

    present = set((field("flags") or "").split())
    shown = [flag for flag in ISA_FLAGS if flag in present]
    family = f" (family {field('cpu family')} model {field('model')})" if field("cpu family") else ""
    return f"{field('model name') or platform.machine()}{family} [{' '.join(shown) or 'no AVX2'}]"


def isa_heading(heading: str) -> str:
    """A section heading for this run: its own when JAXSPEC_CPU_ISA forces the native kernels'
    path, so a run on the AVX2 path keeps the widest path's table beside it."""
    forced = os.environ.get("JAXSPEC_CPU_ISA")
    return f"{heading[:-1]}, JAXSPEC_CPU_ISA={forced})" if forced else heading


def peer_versions() -> str:
    """"torch X, transformers Y" for a report's header (the HF peers' versions)."""
    try:
        import torch
        import transformers

        return f"torch {torch.__version__}, transformers {transformers.__version__}"
    except ImportError:
        return "transformers not installed"


def weight_formats(text: str) -> list[str]:
    """argparse type for `--formats`: "f32,int8/xla,bf16" -> ["f32", "int8/xla", "bf16"]: each a
    concrete jaxspec weight format ("auto" resolved for this backend), optionally with the product
    backend to load it on after a slash (jaxspec.models.backends: auto, the default, xla or
    native); duplicates dropped, order kept. `load_variant` loads one."""
    import argparse

    from jaxspec.errors import InvalidRequestError
    from jaxspec.models.backends import Products
    from jaxspec.models.quant import WeightFormat

    names = []
    for item in text.split(","):
        fmt, _, products = item.strip().lower().partition("/")
        try:
            name = WeightFormat.parse(fmt).resolve().value
            if products and Products.parse(products) is not Products.AUTO:
                name += f"/{Products.parse(products).value}"
        except InvalidRequestError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
        if name not in names:
            names.append(name)
    return names


def load_variant(variant: str, model: str | None = None):
    """One `--formats` entry loaded: (label, Model), the label "<format> <backend>" as resolved
    here (e.g. "int8 native", "bf16 xla")."""
    import jaxspec

    fmt, _, products = variant.partition("/")
    loaded = jaxspec.load(*([model] if model else []), weight_format=fmt, products=products or "auto")
    return f"{fmt} {loaded.products.name.value}", loaded
