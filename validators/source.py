"""Static checks of a candidate kernel's source, before any of it runs.

A candidate kernel is agent-written Python that will be imported into the process that measures
it. Tools like sg-opt have been fooled by kernels that read the harness's files, patched torch so
the reference agreed with them, flipped global numerics switches, or timed themselves. Executing
the source is the only way to know what it computes (``validators.kernel`` does that, in a
subprocess), but what it may *reach* can be decided from its syntax tree alone, so this check runs
first and nothing rejected here is ever executed.

The rules are an allow-list of imports plus a deny-list of names and attributes. They forbid more
than the known escapes wherever that costs a real kernel nothing: a Triton or torch kernel never needs
dunder or private attributes, attribute assignment (monkeypatching), dynamic ``getattr``, file,
process or environment access, RNG or global-switch changes, or ``torch.load``-style
deserialisation. ``tl.load``/``tl.store`` are allowed because an attribute named ``load`` is
accepted only when it resolves, through the file's own imports, to ``triton.language``.

Rules: ``syntax``, ``size``, ``import`` (only torch, triton, triton.language, math, __future__; no
rebinding an imported name), ``forbidden-name`` (open, os, eval, exec, compile, __import__,
globals, setattr...), ``dynamic-attribute`` (getattr/hasattr without a literal name), ``dunder``
(dunder names, attributes and method definitions), ``private`` (``torch._C`` and any ``_x``),
``introspection`` (frames, code objects, tracebacks), ``forbidden-api`` (load/save/hub/
cpp_extension/backends/testing/fork...), ``global-state`` (seeds, RNG, ``set_*``, ``register_*``),
``attribute-assignment`` (monkeypatching) and ``missing-function``. A rejection names its rule and
line in one sentence; ``violations`` lists every one found, so a proposer can fix them all at once.
"""

from __future__ import annotations

import ast
import unicodedata
from typing import Iterable

from pydantic import BaseModel, Field

ALLOWED_MODULES: frozenset[str] = frozenset({"torch", "triton", "triton.language", "math", "__future__"})

# Names (as identifiers or attributes) that reach files, processes, the interpreter or introspection.
FORBIDDEN_NAMES: frozenset[str] = frozenset({
    "open", "os", "sys", "subprocess", "socket", "eval", "exec", "compile", "__import__", "importlib",
    "ctypes", "builtins", "globals", "locals", "vars", "breakpoint", "input", "exit", "quit",
    "setattr", "delattr",  # attribute assignment by any spelling is monkeypatching
    "help", "license", "copyright", "credits",  # interactive helpers that read files and start pagers
})
# Frames, code objects and tracebacks: a generator's gi_frame.f_back reaches the caller's locals.
INTROSPECTION_PREFIXES: tuple[str, ...] = ("gi_", "cr_", "ag_", "f_", "tb_", "co_")
# Attributes that load or save code or data, reach the network or other processes, or time kernels.
FORBIDDEN_APIS: dict[str, str] = {
    "load": "deserialises objects from a file (only triton.language.load is allowed)",
    "save": "writes objects to a file",
    "from_file": "maps a file into a tensor",
    "hub": "downloads and runs code",
    "cpp_extension": "compiles and loads native code",
    "load_library": "loads native code",
    "library": "registers operators that replace torch's own",
    "py_impl": "registers operators that replace torch's own",
    "CUDAPluggableAllocator": "loads a native allocator",
    "change_current_allocator": "replaces the allocator",
    "cudart": "exposes the raw CUDA runtime",
    "multiprocessing": "starts processes",
    "distributed": "opens network connections",
    "package": "reads and writes code archives",
    "onnx": "writes files",
    "profiler": "interferes with measurement",
    "testing": "holds timing and comparison shortcuts that belong to the validator",
    "runtime": "reaches Triton's driver, cache and benchmarking internals",
    "compiler": "reaches compiler internals and caches",
    "tools": "reaches Triton's tooling",
    "knobs": "changes Triton's global configuration",
    "backends": "holds global numerics switches (TF32, reduced-precision reductions)",
    "fork": "runs work on another thread that can outlive the call",
    "futures": "runs work on another thread that can outlive the call",
    "format": "walks attributes named inside a string ('{0.__globals__}'), out of static sight",
    "format_map": "walks attributes named inside a string ('{0.__globals__}'), out of static sight",
}
# Attributes that change process-wide state: RNG, default dtype/device/stream, determinism, hooks.
GLOBAL_STATE_NAMES: frozenset[str] = frozenset({
    "manual_seed", "manual_seed_all", "seed", "seed_all", "random", "fork_rng", "get_rng_state",
    "get_rng_state_all", "use_deterministic_algorithms", "default_generator",
})
GLOBAL_STATE_PREFIXES: tuple[str, ...] = ("set_", "register_")
TRITON_LANGUAGE = "triton.language"
ATTRIBUTE_BUILTINS = ("getattr", "hasattr")


