"""`python -m jaxspec.cli`: generate, info, convert, and one-line errors (exit 2) on bad input.

In-process through `jaxspec.cli.main` (compiled programs are shared across calls); one
subprocess run proves the module entry point. Tests that write GGUFs cache under tmp; the default
model's cache in ~/.cache/jaxspec is reused, which keeps this fast.
"""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

import pytest

import ckpt_fixtures as fx
import jaxspec
from jaxspec import checkpoints, cli
from tests.conftest import requires_default_model

# The one stats line: "[8 tokens, 30.1 tok/s decode, prefill 35 tokens in 0.21 s, ...]"
# (speculative methods add their figures before "prefill").
STATS = re.compile(r"^\[(\d+) tokens, (?:(\d+\.\d) tok/s decode|(no) decode step), .*?prefill (\d+) tokens .*\]$")
PROMPT = "Name three prime numbers."


def run(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()  # drop anything earlier
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def stats_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if STATS.match(line)]


def assert_one_line_error(code: int, out: str, err: str, *needles: str) -> None:
    assert code == cli.EXIT_BAD_INPUT, (code, err)
    assert out == ""
    lines = err.strip("\n").splitlines()
    assert len(lines) == 1, f"expected one stderr line, got:\n{err}"
    assert lines[0].startswith("error: ") and "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


# ---------------------------------------------------------------------------------------------
# Tiny checkpoints (written under tmp, cached under tmp)
# ---------------------------------------------------------------------------------------------

# A byte-level BPE vocabulary the tokenizer can be built from (the fixtures' default one has
# merges whose parts are not tokens): "t o" and "to k" make "tok"; digits are tokens of their own
# (the GPT-2 pre-tokenizer splits letters from digits), so "tok1tok2" is 4 tokens.
TINY_TOKENS = ["<unk>", "<s>", "</s>", "t", "o", "k", "to", "tok", *"0123456789"]
TINY_TOKENS += [f"x{i}" for i in range(fx.TINY["vocab_size"] - len(TINY_TOKENS))]
TINY_MERGES = ["t o", "to k"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    """A tiny HF directory, a GGUF written from it (loadable tokenizer) and a private cache."""
    root = tmp_path_factory.mktemp("cli")
    hf_dir = root / "hf"
    hf_dir.mkdir()
    state_dict = fx.make_hf_checkpoint(hf_dir)
    gguf_path = root / "tiny.gguf"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fx, "TOKENS", TINY_TOKENS)
        mp.setattr(fx, "MERGES", TINY_MERGES)
        fx.write_gguf(gguf_path, state_dict, fx.hf_config(hf_dir))
    return {"hf": hf_dir, "gguf": gguf_path, "cache": root / "cache", "root": root}


@pytest.fixture
def tiny_cache(tiny, monkeypatch) -> pathlib.Path:
    monkeypatch.setenv("JAXSPEC_CACHE_DIR", str(tiny["cache"]))
    return tiny["cache"]


@pytest.fixture(scope="module")
def converted(tiny) -> pathlib.Path:
    out = tiny["root"] / "converted"
    code = cli.main(["convert", str(tiny["gguf"]), str(out)])
    assert code == 0
    return out


def test_convert_then_load_gives_identical_greedy_tokens(tiny, tiny_cache, converted, capsys):
    assert (converted / checkpoints.JAXSPEC_META).is_file()
    source, copy = jaxspec.load(str(tiny["gguf"])), jaxspec.load(str(converted))
    assert copy.config == source.config
    # stream() with what the CLI calls below pass, so the two share compiled programs.
    prompt = "tok1tok2"
    assert source.tokenizer.encode(prompt) == [TINY_TOKENS.index(t) for t in ("tok", "1", "tok", "2")]
    tokens = {}
    for name, model in (("source", source), ("copy", copy)):
        stream = jaxspec.stream(model, prompt=prompt, chat=False, max_new_tokens=8)
        list(stream)
        tokens[name] = stream.result.tokens[0]
    assert tokens["copy"] == tokens["source"] and tokens["source"]

    # And through the CLI: the same text from the converted directory as from the GGUF.
    outs = []
    for model_path in (tiny["gguf"], converted):
        code, out, err = run(capsys, "generate", prompt, "--no-chat", "--max-new-tokens", "8",
                             "--model", str(model_path))
        assert code == 0, err
        assert len(stats_lines(err)) == 1
        outs.append(out)
    assert outs[0] == outs[1] == source.tokenizer.decode(tokens["source"])


