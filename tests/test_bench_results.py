"""bench/results_md.py, which every bench script writes its RESULTS.md section through: a section
replaced in place or appended, the others kept; the options every script takes; the stamp line."""

from __future__ import annotations

import argparse
import importlib.util
import pathlib

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[1] / "bench"
# Loaded from its file: bench/ is a folder of scripts, not a package, and on sys.path its module
# names (spec, sampling, sharding, ...) would shadow others for the rest of the worker's run.
_spec = importlib.util.spec_from_file_location("bench_results_md", BENCH / "results_md.py")
results_md = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(results_md)


def test_a_section_is_replaced_in_place_and_the_others_kept(tmp_path):
    path = tmp_path / "RESULTS.md"
    results_md.replace_section(path, "## A", "## A\nfirst\n")
    results_md.replace_section(path, "## B", "## B\nsecond\n")
    results_md.replace_section(path, "## A", "## A\nnew\n")
    assert path.read_text() == "# Benchmark results\n\n## A\nnew\n\n## B\nsecond\n"


def test_every_script_takes_the_same_output_options():
    parser = argparse.ArgumentParser()
    results_md.add_output_options(parser, calls=5)
    args = parser.parse_args([])
    assert (args.calls, args.results, args.no_write) == (5, BENCH / "RESULTS.md", False)
    args = parser.parse_args(["--calls", "2", "--results", "elsewhere.md", "--no-write"])
    assert (args.calls, args.results, args.no_write) == (2, pathlib.Path("elsewhere.md"), True)
    without_calls = argparse.ArgumentParser()
    results_md.add_output_options(without_calls)
    with pytest.raises(SystemExit):
        without_calls.parse_args(["--calls", "2"])  # only scripts that time medians take it


def test_the_stamp_names_the_load_and_what_it_is_told():
    plain = results_md.run_stamp((1.25, 2.0))
    assert "load average 1.2 at the start, 2.0 at the end)." in plain and "jaxspec" not in plain
    told = results_md.run_stamp((1.0, 2.0), commit="abc1234+dirty", detail="medians over 3 prompts")
    assert ", jaxspec abc1234+dirty; " in told and told.endswith("at the end; medians over 3 prompts).")
