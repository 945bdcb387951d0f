"""Where a decode step's time goes: XLA's own profile of plain greedy decoding, by kind of op.

    . .venv/bin/activate && python bench/step_profile.py                      # q4 and int8, native kernels
    . .venv/bin/activate && python bench/step_profile.py --formats f32/xla    # any --formats entries

Default model (SmolLM2-135M-Instruct), batch 1, one Spec-Bench-like question, `--max-new-tokens`
greedy tokens (`ignore_eos`), generated once to compile and once under `jax.profiler`; the
trace's complete events are summed by the kind of thunk XLA ran (its name without the number:
`ffi_call` is a native product, `copy` a buffer copy, `ynn_fusion` a YNNPACK fusion, the rest
XLA's own fused loops) and divided by the decode steps. The profiler adds its own cost to each
event, so the figures read as shares of a step more than as times; the tokens/s of the profiled
call is printed beside the unprofiled one. The table replaces the `## Decode step profile
(bench/step_profile.py)` section of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import pathlib
import re
import sys
import tempfile
import time

import jax

from results_md import add_output_options, load_variant, publish, run_stamp, weight_formats  # bench/ is on sys.path

SECTION = "## Decode step profile (bench/step_profile.py)"
QUESTION = "What is speculative decoding, and when does it make generation faster?"
SKIPPED = ("ThunkExecutor", "PjitFunction", "CommonPjRt", "ParseArguments", "Handle inputs", "while")


def profile(model, new_tokens: int) -> tuple[dict, dict, float, float]:
    """(ms per step by kind, thunks per step by kind, tokens/s unprofiled, tokens/s profiled)."""
    import jaxspec

    run = dict(chat=True, max_new_tokens=new_tokens, ignore_eos=True)
    jaxspec.generate(model, None, QUESTION, **run)  # compiles
    plain = jaxspec.generate(model, None, QUESTION, **run).stats.decode_tokens_per_second
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir)
        result = jaxspec.generate(model, None, QUESTION, **run)
        jax.profiler.stop_trace()
        path = max(pathlib.Path(trace_dir).rglob("*.trace.json.gz"), key=os.path.getmtime)
        events = json.load(gzip.open(path))["traceEvents"]
    steps = result.stats.target_forwards
    times, counts = collections.Counter(), collections.Counter()
    for event in events:
        name = event.get("name", "")
        if event.get("ph") != "X" or name.startswith(("$", "end: ")) or name.startswith(SKIPPED):
            continue
        kind = re.sub(r"[._]\d+$", "", name)
        times[kind] += event.get("dur", 0) / 1e3 / steps
        counts[kind] += 1 / steps
    return times, counts, plain, result.stats.decode_tokens_per_second


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", type=weight_formats, default=["q4", "int8"],
                        help="weight formats, each optionally /xla or /native (default q4,int8)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--kinds", type=int, default=8, help="op kinds listed per format (default 8)")
    add_output_options(parser)
    args = parser.parse_args(argv)
    began, load_before = time.perf_counter(), os.getloadavg()
    lines = [SECTION, ""]
    rows = []
    for variant in args.formats:
        label, model = load_variant(variant)
        times, counts, plain, profiled = profile(model, args.max_new_tokens)
        total = sum(times.values())
        rows.append(f"**{label}**: {plain:.1f} tok/s ({1e3 / plain:.1f} ms a step; profiled {profiled:.1f} tok/s), "
                    f"thunks summing to {total:.1f} ms a step under the profiler:")
        rows.append("")
        rows.append("| op kind | ms / step | share | thunks / step |")
        rows.append("|---|---:|---:|---:|")
        for kind, ms in times.most_common(args.kinds):
            rows.append(f"| {kind} | {ms:.2f} | {100 * ms / total:.0f}% | {counts[kind]:.0f} |")
        rows.append("")
        print("\n".join(rows[-args.kinds - 4:]), flush=True)
    load = (load_before[0], os.getloadavg()[0])
    lines.append(f"{run_stamp(load)} jax {jax.__version__}. SmolLM2-135M-Instruct, batch 1, {args.max_new_tokens} "
                 f"greedy tokens, plain decoding; XLA's profile summed by thunk kind per decode step. Run took "
                 f"{time.perf_counter() - began:.0f} s.")
    lines.append("")
    lines.append(f"Rerun: `. .venv/bin/activate && python bench/step_profile.py"
                 f"{''.join(' ' + a for a in (sys.argv[1:] if argv is None else argv))}`")
    lines.append("")
    publish("\n".join(lines + rows), SECTION, args.results, write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