def test_mesh_flag_shards_and_prints_the_same_text(tiny, tiny_cache, converted, capsys):
    """--mesh data=1,model=1 (this machine's one device) runs the sharded program: the same text."""
    args = ("generate", "tok1tok2", "--no-chat", "--max-new-tokens", "6", "--model", str(converted), "-q")
    code, plain, err = run(capsys, *args)
    assert code == 0, err
    code, sharded, err = run(capsys, *args, "--mesh", "data=1,model=1")
    assert code == 0, err
    assert sharded == plain and plain and len(stats_lines(err)) == 1


def test_quiet_silences_the_compile_notice(tiny, tiny_cache, converted, capsys):
    # Prompt buckets no other test compiles (17+ tokens -> 32, 33+ -> 64), so both runs compile.
    args = ("--no-chat", "--max-new-tokens", "4", "--model", str(converted))
    code, out, err = run(capsys, "generate", "tok1" * 9, *args, "--quiet")
    assert code == 0, err
    assert "preparing" not in err and len(stats_lines(err)) == 1
    code, out, err = run(capsys, "generate", "tok1" * 17, *args)
    assert code == 0, err
    [notice, *_] = [line for line in err.splitlines() if "preparing" in line]
    assert notice.startswith("jaxspec: preparing prefill [plain, batch 1, prompts up to 64 tokens")
    assert " compiled in " in notice


def _tree_bytes(root: pathlib.Path) -> int:
    return sum(path.stat().st_size for path in root.rglob("*") if path.is_file())


def test_int8_weights_convert_cache_and_generate_alike(tiny, tiny_cache, converted, capsys):
    """--weight-format int8: a converted directory stores int8 (a fraction of f32's bytes), the
    GGUF cache keeps an int8 entry beside the f32 one, and both generate the same text."""
    int8_dir = tiny["root"] / "converted-int8"
    code, _, err = run(capsys, "convert", str(tiny["gguf"]), str(int8_dir), "--weight-format", "int8")
    assert code == 0, err
    code, out, err = run(capsys, "info", str(int8_dir))
    assert code == 0 and "I8" in json.loads(out)["tensor_types"], err
    assert _tree_bytes(int8_dir / "params") < 0.5 * _tree_bytes(converted / "params")
    outs = []
    for model_path, flags in ((tiny["gguf"], ("--weight-format", "int8")), (int8_dir, ())):
        code, out, err = run(capsys, "generate", "tok1tok2", "--no-chat", "--max-new-tokens", "8",
                             "--model", str(model_path), *flags)
        assert code == 0, err
        outs.append(out)
    assert outs[0] == outs[1]
    assert any(entry.name.endswith("-int8") for entry in (tiny_cache / "params").iterdir())


def test_a_lone_surrogate_in_the_prompt_is_named(tiny, tiny_cache, converted, capsys):
    """Bytes that are not UTF-8 reach argv as lone surrogates (surrogateescape): one line, exit 2."""
    code, out, err = run(capsys, "generate", "tok\udcff1", "--no-chat", "--model", str(converted))
    assert_one_line_error(code, out, err, "lone surrogate", "index 3")


def test_convert_refuses_a_non_empty_output(tiny, converted, capsys):
    code, out, err = run(capsys, "convert", str(tiny["gguf"]), str(converted))
    assert_one_line_error(code, out, err, "already exists", "--overwrite")


def test_a_row_the_prefill_ends_reports_no_verify_round(tiny, tiny_cache, converted, capsys):
    """One new token comes from the prefill alone: the stats line says no round ran, not "tau nan"."""
    code, out, err = run(capsys, "generate", "tok1tok2", "--no-chat", "--max-new-tokens", "1", "--method", "ngram",
                         "--model", str(converted), "-q")
    assert code == 0, err
    (line,) = stats_lines(err)
    assert "ngram k=4: no verify round" in line and "nan" not in line