class Violation(BaseModel):
    rule: str
    line: int
    message: str


class SourceVerdict(BaseModel):
    """Whether a candidate's source may be executed; when not, the first violation in file order."""

    ok: bool
    rule: str = ""
    line: int = 0
    message: str = ""
    violations: list[Violation] = Field(default_factory=list)


def _is_dunder(name: str) -> bool:
    return len(name) > 4 and name.startswith("__") and name.endswith("__")


class _Checker:
    """Collects violations node by node; resolves attribute chains through the file's imports.

    ``check`` applies the rule for one node without recursing: the caller walks the tree, imports
    first, so every alias is known wherever it is used.
    """

    def __init__(self) -> None:
        self.violations: list[Violation] = []
        self.aliases: dict[str, str] = {}  # local name -> module or object path it was imported as
        self.parents: dict[ast.AST, ast.AST] = {}

    def check(self, node: ast.AST) -> None:
        rule = getattr(self, f"visit_{type(node).__name__}", None)
        if rule is not None:
            rule(node)

    def flag(self, node: ast.AST, rule: str, what: str) -> None:
        line = getattr(node, "lineno", 0)
        self.violations.append(Violation(rule=rule, line=line, message=f"Rule {rule}, line {line}: {what}."))

    # ------------------------------------------------------------------ imports

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name not in ALLOWED_MODULES:
                self.flag(node, "import", f"only {self._allowed()} may be imported, not {alias.name!r}")
                continue
            # "import triton.language" binds "triton"; "import triton.language as tl" binds tl.
            local = alias.asname or alias.name.split(".")[0]
            self._bind(node, local, alias.name if alias.asname else local)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = "." * node.level + (node.module or "")
        if node.level or module not in ALLOWED_MODULES:
            self.flag(node, "import", f"only {self._allowed()} may be imported from, not {module!r}")
            return
        for alias in node.names:
            if alias.name == "*":
                self.flag(node, "import", f"a star import from {module} hides which names the file uses")
                continue
            qualified = f"{module}.{alias.name}"
            if module != "__future__" and not self._check_attribute_name(node, alias.name, module):
                continue
            self._bind(node, alias.asname or alias.name, qualified)

    def _bind(self, node: ast.AST, local: str, path: str) -> None:
        if self.aliases.get(local, path) != path:
            self.flag(node, "import", f"the name {local!r} is imported twice as different things")
        self.aliases[local] = path

    @staticmethod
    def _allowed() -> str:
        return ", ".join(sorted(ALLOWED_MODULES - {"__future__"}))

    # ------------------------------------------------------------------ names and attributes

    def visit_Name(self, node: ast.Name) -> None:
        name = node.id
        if name in FORBIDDEN_NAMES:
            self.flag(node, "forbidden-name", f"the name {name!r} reaches files, processes or the interpreter")
        elif _is_dunder(name):
            self.flag(node, "dunder", f"the dunder name {name!r} is a classic sandbox escape")
        elif name in ATTRIBUTE_BUILTINS and not self._is_called(node):
            self.flag(node, "dynamic-attribute", f"{name} may only be called directly with a literal name")
        if isinstance(node.ctx, (ast.Store, ast.Del)) and name in self.aliases:
            self.flag(node, "import", f"the imported name {name!r} is rebound, which hides what it refers to")

    def _is_called(self, node: ast.Name) -> bool:
        parent = self.parents.get(node)
        return isinstance(parent, ast.Call) and parent.func is node

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if isinstance(node.ctx, (ast.Store, ast.Del)):
            self.flag(node, "attribute-assignment",
                      f"assigning or deleting the attribute {node.attr!r} changes shared objects (monkeypatching)")
        self._check_attribute_name(node, node.attr, self._resolve(node.value))

    def _check_attribute_name(self, node: ast.AST, attr: str, owner: str | None) -> bool:
        """Apply the attribute rules to ``owner.attr``; ``owner`` is a resolved path or None."""
        attr = unicodedata.normalize("NFKC", attr)
        qualified = f"{owner}.{attr}" if owner else f"<object>.{attr}"
        if _is_dunder(attr):
            self.flag(node, "dunder", f"the dunder attribute {attr!r} is a classic sandbox escape")
        elif attr.startswith("_"):
            self.flag(node, "private", f"the private attribute {qualified} reaches torch or Triton internals")
        elif attr.startswith(INTROSPECTION_PREFIXES):
            self.flag(node, "introspection", f"the attribute {qualified} reaches frames, code or tracebacks")
        elif attr in FORBIDDEN_NAMES:
            self.flag(node, "forbidden-name", f"the attribute {qualified} reaches files, processes or the interpreter")
        elif attr in FORBIDDEN_APIS and not (attr == "load" and owner == TRITON_LANGUAGE):
            self.flag(node, "forbidden-api", f"{qualified} {FORBIDDEN_APIS[attr]}")
        elif attr in GLOBAL_STATE_NAMES or attr.startswith(GLOBAL_STATE_PREFIXES):
            self.flag(node, "global-state", f"{qualified} changes process-wide state (RNG, defaults, streams, hooks)")
        else:
            return True
        return False

    def _resolve(self, node: ast.expr) -> str | None:
        """The imported path an attribute chain starts from (``tl.x`` -> ``triton.language.x``), or None."""
        if isinstance(node, ast.Name):
            return self.aliases.get(node.id)
        if isinstance(node, ast.Attribute):
            base = self._resolve(node.value)
            return f"{base}.{node.attr}" if base else None
        return None

    def visit_Call(self, node: ast.Call) -> None:
        if isinstance(node.func, ast.Name) and node.func.id in ATTRIBUTE_BUILTINS:
            name = node.args[1] if len(node.args) >= 2 else None
            if not (isinstance(name, ast.Constant) and isinstance(name.value, str)) or node.keywords:
                self.flag(node, "dynamic-attribute",
                          f"{node.func.id} must name its attribute with a string literal, or static checks are blind")
            else:
                self._check_attribute_name(node, name.value, self._resolve(node.args[0]))

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        if _is_dunder(node.name):
            self.flag(node, "dunder", f"defining {node.name} hooks into the interpreter or torch's dispatch")

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_arg(self, node: ast.arg) -> None:
        if node.arg in self.aliases:
            self.flag(node, "import", f"the imported name {node.arg!r} is rebound, which hides what it refers to")


