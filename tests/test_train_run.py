"""The training-run checks (tests/train_run_checks.py), run in a fresh process of their own.

Why a process of its own: in a suite worker that had compiled several hundred programs before
them, XLA:CPU (jaxlib 0.10.2) crashed the process while compiling these checks' programs
(SIGSEGV inside backend_compile_and_load). The cause, found since: the worker's memory mappings
had reached vm.max_map_count (conftest.release_programs, which now releases every module's
programs). The fresh process stays as a second guard: it compiles the same programs as a
`train-head` run does, and a crash here fails one test instead of ending the run. The checks stay
ordinary pytest tests: `python -m pytest tests/train_run_checks.py` runs them directly.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

CHECKS = pathlib.Path(__file__).resolve().parent / "train_run_checks.py"


def test_training_run_checks_pass_in_a_process_of_their_own():
    # -o addopts: the suite's own options (xdist's worker restarts) mean nothing to one process;
    # -rfE names each failing check in the tail that the assertion prints.
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "-rfE", str(CHECKS)],
        capture_output=True, text=True, timeout=840, cwd=CHECKS.parent.parent)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else "(no output)"
    assert proc.returncode == 0, f"{summary}\n{proc.stdout[-8000:]}\n{proc.stderr[-3000:]}"
    assert " passed" in summary and "failed" not in summary and "error" not in summary, summary
