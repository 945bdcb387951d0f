"""jaxspec.errors: every error jaxspec raises for bad input is a JaxspecError (so a caller catches
one class) and a ValueError (so code written against plain Python keeps catching it); the CLI turns
any of them into one `error: ...` line and exit status 2, and lets anything else (a bug) propagate."""

import inspect

import pytest

import jaxspec
from jaxspec import checkpoints, cli, errors

ERRORS_MODULE_CLASSES = [value for _, value in inspect.getmembers(errors, inspect.isclass)
                         if value.__module__ == errors.__name__]


def all_subclasses(cls: type) -> list[type]:
    return [sub for direct in cls.__subclasses__() for sub in (direct, *all_subclasses(direct))]


# `import jaxspec` has imported every module that defines one (grammar.GrammarError, sharding.ShardingError).
ALL_ERRORS = sorted(set(ERRORS_MODULE_CLASSES) | set(all_subclasses(errors.JaxspecError)), key=lambda cls: cls.__name__)


def test_every_jaxspec_error_is_a_jaxspec_error_and_a_value_error():
    assert {errors.CheckpointError, errors.UnsupportedModelError, errors.InvalidRequestError} <= set(ALL_ERRORS)
    for error_class in ALL_ERRORS:
        assert issubclass(error_class, errors.JaxspecError), error_class
        assert issubclass(error_class, ValueError), error_class
        assert error_class.__doc__, f"{error_class.__name__} must say when it is raised"


def test_the_errors_module_classes_are_public_at_the_top_level():
    for error_class in ERRORS_MODULE_CLASSES:
        assert getattr(jaxspec, error_class.__name__) is error_class
        assert error_class.__name__ in jaxspec.__all__


def test_the_cli_reports_a_missing_model_in_one_line_and_exits_2(tmp_path, capsys):
    missing = tmp_path / "absent.gguf"
    assert cli.main(["info", str(missing)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    [line] = captured.err.splitlines()
    assert line.startswith("error: ") and str(missing) in line and "not found" in line


@pytest.mark.parametrize("error_class", ALL_ERRORS, ids=lambda cls: cls.__name__)
def test_the_cli_turns_every_jaxspec_error_into_exit_2(error_class, monkeypatch, capsys):
    def refuse(path):
        raise error_class(f"{path} is bad")

    monkeypatch.setattr(checkpoints, "info", refuse)
    assert cli.main(["info", "some/model"]) == 2
    assert capsys.readouterr().err == "error: some/model is bad\n"


def test_the_cli_lets_a_bug_propagate(monkeypatch):
    """Only bad input is a one-line error: a plain ValueError is a bug and keeps its traceback."""
    def broken(path):
        raise ValueError("a bug, not bad input")

    monkeypatch.setattr(checkpoints, "info", broken)
    with pytest.raises(ValueError, match="a bug, not bad input"):
        cli.main(["info", "some/model"])
