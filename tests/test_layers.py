"""The import contract of DESIGN.md, checked on the source (as import-linter would): dependencies point one way,
sg_opt -> state_machine -> (profilers, validators) -> targets, profilers and validators apart, and no generic
module knows the bundled trainer.

Every module's imports are read with ast, those inside functions included. "Names the trainer in code": an
identifier, an attribute or a string that is not a docstring holding 'haste' (comments and docstrings may cite
its measurements); sg-opt's own entry point for it lives in pyproject.toml.

Within the layers, no two project modules import each other, directly or round a loop, not even from inside a
function (a deferred import hides a cycle without breaking it: the two halves still cannot be read, tested or
moved apart). Imports under ``if TYPE_CHECKING:`` never run and are not counted. And no module imports another's
``_private`` name: what two modules share is public where it is defined.

Inside the bundled trainer, its parts (subpackages) import only the parts listed below them, never the modules that
compose them (its top level, ``distributed``): each part can be read and tested on its own.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path
from typing import Collection, Mapping

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("sg_opt", "state_machine", "profilers", "validators", "targets")
TRAINER = "targets.haste_rec"
# package -> the project packages it must never import
FORBIDDEN = {
    "targets": ("sg_opt", "state_machine", "profilers", "validators"),
    "profilers": ("sg_opt", "state_machine", "validators"),
    "validators": ("sg_opt", "state_machine", "profilers"),
    "state_machine": ("sg_opt",),
    "sg_opt": (),
}


def generic_modules() -> list[Path]:
    return sorted(path for package in PACKAGES for path in (ROOT / package).rglob("*.py")
                  if "haste_rec" not in path.relative_to(ROOT).parts)


def imported(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def docstrings(tree: ast.AST) -> set[int]:
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return {id(node.body[0].value) for node in ast.walk(tree) if isinstance(node, kinds) and node.body
            and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
            and isinstance(node.body[0].value.value, str)}


def names_the_trainer(tree: ast.AST) -> list[str]:
    skip = docstrings(tree)
    found = []
    for node in ast.walk(tree):
        text = (node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute)
                else node.value if isinstance(node, ast.Constant) and isinstance(node.value, str)
                and id(node) not in skip else "")
        if "haste" in text.lower():
            found.append(f"line {node.lineno}: {text[:60]!r}")
    return found


def _relative(path: Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize("path", generic_modules(), ids=_relative)
def test_no_generic_module_imports_or_names_the_bundled_trainer(path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    trainer = sorted(name for name in imported(tree) if name == TRAINER or name.startswith(TRAINER + "."))
    assert not trainer, f"{_relative(path)} imports {trainer}"
    assert not names_the_trainer(tree), f"{_relative(path)} names the bundled trainer: {names_the_trainer(tree)}"


@pytest.mark.parametrize("path", generic_modules(), ids=_relative)
def test_dependencies_point_one_way(path):
    package = path.relative_to(ROOT).parts[0]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    wrong = sorted(name for name in imported(tree) for other in FORBIDDEN[package]
                   if name == other or name.startswith(other + "."))
    assert not wrong, f"{_relative(path)} ({package}) imports {wrong}"


def test_the_contract_sees_a_breach():
    tree = ast.parse('"""Cites haste in a docstring."""\nimport targets.haste_rec.knobs\nX = "haste-rec"\n')
    assert imported(tree) == {"targets.haste_rec.knobs"}
    assert names_the_trainer(tree) == ["line 3: 'haste-rec'"]


# ----------------------------------------------------------------------------- cycles and private names

def project_modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the project's packages, the bundled trainer included, by dotted name."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def type_checking_only(tree: ast.AST) -> set[int]:
    """The nodes under ``if TYPE_CHECKING:``: read by type checkers, never run."""
    guards = [node for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)]
    return {id(inner) for guard in guards for statement in guard.body for inner in ast.walk(statement)}


def project_imports(name: str, tree: ast.AST, modules: Collection[str],
                    packages: Collection[str] = ()) -> list[tuple[str, str | None, int]]:
    """(project module imported, the name taken from it or None, line) for each import that runs, those inside
    functions included. ``from package import submodule`` imports the submodule; relative imports are resolved
    against ``name`` (``packages``: the modules that are packages)."""
    skip = type_checking_only(tree)
    found = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found += [(alias.name, None, node.lineno) for alias in node.names if alias.name in modules]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".") if name in packages else name.split(".")[:-1]
                base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
            for alias in node.names:
                if f"{base}.{alias.name}" in modules:
                    found.append((f"{base}.{alias.name}", None, node.lineno))
                elif base in modules:
                    found.append((base, alias.name, node.lineno))
    return found


def import_graph(trees: Mapping[str, ast.AST], packages: Collection[str] = ()) -> dict[str, dict[str, int]]:
    """module -> {project module it imports: the line of its first import there}."""
    graph: dict[str, dict[str, int]] = {name: {} for name in trees}
    for name, tree in trees.items():
        for target, _, line in project_imports(name, tree, trees, packages):
            if target != name:
                graph[name].setdefault(target, line)
    return graph


def import_cycles(graph: Mapping[str, Mapping[str, int]]) -> list[list[str]]:
    """The sets of two or more modules that each reach every other through imports (strongly connected)."""
    reach = {}
    for start in graph:
        seen, todo = set(), [start]
        while todo:
            for target in graph[todo.pop()]:
                if target not in seen:
                    seen.add(target)
                    todo.append(target)
        reach[start] = seen
    cycles = {frozenset({start} | {other for other in reach[start] if start in reach[other]})
              for start in graph if start in reach[start]}
    return sorted(sorted(cycle) for cycle in cycles if len(cycle) > 1)


def cycle_text(cycle: list[str], graph: Mapping[str, Mapping[str, int]]) -> str:
    """The imports inside one cycle, each with its line: the places one of them has to go from."""
    return "; ".join(f"{source} -> {target} (line {line})" for source in cycle
                     for target, line in sorted(graph[source].items()) if target in cycle)


def private_imports(name: str, tree: ast.AST, modules: Collection[str], packages: Collection[str] = ()) -> list[str]:
    """Each ``_private`` name this module takes from another project module (dunder names are public)."""
    return [f"line {line}: {taken} from {target}"
            for target, taken, line in project_imports(name, tree, modules, packages)
            if taken is not None and taken.startswith("_") and not (taken.startswith("__") and taken.endswith("__"))
            and target != name]


@cache
def project_trees(root: Path = ROOT) -> tuple[dict[str, ast.AST], frozenset[str]]:
    """Each project module's parsed source, and which of them are packages."""
    modules = project_modules(root)
    trees = {name: ast.parse(path.read_text(encoding="utf-8")) for name, path in modules.items()}
    return trees, frozenset(name for name, path in modules.items() if path.name == "__init__.py")


