"""The README and docs/ stay true to the code: every Python block parses, every `jaxspec.X` it
names exists, every keyword it passes to generate / stream / prepare is an option, every CLI line
parses with the CLI's own parser, every relative link resolves, and the README stays short.

(Running every block would load real models and compile a dozen programs: the quickstart
notebook and the real-model tests run those paths; this keeps the text from drifting.)"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import re
import shlex

import pytest

import jaxspec
from jaxspec import cli

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_LINES = 150
OPTION_TAKERS = ("generate", "stream", "prepare")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def blocks(page: pathlib.Path, language: str) -> list[str]:
    return [body for lang, body in FENCE.findall(page.read_text()) if lang == language]


def page_id(page: pathlib.Path) -> str:
    return str(page.relative_to(ROOT))


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_python_blocks_parse_and_name_what_exists(page):
    options = {field.name for field in dataclasses.fields(jaxspec.GenerateOptions)}
    for block in blocks(page, "python"):
        tree = ast.parse(block)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "jaxspec":
                assert hasattr(jaxspec, node.attr), f"{page_id(page)}: jaxspec.{node.attr} does not exist"
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "jaxspec"
                    and node.func.attr in OPTION_TAKERS):
                for keyword in node.keywords:
                    assert keyword.arg in options | {"prompt", "draft_params", "options"}, (
                        f"{page_id(page)}: jaxspec.{node.func.attr}(..., {keyword.arg}=...) is no option")


def cli_lines(page: pathlib.Path) -> list[str]:
    """The `python -m jaxspec.cli ...` commands of a page's bash blocks (continuations joined,
    comments cut), from `generate` on."""
    commands = []
    for block in blocks(page, "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            if "python -m jaxspec.cli " in line:
                commands.append(line.split("python -m jaxspec.cli ", 1)[1].split(" #")[0])
    return commands


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_cli_lines_parse(page):
    parser = cli.build_parser()
    for command in cli_lines(page):
        argv = [word for word in shlex.split(command) if word != "[--json]"]
        args, unknown = parser.parse_known_args(argv)
        assert not unknown or args.command == "corpus", f"{page_id(page)}: {command!r} leaves {unknown}"


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_relative_links_resolve(page):
    for target in re.findall(r"\]\(([^)#\s]+)\)", page.read_text()):
        if "://" not in target:
            assert (page.parent / target).exists(), f"{page_id(page)} links to {target}, which is not there"


def test_the_readme_reads_in_five_minutes():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_LINES, f"README.md has {len(lines)} lines; move detail to docs/"
