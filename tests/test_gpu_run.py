"""bench/gpu_run.py, the one GPU run (issue 60), rehearsed on CPU so a GPU run never fails on a
typo: every step in its own process, as on the GPU, on tiny shapes with Pallas interpreted; each
step's table written and free of errors; the sweep's rows in the tuned table's own form; and no
step importing jaxspec's dependencies beyond jax, flax and numpy (the GPU image may lack them)."""

from __future__ import annotations

import re

import pytest

from jaxspec.pallas import tuning
from tests.conftest import load_bench_script

gpu_run = load_bench_script("gpu_run")
# jaxspec's dependencies (pyproject.toml) other than jax, flax, numpy and ml_dtypes, by import name.
NOT_ON_THE_GPU_PATH = {"safetensors", "orbax", "optax", "chex", "gguf", "tokenizers", "tqdm", "jinja2",
                       "outlines_core", "sentencepiece", "google", "torch", "transformers"}


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    """OUT of `gpu_run.py --cpu` (every 25th configuration of the CUDA lowering grid: tests/test_tuning.py
    lowers a slice of it, bench/gpu_run.sh --cpu all of it), and its exit status."""
    out = tmp_path_factory.mktemp("gpu_run")
    status = gpu_run.main(["--cpu", "--lowering-stride", "25", str(out)])
    return out, status


def test_every_step_writes_its_table_without_errors(rehearsal):
    out, status = rehearsal
    assert status == 0
    report = (out / "gpu_run.md").read_text()
    for heading in ("## Kernel tests", "## Decode attention: the kernel's sweep", "## W8A16 product",
                    "## Generate end to end (bf16)"):
        assert heading in report
    for trouble in ("ERROR", "FAILED", "No table", "exited with status", "stopped at", "not run", "nan"):
        assert trouble not in report, trouble


def test_no_step_imports_beyond_jax_flax_and_numpy(rehearsal):
    out, _ = rehearsal
    for step in gpu_run.STEPS:
        imported = re.search(r"^Imported packages: (.*)\.$", (out / f"{step}.md").read_text(), re.M)
        assert imported, step
        packages = set(imported.group(1).split(", "))
        assert {"jax", "numpy"} <= packages
        assert not packages & NOT_ON_THE_GPU_PATH, (step, packages & NOT_ON_THE_GPU_PATH)


def test_the_steps_measure_what_they_say(rehearsal):
    out, _ = rehearsal
    tests = (out / "tests.md").read_text()
    assert "--collect-only: exit 0" in tests and tests.count("| ok |") >= 5
    sweep = (out / "sweep.md").read_text()
    assert re.search(r"Lowering for CUDA \(jax.export, no GPU\): (\d+) of \1 configurations lower", sweep)
    rows = re.search(r"```python\n(.*?)```", sweep, re.S).group(1).strip().splitlines()
    tuned = [eval(row.strip().rstrip(","), vars(tuning)) for row in rows]  # noqa: S307 (the script's own rows)
    assert {row.shape_class for row in tuned} == set(tuning.ShapeClass)
    assert all(isinstance(row, tuning.Tuned) and row.speedup > 0 for row in tuned)
    assert len(re.findall(r"^\| (?:qkv|o) \|", (out / "w8a16.md").read_text(), re.M)) == 2
    generate = (out / "generate.md").read_text()
    assert re.search(r"Plain decode: [\d.]+ tok/s", generate)
    assert len(re.findall(r"^\| [248] \|(?: [^|]+ \|){4}$", generate, re.M)) == 3  # break-even, k = 2, 4, 8


def test_break_even_acceptance():
    assert gpu_run.break_even(0.9, 4) == 0.0  # a verify cheaper than a step pays at any acceptance
    assert gpu_run.break_even(5.0, 4) is None  # k + 1 tokens at best: never pays
    # a = 0.5, k = 2: a round commits 1 + 0.5 + 0.25 = 1.75 tokens on average.
    assert gpu_run.break_even(1.75, 2) == pytest.approx(0.5, abs=1e-9)