@cache
def project_graph() -> dict[str, dict[str, int]]:
    """The project's import graph, built once for the tests that read it (one per module of a part)."""
    trees, packages = project_trees()
    return import_graph(trees, packages)


def test_no_import_cycle_among_project_modules():
    graph = project_graph()
    cycles = import_cycles(graph)
    assert not cycles, "import cycles: " + " | ".join(cycle_text(cycle, graph) for cycle in cycles)


@pytest.mark.parametrize("name", sorted(project_modules()))
def test_no_module_imports_another_modules_private_name(name):
    trees, packages = project_trees()
    private = private_imports(name, trees[name], trees, packages)
    assert not private, f"{name} imports private names of other modules: {private}"


def test_the_cycle_and_privacy_checks_see_a_breach():
    sources = {
        "pkg": "",
        "pkg.a": "from __future__ import annotations\nimport os\n\ndef f():\n    from pkg.b import g\n    return g\n",
        "pkg.b": "from typing import TYPE_CHECKING\nfrom pkg import c\nif TYPE_CHECKING:\n    from pkg.d import D\n",
        "pkg.c": "from .a import _helper, __version__\n",
        "pkg.d": "import pkg.b\n",
    }
    trees = {name: ast.parse(text) for name, text in sources.items()}
    graph = import_graph(trees, {"pkg"})
    assert graph["pkg.a"] == {"pkg.b": 5} and graph["pkg.b"] == {"pkg.c": 2}
    assert import_cycles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]  # pkg.d only under TYPE_CHECKING: no cycle
    assert cycle_text(["pkg.a", "pkg.b", "pkg.c"], graph) == ("pkg.a -> pkg.b (line 5); pkg.b -> pkg.c (line 2); "
                                                               "pkg.c -> pkg.a (line 1)")
    assert private_imports("pkg.c", trees["pkg.c"], trees, {"pkg"}) == ["line 1: _helper from pkg.a"]
    assert private_imports("pkg.a", trees["pkg.a"], trees, {"pkg"}) == []


# ----------------------------------------------------------------------------- the trainer's parts

# part -> the other parts it may import; the top-level modules and distributed/ compose them and may import any
TRAINER_PARTS = {
    f"{TRAINER}.data": (),
    f"{TRAINER}.cache": (),
    f"{TRAINER}.tail": (),
    f"{TRAINER}.embeddings": (f"{TRAINER}.data", f"{TRAINER}.cache"),
}


def part_of(name: str, parts: Collection[str]) -> str | None:
    return next((part for part in parts if name == part or name.startswith(part + ".")), None)


def part_breaches(name: str, imports: Mapping[str, int], parts: Mapping[str, Collection[str]], root: str) -> list[str]:
    """Each import of ``name`` (a module of a part) that reaches a trainer module outside its part and the parts
    it may import."""
    own = part_of(name, parts)
    allowed = (own, *parts[own])
    return [f"line {line}: {target}" for target, line in sorted(imports.items())
            if target.startswith(root + ".") and part_of(target, allowed) is None]


def test_the_trainers_parts_exist():
    modules = project_modules()
    assert all(part in modules for part in TRAINER_PARTS), sorted(set(TRAINER_PARTS) - set(modules))


@pytest.mark.parametrize("name", sorted(name for name in project_modules() if part_of(name, TRAINER_PARTS)))
def test_a_trainer_part_imports_only_the_parts_below_it(name):
    graph = project_graph()
    breaches = part_breaches(name, graph[name], TRAINER_PARTS, TRAINER)
    assert not breaches, f"{name} ({part_of(name, TRAINER_PARTS)}) imports beyond its part: {breaches}"


def test_the_parts_check_sees_a_breach():
    parts = {"t.low": (), "t.high": ("t.low",)}
    assert part_breaches("t.high.a", {"t.low.b": 3, "t.high.c": 4, "os": 1}, parts, "t") == []
    assert part_breaches("t.low.b", {"t.high.a": 2, "t.session": 5}, parts, "t") == ["line 2: t.high.a",
                                                                                      "line 5: t.session"]