def test_info_tiny_hf_dir(tiny, capsys):
    code, out, err = run(capsys, "info", str(tiny["hf"]))
    assert code == 0, err
    info = json.loads(out)
    assert info["format"] == "hf"
    assert info["architecture"] == "llama"
    assert info["num_layers"] == fx.TINY["num_hidden_layers"]
    assert info["dim"] == fx.TINY["hidden_size"]
    assert info["vocab_size"] == fx.TINY["vocab_size"]


def test_info_converted_dir(converted, capsys):
    code, out, err = run(capsys, "info", str(converted))
    assert code == 0, err
    info = json.loads(out)
    assert (info["format"], info["architecture"], info["num_layers"]) == ("jaxspec", "llama", 2)


# ---------------------------------------------------------------------------------------------
# Bad input: exit 2, one line on stderr naming the problem, no traceback
# ---------------------------------------------------------------------------------------------


def test_missing_model_path(tmp_path, capsys):
    missing = tmp_path / "nope.gguf"
    code, out, err = run(capsys, "generate", "hi", "--model", str(missing))
    assert_one_line_error(code, out, err, "not found", str(missing))


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--top-p", "0"], "--top-p must be in (0, 1]"),
        (["--temperature", "-1"], "--temperature must be >= 0"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be an integer >= 1"),
        (["--exit-layer", "1"], "--exit-layer applies to --method layer_skip only"),
        (["--method", "eagle3"], "--method eagle3 needs --draft HEAD_DIR"),
        (["--method", "draft"], "--method draft needs --draft MODEL"),
        (["--method", "ngram", "-k", "99"], "--num-draft-tokens must be an integer in [1, 32]"),
        (["--method", "ngram", "-k", "3", "--tree", "3,4,12"],
         "--num-draft-tokens (3) and a tree (3,4,12) were both given: a tree drafts to its depth (3)"),
        (["--method", "ngram", "--draft-sampling", "sample", "--temperature", "1"],
         "no q for --draft-sampling='sample'"),
        (["--mesh", "tensor=2"], "--mesh takes data=N,model=M"),
        (["--mesh", "data=1,model=4"], "a mesh of data=1 x model=4 needs 4 devices; 1 is visible"),
        (["--num-processes", "2"], "--num-processes and --process-id go with --coordinator"),
    ],
    ids=["top-p-0", "temperature-negative", "max-new-tokens-0", "exit-layer-alone", "eagle3-without-draft",
         "draft-without-draft", "k-too-big", "k-and-tree", "ngram-sampled-drafts", "mesh-unknown-axis", "mesh-too-big",
         "processes-without-coordinator"],
)
def test_bad_generation_parameters_speak_cli(converted, capsys, flags, needle):
    code, out, err = run(capsys, "generate", "tok1", "--no-chat", "--model", str(converted), *flags)
    assert_one_line_error(code, out, err, needle)
    assert not any(name in err for name in cli.PYTHON_NAMES_TO_FLAGS if "_" in name)


@pytest.mark.parametrize("command", ["generate", "info"])
def test_truncated_gguf(tiny, tmp_path, monkeypatch, capsys, command):
    cache = tmp_path / "cache"
    monkeypatch.setenv("JAXSPEC_CACHE_DIR", str(cache))
    data = tiny["gguf"].read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    argv = ["generate", "hi", "--model", str(cut)] if command == "generate" else ["info", str(cut)]
    code, out, err = run(capsys, *argv)
    assert_one_line_error(code, out, err, "truncated", str(cut))
    assert not list(cache.glob("params/*")), "a truncated file must leave no cache entry"


