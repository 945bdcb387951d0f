"""Where the test suite's time goes: a pytest plugin that writes one JSON line per test (its wall
time from setup to teardown, XLA backend-compile seconds and count, tracing and lowering seconds,
the xdist worker and start time), and a summary of such a file per module.

    PYTHONPATH=bench SUITE_PROFILE=suite.jsonl python -m pytest -q -n 2 --dist loadfile -p suite_profile
    python bench/suite_profile.py suite.jsonl          # per module, then the slowest tests

Compile seconds come from jax.monitoring's events, so they count only what this process
compiled (a subprocess's compiles, such as the 8-device sharding worker's, show as wall time).
"""

from __future__ import annotations

import collections
import json
import os
import pathlib
import sys
import time

import pytest

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
TRACE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration")

_totals = {"compile_s": 0.0, "compiles": 0, "trace_s": 0.0}


def _on_duration(event: str, duration: float, **_) -> None:
    if event == COMPILE_EVENT:
        _totals["compile_s"] += duration
        _totals["compiles"] += 1
    elif event in TRACE_EVENTS:
        _totals["trace_s"] += duration


def pytest_configure(config) -> None:
    import jax.monitoring

    jax.monitoring.register_event_duration_secs_listener(_on_duration)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    before, start = dict(_totals), time.time()
    yield
    row = {"test": item.nodeid, "wall": time.time() - start, "start": start,
           "worker": os.environ.get("PYTEST_XDIST_WORKER"),
           **{key: _totals[key] - before[key] for key in _totals}}
    with open(os.environ.get("SUITE_PROFILE", "suite_profile.jsonl"), "a") as out:
        out.write(json.dumps(row) + "\n")


def summarize(path: str, top: int = 30) -> str:
    rows = [json.loads(line) for line in pathlib.Path(path).read_text().splitlines() if line.strip()]
    per_module = collections.defaultdict(lambda: {"wall": 0.0, "compile_s": 0.0, "compiles": 0, "tests": 0})
    for row in rows:
        module = per_module[row["test"].split("::")[0]]
        module["wall"] += row["wall"]
        module["compile_s"] += row["compile_s"]
        module["compiles"] += row["compiles"]
        module["tests"] += 1
    lines = [f"{len(rows)} tests: {sum(r['wall'] for r in rows):.0f} worker-seconds, "
             f"{sum(r['compile_s'] for r in rows):.0f} s in {sum(r['compiles'] for r in rows)} backend compiles",
             "", "| module | tests | seconds | compile s | compiles |", "|---|---:|---:|---:|---:|"]
    for name, module in sorted(per_module.items(), key=lambda item: -item[1]["wall"]):
        lines.append(f"| {name} | {module['tests']} | {module['wall']:.1f} | {module['compile_s']:.1f} | "
                     f"{module['compiles']} |")
    lines += ["", "| slowest tests | seconds | compile s |", "|---|---:|---:|"]
    for row in sorted(rows, key=lambda r: -r["wall"])[:top]:
        lines.append(f"| {row['test']} | {row['wall']:.1f} | {row['compile_s']:.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(summarize(sys.argv[1]))