def _defines_function(tree: ast.Module, name: str) -> bool:
    return any(isinstance(node, ast.FunctionDef) and node.name == name for node in tree.body)


def _first(violations: Iterable[Violation]) -> SourceVerdict:
    ordered = sorted(violations, key=lambda v: (v.rule == "missing-function", v.line))
    if not ordered:
        return SourceVerdict(ok=True)
    head = ordered[0]
    return SourceVerdict(ok=False, rule=head.rule, line=head.line, message=head.message, violations=ordered)


def check_source(source: str, slot_name: str, max_bytes: int = 64_000) -> SourceVerdict:
    """Decide from the source alone whether a candidate for ``slot_name`` may be executed."""
    size = len(source.encode("utf-8", errors="replace"))
    if size > max_bytes:
        return _first([Violation(rule="size", line=0, message=(
            f"Rule size, line 0: the file has {size} bytes, more than the {max_bytes} allowed."))])
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError) as exc:
        line = getattr(exc, "lineno", 0) or 0
        reason = getattr(exc, "msg", None) or str(exc)
        return _first([Violation(rule="syntax", line=line, message=f"Rule syntax, line {line}: {reason}.")])
    checker = _Checker()
    nodes = list(ast.walk(tree))
    for parent in nodes:
        for child in ast.iter_child_nodes(parent):
            checker.parents[child] = parent
    imports = [n for n in nodes if isinstance(n, (ast.Import, ast.ImportFrom))]
    for node in imports + [n for n in nodes if not isinstance(n, (ast.Import, ast.ImportFrom))]:
        checker.check(node)
    if not _defines_function(tree, slot_name):
        checker.violations.append(Violation(
            rule="missing-function", line=0,
            message=f"Rule missing-function, line 0: the file defines no top-level function {slot_name!r}."))
    return _first(checker.violations)
