"""Decode attention's product layout on XLA:CPU: the scores q.k computed query-major against
cache-major, in whole forwards of the default model.

    . .venv/bin/activate && python bench/attention.py
    . .venv/bin/activate && python bench/attention.py --calls 3 --no-write   # a quick look

`flash_decode_reference` (the attention every CPU forward runs) computes a decode or verify step's
scores query-major, [Q, H] x [S, H]^T -> [B, K, Q, S], up to `DECODE_MAX_QUERIES` queries per kv
head: a query gets the same bits whatever the number of queries beside it, which greedy
speculation's exactness needs. Cache-major, [S, H] x [H, Q] -> [B, K, S, Q] (the layout shipped
until 2026-12-07, held by an optimization barrier), was faster in some shapes but not width-exact
on every CPU (`DECODE_SCORES_LAYOUT`). This script times one trunk forward both ways, each
compiled as its own program (the switch is read while tracing), in the shapes that matter:
the corpus builder's batch-64 int8 decode over 384 and 768 slots, batch-1 decode and verify
(T = 5: a k = 4 chain) in float32 and int8, and a batch-8 verify. Forwards run as the generation
loop runs them (bench/forward_cost.py: the cache carried in place through a `fori_loop`),
interleaved across variants, medians over `--calls`. The table replaces the
`## Decode attention layout (bench/attention.py)` section of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib

from forward_cost import forward_costs  # bench/ is on sys.path when a bench script runs
from results_md import add_output_options, publish, run_stamp

HERE = pathlib.Path(__file__).resolve().parent
SECTION = "## Decode attention layout (bench/attention.py)"
RERUN = ". .venv/bin/activate && python bench/attention.py"

# (weights, batch, T, capacity, length): what each shape stands for is in the module docstring.
CASES = (
    ("int8", 64, 1, 384, 200),
    ("int8", 64, 1, 768, 400),
    ("f32", 1, 1, 1024, 500),
    ("f32", 1, 5, 1024, 500),
    ("int8", 1, 5, 1024, 500),
    ("f32", 8, 5, 1024, 500),
)
LAYOUTS = ("query-major", "cache-major")


@contextlib.contextmanager
def scores_layout(layout: str):
    """Trace with the reference computing a decode or verify step's scores `layout`."""
    from jaxspec.pallas import flash_decode

    shipped = flash_decode.DECODE_SCORES_LAYOUT
    flash_decode.DECODE_SCORES_LAYOUT = layout
    try:
        yield
    finally:
        flash_decode.DECODE_SCORES_LAYOUT = shipped


def measure(args) -> dict:
    """{(case, layout): median seconds of one forward}."""
    import jaxspec

    models = {fmt: jaxspec.load(weight_format=fmt) for fmt in sorted({case[0] for case in CASES})}
    costs = {}
    for case in CASES:
        fmt, batch, steps, capacity, length = case
        model = models[fmt]
        variants = {layout: (model.params, model.config, steps) for layout in LAYOUTS}
        under = {layout: (lambda layout=layout: scores_layout(layout)) for layout in LAYOUTS}
        print(f"{case}: compiling, then {args.calls} timed rounds", flush=True)
        for layout, seconds in forward_costs(variants, capacity, length, args.calls, iters=args.iters,
                                             batch=batch, compile_under=under).items():
            costs[(case, layout)] = seconds
    return costs


def build_section(args, costs: dict, load: tuple[float, float]) -> str:
    lines = [SECTION, "",
             f"{run_stamp(load)} One forward of the default "
             f"model (SmolLM2-135M-Instruct, f32 KV cache), median over {args.calls} calls of {args.iters} "
             "forwards, the two layouts interleaved.", "",
             f"Rerun: `{RERUN}`", "",
             "| weights | batch | T | cache slots (used) | query-major ms (shipped) | cache-major ms | cache-major speed-up |",
             "|---|---:|---:|---|---:|---:|---:|"]
    for case in CASES:
        fmt, batch, steps, capacity, length = case
        query, cache = costs[(case, "query-major")], costs[(case, "cache-major")]
        lines.append(f"| {fmt} | {batch} | {steps} | {capacity} ({length}) | {1e3 * query:.1f} | "
                     f"{1e3 * cache:.1f} | {query / cache:.2f}x |")
    lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=4, help="forwards per timed call")
    add_output_options(parser, calls=7)
    args = parser.parse_args()

    start_load = os.getloadavg()[0]
    costs = measure(args)
    section = build_section(args, costs, (start_load, os.getloadavg()[0]))
    publish(section, SECTION, args.results, write=not args.no_write)


if __name__ == "__main__":
    main()
