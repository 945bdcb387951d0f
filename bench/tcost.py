"""The T-cost curve: one target forward at T = 1..16 new tokens, per weight format and product backend.

    . .venv/bin/activate && python bench/tcost.py
    . .venv/bin/activate && python bench/tcost.py --formats f32,int8 --calls 5 --no-write   # a quick look
    . .venv/bin/activate && JAXSPEC_CPU_ISA=avx2 python bench/tcost.py   # the native kernels' AVX2 path
    . .venv/bin/activate && python bench/tcost.py --fusion    # fused vs separate q/k/v, gate/up

A speculative round with k drafts verifies T = k + 1 tokens in one target forward, so drafting
pays only while the tokens a round commits outgrow cost(T) / cost(1). That ratio depends on the
weight format and on the code computing its products (jaxspec.models.backends): XLA's float32
and bfloat16 products are matrix-vector at T = 1 and matrix-matrix after; XLA's int8 (W8A8)
pads one-column products to two, so its T = 1 costs what T = 2 does, and its curve is read
against T = 2 as well as T = 1; the native CPU kernels stream each weight once for all T tokens.
`--formats` entries take a backend after a slash (default f32,f32/xla,int8,int8/xla,bf16: on a
CPU where the native kernels build, f32 and int8 are native).

Default model (SmolLM2-135M-Instruct) loaded once per entry with `jaxspec.load(weight_format=..., products=...)`
(the first bf16 / int8 load converts and caches, later ones restore). Batch 1, a cache of
`--capacity` 256 slots holding `--length` 100 tokens (the cache a short prompt plus 128 new tokens
runs with), each (format, T) jitted once; every timed call runs `--iters` forwards in a
`fori_loop` with the cache carried in place, as the generation loop runs them
(bench/forward_cost.py), and the figure is the median over `--calls` calls, interleaved across
formats and T so that drift on a shared machine hits them alike. The table replaces the
`## T-cost curve (bench/tcost.py)` section of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

import jax

from forward_cost import forward_costs  # bench/ is on sys.path when a bench script runs
from results_md import add_output_options, isa_heading, load_variant, publish, run_stamp, weight_formats

HERE = pathlib.Path(__file__).resolve().parent
SECTION = "## T-cost curve (bench/tcost.py)"
FUSION_SECTION = "## Fused projections (bench/tcost.py --fusion)"
FUSION_TS = (1, 2, 8)  # a T = 1 forward, the padded-to-two one, the 8-token one int8 decoding runs
RERUN = ". .venv/bin/activate && python bench/tcost.py"


def measure(args) -> tuple[dict, dict]:
    """{(label, T): median seconds of one forward}, and {label: weight MB}; a label is a format and
    its backend ("int8 native"), and `args.labels` lists them in `--formats` order."""
    variants, weight_mb, args.labels = {}, {}, []
    for variant in args.formats:
        label, model = load_variant(variant)
        args.labels.append(label)
        weight_mb[label] = sum(leaf.nbytes for leaf in jax.tree.leaves(model.params)) / 1e6
        for steps in range(1, args.max_t + 1):
            variants[(label, steps)] = (model.params, model.config, steps)
    print(f"compiling {len(variants)} programs, then {args.calls} timed rounds", flush=True)
    return forward_costs(variants, args.capacity, args.length, args.calls, iters=args.iters), weight_mb


def measure_fusion(args) -> dict:
    """{(format, "fused" | "separate", T): median seconds of one forward}: q/k/v and gate/up as one
    product each (what `jaxspec.load` gives) against three and two (`layers.unfuse_projections`)."""
    from jaxspec.models import backends
    from jaxspec.models.layers import unfuse_projections

    variants, args.labels = {}, []
    for variant in args.formats:
        label, model = load_variant(variant)
        args.labels.append(label)
        standard = backends.standard(model.params)  # unfused, then laid out for its backend again
        separate = backends.apply(unfuse_projections(standard), model.products.name)
        for layout, params in (("fused", model.params), ("separate", separate)):
            for steps in FUSION_TS:
                variants[(label, layout, steps)] = (params, model.config, steps)
    print(f"compiling {len(variants)} programs, then {args.calls} timed rounds", flush=True)
    return forward_costs(variants, args.capacity, args.length, args.calls, iters=args.iters)


def build_fusion_section(args, costs: dict, machine: dict) -> str:
    lines = [FUSION_SECTION, "",
             f"{run_stamp(machine['load'])} One forward of the default model as in the T-cost curve (cache {args.capacity} holding {args.length}, "
             f"median over {args.calls} calls of {args.iters} forwards, interleaved), with q/k/v and gate/up "
             "fused into one product each (as `jaxspec.load` gives them) or separate.", "",
             f"Rerun: `{RERUN} --fusion`", "",
             "| format | T | fused ms | separate ms | separate / fused |", "|---|---:|---:|---:|---:|"]
    for fmt in args.labels:
        for steps in FUSION_TS:
            fused, separate = costs[(fmt, "fused", steps)], costs[(fmt, "separate", steps)]
            lines.append(f"| {fmt} | {steps} | {1e3 * fused:.1f} | {1e3 * separate:.1f} | {separate / fused:.2f} |")
    lines.append("")
    return "\n".join(lines)


def _native_path() -> str:
    """", native kernels on the <isa> path" where they serve here."""
    from jaxspec.cpu import kernels

    if jax.default_backend() != "cpu" or not kernels.available(notice=False):
        return ""
    return f", native kernels on the {kernels.detected_isa()} path"


def build_section(args, costs: dict, weight_mb: dict, machine: dict) -> str:
    formats = args.labels
    # The float32 row the others are read against: XLA's where measured (the reference), else the first.
    f32_rows = [label for label in formats if label.startswith("f32")]
    reference = next((label for label in f32_rows if label.endswith("xla")), f32_rows[0] if f32_rows else None)
    lines = [isa_heading(SECTION), ""]
    lines.append(
        f"{run_stamp(machine['load'])} jax {jax.__version__} on {jax.default_backend()}{_native_path()}. SmolLM2-135M-Instruct, batch 1, a cache of "
        f"{args.capacity} slots holding {args.length} tokens; one forward of T new tokens (all T logits), "
        f"median over {args.calls} calls of {args.iters} forwards each, interleaved across formats and T. "
        f"Weights: " + ", ".join(f"{fmt} {weight_mb[fmt]:.0f} MB" for fmt in formats)
        + f". Run took {machine['seconds']:.0f} s.")
    lines.append("")
    lines.append(f"Rerun: `{RERUN}`")
    lines.append("")
    header = "| T |" + "".join(f" {fmt} ms | {fmt} / T=1 | {fmt} / T=2 |" for fmt in formats)
    others = [fmt for fmt in formats if fmt != reference] if reference else []
    header += "".join(f" {fmt} / {reference} |" for fmt in others)
    lines.append(header)
    lines.append("|---:|" + "---:|" * (3 * len(formats) + len(others)))
    for steps in range(1, args.max_t + 1):
        row = f"| {steps} |"
        for fmt in formats:
            cost = costs[(fmt, steps)]
            # T = 2 is the baseline a T = 1 row is read against only when max_t reaches it.
            vs_two = f"{cost / costs[(fmt, 2)]:.2f}" if (fmt, 2) in costs else "-"
            row += f" {1e3 * cost:.1f} | {cost / costs[(fmt, 1)]:.2f} | {vs_two} |"
        row += "".join(f" {costs[(fmt, steps)] / costs[(reference, steps)]:.2f} |" for fmt in others)
        lines.append(row)
    lines.append("")
    last = args.max_t
    if last > 2:
        # From T = 2 on every product is matrix-matrix in every format: a straight line fits there.
        slopes = "; ".join(
            f"{fmt} {1e3 * (costs[(fmt, last)] - costs[(fmt, 2)]) / (last - 2):.2f} ms" for fmt in formats)
        lines.append(f"Extra cost per token from T=2 to T={last}: {slopes}. A round of k drafts pays when the "
                     "tokens it commits exceed cost(k + 1) / cost(1) plus the drafting cost; read XLA's int8 "
                     "against T=2 as well, since its one-column products are padded to two.")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", type=weight_formats, default=["f32", "f32/xla", "int8", "int8/xla", "bf16"],
                        help="weight formats, each optionally /xla or /native, comma separated "
                             "(default f32,f32/xla,int8,int8/xla,bf16)")
    parser.add_argument("--max-t", type=int, default=16, help="T = 1 .. this (default 16)")
    parser.add_argument("--capacity", type=int, default=256, help="cache slots (default 256)")
    parser.add_argument("--length", type=int, default=100, help="tokens already in the cache (default 100)")
    parser.add_argument("--iters", type=int, default=4, help="forwards per timed call (default 4)")
    parser.add_argument("--fusion", action="store_true",
                        help="instead: fused vs separate q/k/v and gate/up products per format, at T = 1, 2, 8")
    add_output_options(parser, calls=30)
    args = parser.parse_args(argv)
    for name in ("max_t", "calls", "iters"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.length + args.max_t > args.capacity:
        parser.error(f"--length {args.length} + --max-t {args.max_t} overruns --capacity {args.capacity}")

    began, load_before = time.perf_counter(), os.getloadavg()
    if args.fusion:
        costs = measure_fusion(args)
        machine = dict(load=(load_before[0], os.getloadavg()[0]), seconds=time.perf_counter() - began)
        heading, section = FUSION_SECTION, build_fusion_section(args, costs, machine)
    else:
        costs, weight_mb = measure(args)
        machine = dict(load=(load_before[0], os.getloadavg()[0]), seconds=time.perf_counter() - began)
        heading, section = isa_heading(SECTION), build_section(args, costs, weight_mb, machine)
    print()
    publish(section, heading, args.results, write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
