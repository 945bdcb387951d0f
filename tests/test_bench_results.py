"""bench/results_md.py, which every bench script writes its RESULTS.md section through: a section
replaced in place or appended, the others kept; the options every script takes; the stamp line.
And bench/heads.py's account of where a head came from."""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import pytest

from tests.conftest import BENCH, load_bench_script

results_md = load_bench_script("results_md")


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


def test_the_command_line_names_the_script_and_its_arguments(monkeypatch):
    assert results_md.command_line("heads.py", ["--k", "4"]) == "Command: `python bench/heads.py --k 4`"
    assert results_md.command_line("heads.py", []) == "Command: `python bench/heads.py`"
    monkeypatch.setattr(sys, "argv", ["bench/heads.py", "--tree", "4,8,16"])
    assert results_md.command_line("heads.py", None) == "Command: `python bench/heads.py --tree 4,8,16`"


@pytest.fixture
def heads_script():
    return load_bench_script("heads")


def test_heads_bench_reports_an_exported_checkpoint_with_the_steps_it_had(heads_script, tmp_path):
    """A head written by train-head --export-head is described by its run's settings and the steps
    of its checkpoint (the rows it has seen, for the acceptance curve), an MTP one too; a finished
    run's head by its whole run; a head without a run by nothing."""
    run = tmp_path / "run"
    run.mkdir()
    settings = {"method": "eagle3", "steps": 318, "batch_size": 8, "ttt_steps": 7, "learning_rate": 3e-4,
                "init_from": None}
    (run / "train_run.json").write_text(json.dumps({"train_config": settings}))
    assert heads_script.head_training(str(run)) == "eagle3, 318 steps of 8, TTT 7, peak lr 0.0003"
    exported = tmp_path / "at100"
    (exported / "mtp_head").mkdir(parents=True)
    (exported / "exported_from.json").write_text(json.dumps({"run": str(run), "step": 100, "steps": 318}))
    for head in (exported, exported / "mtp_head"):
        assert heads_script.run_directory(str(head)) == run
        assert heads_script.head_training(str(head)) == (
            "eagle3, 100 steps of 8 (a checkpoint: 100 of its run's 318), TTT 7, peak lr 0.0003")
    assert heads_script.head_training(str(tmp_path / "shipped")) == "-"


def test_heads_sections_are_one_per_weight_format_and_timed_group(heads_script):
    """A run timing another group, or under other weights, keeps the other sections."""
    heads = heads_script
    assert heads.section_title("f32", "mt_bench") == "## EAGLE-3 heads on Spec-Bench (bench/heads.py)"
    assert heads.section_title("int8", "mt_bench") == "## EAGLE-3 heads on Spec-Bench (bench/heads.py --weight-format int8)"
    assert heads.section_title("int8", "rag") == \
        "## EAGLE-3 heads on Spec-Bench (bench/heads.py --weight-format int8 --timing-group rag)"
    assert heads.section_title("f32", "rag") == "## EAGLE-3 heads on Spec-Bench (bench/heads.py --timing-group rag)"


def test_int8_labels_bench_finds_the_rows_decoding_writes_again(tiny_model, tmp_path):
    """bench/int8_labels.py on the tiny model: rows that are its own int8 greedy text are written
    again whole, a row with one answer token changed is not, and the argmax shares are fractions."""
    import jaxspec
    import numpy as np

    bench = load_bench_script("int8_labels")
    int8 = jaxspec.convert_weights(tiny_model, "int8")
    prompts = [[5, 9, 17, 33], [7, 7, 8], [40, 41, 42, 43, 44], [60, 2, 99]]
    answers = jaxspec.generate(int8, None, prompts, max_new_tokens=12, ignore_eos=True).tokens
    width = 24
    tokens = np.zeros((len(prompts), width), np.int32)
    for i, (prompt, answer) in enumerate(zip(prompts, answers)):
        tokens[i, : len(prompt) + 12] = prompt + list(answer)
    tokens[3, len(prompts[3]) + 5] = (tokens[3, len(prompts[3]) + 5] + 1) % tiny_model.config.vocab_size  # not its text
    prompt_lengths = np.asarray([len(p) for p in prompts], np.int32)
    path = tmp_path / "dataset.npz"
    np.savez(path, tokens=tokens, lengths=prompt_lengths + 12, prompt_lengths=prompt_lengths,
             turns=np.ones(len(prompts), np.int32))
    result = bench.measure(path, 4, (10, 12), {"int8": int8, "f32": tiny_model})
    assert (result["rows"], result["whole"], result["answer_tokens"]) == (4, 3, 4 * 12)
    assert 0.5 < result["int8"] <= 1 and 0.5 < result["f32"] <= 1
    with pytest.raises(SystemExit, match="only 4 single-turn rows"):
        bench.pick_rows(dict(np.load(path)), 5, (10, 12))
