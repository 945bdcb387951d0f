"""What a new user waits for: the README quickstart's calls run in sequence, in a fresh process
with an empty XLA cache and then in a second process that finds the first one's programs on disk,
each call's wall time and the compile seconds within it (SpecStats.compile_seconds).

    python bench/first_calls.py                      # this checkout: both processes, table to RESULTS.md
    python bench/first_calls.py --baseline /tmp/old  # and a checkout of another commit beside it (its jaxspec)

Each process runs `python bench/first_calls.py --child` under the checkout's own jaxspec, with
JAXSPEC_XLA_CACHE_DIR pointing at a directory of the run's own; the calls use only the API every
compared checkout has (prompt as a keyword, a draft second).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import results_md

HEADING = "## First calls: compile time in sequence (bench/first_calls.py)"
PASSAGE = ("The Nile is the longest river in Africa. It flows north for about 6,650 km through eleven countries "
           "before it reaches the Mediterranean Sea. Its two main tributaries are the White Nile and the Blue Nile, "
           "which meet at Khartoum in Sudan. ") * 3
# The quickstart, as calls: (label, generate's keyword arguments; "draft" names a model to load as the draft).
CALLS = [
    ("plain, short prompt", dict(prompt="Name three prime numbers.", max_new_tokens=32)),
    ("prompt lookup, the same prompt", dict(prompt="Name three prime numbers.", max_new_tokens=32, method="ngram")),
    ("prompt lookup, a passage", dict(prompt=PASSAGE + "\n\nFrom the text above: where do the two Niles meet?",
                                      max_new_tokens=32, method="ngram")),
    ("batch of 2, sampled", dict(prompt=["Hi!", "Write a haiku about JAX."], max_new_tokens=32, temperature=0.7,
                                 seed=1)),
    ("EAGLE-3 head, lookup first", dict(prompt="Tell me a story.", max_new_tokens=32, draft="eagle3-smollm2-135m",
                                        lookup_first=2)),
]


def child() -> None:
    """Run CALLS in this process and print one JSON line per call."""
    import jaxspec

    start = time.perf_counter()
    model = jaxspec.load()
    print(json.dumps({"label": "load", "seconds": time.perf_counter() - start, "compile": 0.0}), flush=True)
    for label, kwargs in CALLS:
        kwargs = dict(kwargs)
        draft = kwargs.pop("draft", None)
        start = time.perf_counter()
        draft_model = None if draft is None else jaxspec.load(draft)
        result = jaxspec.generate(model, draft_model, **kwargs)
        print(json.dumps({"label": label, "seconds": time.perf_counter() - start,
                          "compile": result.stats.compile_seconds}), flush=True)


def run_process(checkout: pathlib.Path, cache: pathlib.Path) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(checkout), "JAXSPEC_XLA_CACHE_DIR": str(cache)}
    proc = subprocess.run([sys.executable, str(pathlib.Path(__file__).resolve()), "--child"], env=env,
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"the calls failed under {checkout}:\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--baseline", type=pathlib.Path, default=None,
                        help="a checkout of another commit, measured the same way beside this one")
    results_md.add_output_options(parser)
    args = parser.parse_args(argv)
    if args.child:
        child()
        return
    load = os.getloadavg()[0]
    here = pathlib.Path(__file__).resolve().parents[1]
    checkouts = {"this checkout": here} | ({"baseline": args.baseline.resolve()} if args.baseline else {})
    runs = {}
    for name, checkout in checkouts.items():
        with tempfile.TemporaryDirectory() as cache:
            runs[name] = [run_process(checkout, pathlib.Path(cache)) for _ in range(2)]  # fresh, then warm
    header = ["call"] + [f"{name}, {which} s (compile)" for name in runs for which in ("first process", "second")]
    rows = []
    for index, (label, _) in enumerate([("load", None), *CALLS]):
        cells = [label]
        for fresh, warm in runs.values():
            cells += [f"{fresh[index]['seconds']:.1f} ({fresh[index]['compile']:.1f})",
                      f"{warm[index]['seconds']:.1f} ({warm[index]['compile']:.1f})"]
        rows.append(cells)
    totals = ["total"]
    for fresh, warm in runs.values():
        totals += [f"{sum(r['seconds'] for r in fresh):.1f} ({sum(r['compile'] for r in fresh):.1f})",
                   f"{sum(r['seconds'] for r in warm):.1f} ({sum(r['compile'] for r in warm):.1f})"]
    rows.append(totals)
    table = "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                      + ["| " + " | ".join(row) + " |" for row in rows])
    stamp = results_md.run_stamp((load, os.getloadavg()[0]),
                                 detail="each process fresh, the default model in f32 on its default backend")
    section = (f"{HEADING}\n\n{stamp} The quickstart's calls in sequence in one process, with an empty XLA cache, "
               f"then the same calls in a second process that loads the first one's programs from it; each cell is "
               f"the call's wall seconds and, in brackets, the compile seconds inside it (tracing, lowering, XLA "
               f"compile or its load from the cache). Checkouts: "
               f"{', '.join(f'{n} {c}' for n, c in checkouts.items())}.\n\n"
               f"{table}\n\n{results_md.command_line('first_calls.py', argv)}\n")
    results_md.publish(section, HEADING, args.results, write=not args.no_write)


if __name__ == "__main__":
    main()
