"""The import contract of DESIGN.md, checked on the source (as import-linter would): dependencies point one way,
sg_opt -> state_machine -> (profilers, validators) -> targets, profilers and validators apart, and no generic
module knows the bundled trainer.

Every module's imports are read with ast, those inside functions included. "Names the trainer in code": an
identifier, an attribute or a string that is not a docstring holding 'haste' (comments and docstrings may cite
its measurements); sg-opt's own entry point for it lives in pyproject.toml.
"""

from __future__ import annotations

import ast
from pathlib import Path

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
