"""bench/suite_profile.py: the plugin records each test's time and compiles, and the summary reads them."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

BENCH = pathlib.Path(__file__).resolve().parents[1] / "bench"
# Loaded from its file, so bench/ never joins this worker's sys.path (its modules' names, spec and
# heads among them, would shadow others for every later test).
_spec = importlib.util.spec_from_file_location("bench_suite_profile", BENCH / "suite_profile.py")
suite_profile = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(suite_profile)


def test_the_plugin_counts_each_test_s_compiles_and_the_summary_adds_them(tmp_path):
    (tmp_path / "test_sample.py").write_text(
        "import jax, jax.numpy as jnp\n"
        "def test_compiles_twice():\n"
        "    jax.jit(lambda x: x + 1)(jnp.ones(3)); jax.jit(lambda x: x * 2)(jnp.ones(5))\n"
        "def test_compiles_nothing():\n"
        "    assert True\n")
    out = tmp_path / "profile.jsonl"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(BENCH), os.environ.get("PYTHONPATH", "")]),
           "SUITE_PROFILE": str(out)}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "suite_profile", "-p", "no:cacheprovider",
                          "test_sample.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = {json.loads(line)["test"]: json.loads(line) for line in out.read_text().splitlines()}
    assert set(rows) == {"test_sample.py::test_compiles_twice", "test_sample.py::test_compiles_nothing"}
    assert rows["test_sample.py::test_compiles_twice"]["compiles"] >= 2
    assert rows["test_sample.py::test_compiles_twice"]["compile_s"] > 0
    assert rows["test_sample.py::test_compiles_nothing"]["compiles"] == 0
    summary = suite_profile.summarize(str(out))
    total = sum(row["wall"] for row in rows.values())
    assert summary.startswith(f"2 tests: {total:.0f} worker-seconds")
    assert "| test_sample.py | 2 |" in summary
