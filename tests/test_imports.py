"""The import graph of the jaxspec package, read from the source with ast (nothing is imported).

Models never depend on how checkpoints are read (the loaders depend on the models' family
descriptors, not the reverse), and no module imports one that imports it back, at module level
or inside a function.
"""

from __future__ import annotations

import ast
import pathlib

import jaxspec

PACKAGE_DIR = pathlib.Path(jaxspec.__file__).parent


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in PACKAGE_DIR.rglob("*.py")}


def imports_of(name: str) -> set[str]:
    """The jaxspec modules `name` imports anywhere in its source (package __init__ excluded)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            # `from a import b` imports module a.b when there is one, else a name of a.
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        found |= {target for target in targets if target in MODULES and target != "jaxspec"}
    return found - {name}


GRAPH = {name: imports_of(name) for name in MODULES}


def test_the_graph_sees_known_edges():
    """Guard the parser: edges that exist today are found (so an empty graph cannot pass)."""
    assert "jaxspec.checkpoints.safetensors" in GRAPH["jaxspec.checkpoints.load"]
    assert "jaxspec.models.family" in GRAPH["jaxspec.models.llama"]
    assert "jaxspec.checkpoints" in GRAPH["jaxspec.api"]


def test_models_never_import_the_loaders():
    for name, imported in GRAPH.items():
        if name.startswith("jaxspec.models"):
            loaders = sorted(i for i in imported if i.startswith("jaxspec.checkpoints"))
            assert not loaders, f"{name} imports {loaders}"


def test_no_import_cycles():
    """Depth-first search for a back edge; the failure names the cycle."""
    state: dict[str, str] = {}  # "open" while on the stack, "done" after

    def visit(name: str, stack: list[str]) -> None:
        state[name] = "open"
        for target in sorted(GRAPH[name]):
            if state.get(target) == "open":
                cycle = stack[stack.index(target):] + [target]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target, [*stack, target])
        state[name] = "done"

    for name in sorted(GRAPH):
        if name not in state:
            visit(name, [name])


def _families() -> set[str]:
    """The trunk modules: those that build a `FAMILY = Family(...)` descriptor."""
    found = set()
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if any(isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "FAMILY" for t in node.targets)
               for node in tree.body):
            found.add(name)
    return found


TRUNKS = _families()
ENGINE = sorted(name for name in MODULES if name.startswith("jaxspec.spec") or name == "jaxspec.api")


def test_the_engine_imports_no_trunk_module():
    """The loop, the drafters and the API reach a trunk only through its `Family` (jaxspec.models)."""
    assert {"jaxspec.models.llama", "jaxspec.models.qwen35", "jaxspec.models.gemma"} <= TRUNKS
    assert "jaxspec.spec.loop" in ENGINE and "jaxspec.spec.drafters.eagle3" in ENGINE
    for name in ENGINE:
        trunks = sorted(GRAPH[name] & TRUNKS)
        assert not trunks, f"{name} imports the trunk module(s) {trunks}: ask its family (jaxspec.models.Family)"


def test_the_engine_duck_types_nothing():
    """No getattr in the engine (but a class reading its own fields) and no isinstance of a trunk's
    config: a proposer's capabilities are its protocol's fields, a trunk's its family's (a drafter
    module recognises its own head's config)."""
    for name in ENGINE:
        for node in ast.walk(ast.parse(MODULES[name].read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
                continue
            if node.func.id in ("getattr", "hasattr"):
                target = node.args[0]
                assert isinstance(target, ast.Name) and target.id == "self", (
                    f"{name}:{node.lineno} {node.func.id}({ast.unparse(target)}, ...)")
            if node.func.id == "isinstance":  # trunk configs are told apart by their family
                assert "Config" not in ast.unparse(node.args[1]) or "head_model" in ast.unparse(node.args[1]), (
                    f"{name}:{node.lineno} {ast.unparse(node)}")
