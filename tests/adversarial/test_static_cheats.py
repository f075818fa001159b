"""Hostile kernels that must never run: each is a complete ``tail_forward`` candidate hiding one way out
of the sandbox (its docstring's first line says which), and ``validate_kernel_file`` must reject it at
the static check, by the rule meant for that cheat, without starting the subprocess that would import
it. Seven of them passed the deny-list check this allow-list replaced (pickle_exec, fileio_via_torch_module,
numpy_tofile, time_patch_sys_modules, walrus_module_alias, match_class_numpy, coding_utf7)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import validators.kernel_worker as kernel_worker
from targets.haste_rec.tail.tail_slots import TAIL_SLOTS
from validators.kernel_file import validate_kernel_file

KERNELS = Path(__file__).parent / "kernels"
SLOT = "tail_forward"
# file -> (rule, line) of the first violation: the rule that names the cheat.
EXPECTED = {
    "pickle_exec": ("reach", 10),  # torch.serialization.pickle.loads runs builtins.exec
    "fileio_via_torch_module": ("reach", 10),  # torch.nn.modules.module.io.FileIO writes a file
    "numpy_tofile": ("forbidden-api", 10),  # x.numpy().tofile(path)
    "getattr_computed": ("dynamic-attribute", 9),  # getattr(torch, "".join(["lo", "ad"]))
    "dunder_dict_patch": ("dunder", 15),  # torch.__dict__["einsum"] = ...
    "globals_builtins": ("forbidden-name", 7),  # globals()["__builtins__"]["__import__"]("os")
    "time_patch_sys_modules": ("reach", 15),  # tl.extra.modules["time"], then tl.math.wraps patches it
    "ops_replace_aten": ("reach", 9),  # torch.ops.aten.einsum.default.py_impl(...)
    "library_replace_aten": ("forbidden-api", 8),  # torch.library.Library("aten", "IMPL")
    "class_walk": ("introspection", 10),  # type(h).mro()[-1].__subclasses__()
    "walrus_module_alias": ("reach", 10),  # (t := torch), then t.serialization...
    "match_class_numpy": ("forbidden-api", 11),  # case torch.Tensor(numpy=to_numpy)
    "coding_utf7": ("encoding", 1),  # a UTF-7 declaration hides "import os" in a comment
}


@pytest.fixture(autouse=True)
def _never_executed(monkeypatch):
    """A static rejection returns before the worker: reaching it would run the cheat (and be slow)."""
    def refuse(*args, **kwargs):
        raise AssertionError("a statically rejected kernel reached the subprocess that executes it")
    monkeypatch.setattr(kernel_worker, "run_kernel_check", refuse)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_cheat_is_rejected_statically_by_its_rule(name):
    rule, line = EXPECTED[name]
    verdict = validate_kernel_file("haste-rec", SLOT, str(KERNELS / f"{name}.py"), "cpu", "float32", 5.0, seed=1)
    assert not verdict.ok and verdict.check == "source", verdict.reason
    assert verdict.source is not None and (verdict.source.rule, verdict.source.line) == (rule, line), verdict.reason
    assert verdict.reason.startswith(f"Rule {rule}, line {line}: ") and verdict.reason.count(". ") == 0


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_cheat_says_what_it_does_and_is_a_complete_candidate(name):
    text = (KERNELS / f"{name}.py").read_text(encoding="utf-8")
    tree = ast.parse(text)
    assert (ast.get_docstring(tree) or "").startswith("Cheat: "), name
    slot = next(s for s in TAIL_SLOTS if s.name == SLOT)
    params = [a.arg for a in next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == SLOT).args.args]
    assert params == ["h", "idx", "w", "bias"] and all(f"{p}:" in slot.signature for p in params)