@pytest.mark.parametrize(("argv", "needle"), [
    (["generate", "hi", "--bogus", "x"], "unrecognized arguments: --bogus"),
    (["generate", "hi", "-k", "abc"], "invalid int value: 'abc'"),
    (["generate", "hi", "--method", "nope"], "invalid choice: 'nope'"),
    (["generate"], "required: prompt"),
    ([], "required: command"),
    (["launch"], "invalid choice: 'launch'"),
])
def test_usage_errors_are_one_line_and_exit_2(capsys, argv, needle):
    """argparse's own errors read like every other bad input: one stderr line, exit status 2."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    out, err = capsys.readouterr()
    assert_one_line_error(exit_info.value.code, out, err, needle, "--help")


def test_module_entry_point_exits_2_on_bad_input(tmp_path):
    """The one subprocess: `python -m jaxspec.cli` runs main() and passes its exit status on."""
    missing = tmp_path / "missing.gguf"
    proc = subprocess.run(
        [sys.executable, "-m", "jaxspec.cli", "generate", "hi", "--model", str(missing)],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [f"error: checkpoint not found: {missing} (no such file or directory)"]


# ---------------------------------------------------------------------------------------------
# The default model
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_model():
    return jaxspec.load()


# Sampled, so that one compiled program (the default model's costs ~10 s to compile) serves every
# test here; greedy CLI generation is covered on the tiny model above.
SAMPLED = dict(max_new_tokens=8, temperature=0.7, top_p=0.9, seed=1)
SAMPLED_FLAGS = ("--max-new-tokens", "8", "--temperature", "0.7", "--top-p", "0.9", "--seed", "1")


@requires_default_model
@pytest.mark.real_model
def test_generate_streams_text_and_one_stats_line(default_model, capsys):
    code, out, err = run(capsys, "generate", PROMPT, *SAMPLED_FLAGS)
    assert code == 0, err
    # stdout is the completion itself, what stream() yields; the chat template is on by default.
    want = "".join(jaxspec.stream(default_model, prompt=PROMPT, chat=True, **SAMPLED))
    assert out == want and want.strip()
    [line] = stats_lines(err)
    assert err.rstrip("\n").splitlines()[-1] == line, err
    tokens, rate, no_decode, prefill = STATS.match(line).groups()
    assert 1 <= int(tokens) <= 8 and (no_decode or float(rate) > 0)
    assert int(prefill) == len(default_model.tokenizer.encode_chat(PROMPT))

    # Same seed, same text.
    code, again, err = run(capsys, "generate", PROMPT, *SAMPLED_FLAGS)
    assert code == 0, err
    assert again == out
    assert len(stats_lines(err)) == 1


@requires_default_model
@pytest.mark.real_model
def test_no_chat_passes_the_prompt_through(default_model, capsys):
    # The rendered chat prompt given raw with --no-chat is the same token ids as the templated
    # prompt (so the same program and, with the same seed, the same completion); templating it
    # again would have made it longer.
    tokenizer = default_model.tokenizer
    rendered = tokenizer.render_chat(PROMPT)
    chat_ids = tokenizer.encode_chat(PROMPT)
    assert tokenizer.encode(rendered) == chat_ids
    code, out, err = run(capsys, "generate", rendered, "--no-chat", *SAMPLED_FLAGS)
    assert code == 0, err
    [line] = stats_lines(err)
    assert int(STATS.match(line).group(4)) == len(chat_ids)
    assert out == "".join(jaxspec.stream(default_model, prompt=rendered, chat=False, **SAMPLED))
    assert out == "".join(jaxspec.stream(default_model, prompt=PROMPT, chat=True, **SAMPLED))


@requires_default_model
@pytest.mark.real_model
def test_info_default_model(capsys):
    code, out, err = run(capsys, "info")
    assert code == 0, err
    info = json.loads(out)
    assert (info["format"], info["architecture"], info["num_layers"]) == ("gguf", "llama", 30)
    assert info["source"] == str(checkpoints.default_model_path())
    assert "Q4_1" in info["tensor_types"]


@pytest.mark.parametrize("command", ["generate", "score"])
def test_a_corrupt_gguf_tokenizer_is_one_line_and_exit_2(tiny, tiny_cache, capsys, command):
    """Merges naming tokens outside the vocabulary: refused from the GGUF's header, before any
    tensor loads (so no loading bar precedes the error), one line, exit status 2, no cache entry."""
    bad = tiny["root"] / f"bad-merges-{command}.gguf"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fx, "TOKENS", TINY_TOKENS)
        mp.setattr(fx, "MERGES", ["t o", "zz yy"])
        hf_dir = tiny["root"] / f"hf-{command}"
        hf_dir.mkdir()
        fx.write_gguf(bad, fx.make_hf_checkpoint(hf_dir), fx.hf_config(hf_dir))
    argv = ["generate", "tok1", "--model", str(bad)] if command == "generate" else ["score", "tok1", "--model", str(bad)]
    code, out, err = run(capsys, *argv)
    assert_one_line_error(code, out, err, str(bad), "does not make a BPE tokenizer", "`zz` out of vocabulary")
    assert not list(tiny_cache.glob(f"params/{checkpoints.file_sha256(bad)}-*"))
