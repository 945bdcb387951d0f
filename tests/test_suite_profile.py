"""bench/suite_profile.py: the plugin records each test's time and compiles, and the summary reads them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import BENCH, load_bench_script

suite_profile = load_bench_script("suite_profile")


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
