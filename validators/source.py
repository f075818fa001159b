"""Static checks of a candidate kernel's source, before any of it runs (the lists of what it may reach:
``validators.source_policy``).

A candidate kernel is agent-written Python that will be imported into the process that measures
it. Tools like sg-opt have been fooled by kernels that read the harness's files, patched torch so
the reference agreed with them, flipped global numerics switches, or timed themselves. Executing
the source is the only way to know what it computes (``validators.kernel`` does that, in a
subprocess), but what it may *reach* can be decided from its syntax tree alone, so this check runs
first and nothing rejected here is ever executed.

Why an allow-list of what chains reach, not only a deny-list of names: torch and Triton modules
import the standard library, so ``torch.serialization.pickle.loads`` (which runs any code),
``torch.nn.modules.module.io.FileIO`` (which writes files) or ``triton.language.extra.modules``
(``sys.modules`` itself) pass any list of bad names. So every attribute chain rooted at an imported
name (``torch.a.b``, ``tl.x``, a from-imported name) is resolved, step by step, against the real
modules (imported here on first use, the versions the candidate will run with), and must stay inside
``NAMESPACES``: torch's top level, ``torch.nn.functional``, ``torch.linalg``, ``torch.special``,
``torch.fft``, a few ``torch.cuda`` queries, triton's jit/autotune/heuristics/Config/cdiv/
next_power_of_2, ``triton.language`` with its math and libdevice namespaces, and ``math``. In an open
namespace a member passes when it is not a module, was defined in that package (not re-exported from
the standard library, like ``triton.language.math.wraps``) and is not TorchScript or serialisation
machinery; a module passes only when it is itself listed. A module may not be used as a value
(assigned, passed, returned, matched, a default argument), since what is reached through a variable
cannot be resolved. The deny-lists stay on top, for names on objects nothing resolves (a tensor's
``x.numpy()``, ``x.untyped_storage()``), and for members of allowed namespaces that load, save, seed
or switch global state (``torch.load``, ``torch.set_default_dtype``). ``tl.load``/``tl.store`` are
allowed because ``load`` is accepted only when it resolves to ``triton.language``.

A kernel never needs dunder or private attributes, classes walked by ``type``/``mro``, attribute
assignment (monkeypatching), dynamic ``getattr``, files, processes, the environment, RNG or global
switches, streams of its own (work the caller's stream does not wait for escapes the measurement), or
decorators other than Triton's. A coding declaration other than UTF-8 is rejected: the checker parses
the text it was given, but Python would decode the file by the declaration (UTF-7 hides whole lines).

Rules: ``syntax``, ``size``, ``encoding``, ``import`` (only the modules in ``NAMESPACES`` and
__future__; no rebinding an imported name by any spelling: assignment, parameter, def, except, match,
comprehension, walrus, del), ``reach`` (a chain that leaves ``NAMESPACES``, or a module used as a
value), ``forbidden-name`` (open, os, eval, exec, compile, __import__, globals, setattr, io, pickle...),
``dynamic-attribute`` (getattr/hasattr without a literal name), ``dunder`` (dunder names, attributes,
method definitions, metaclasses), ``private`` (``torch._C`` and any ``_x``), ``introspection`` (frames,
code objects, tracebacks; ``type``, ``super``, ``dir``, ``object``, ``mro``), ``forbidden-api``
(load/save/tofile/numpy/storage/hub/backends/testing/fork/streams...), ``global-state`` (seeds, RNG,
``set_*``, ``register_*``, a yield or await inside a with block, which leaves its context entered),
``attribute-assignment`` (monkeypatching), ``decorator`` (only triton.jit,
triton.autotune, triton.heuristics) and ``missing-function``. A rejection names its rule and line in
one sentence; ``violations`` lists every one found (one per attribute chain, its first bad step), so a
proposer can fix them all at once.
"""

from __future__ import annotations

import ast
import codecs
import inspect
import re
import unicodedata
from typing import Any, Iterable

from pydantic import BaseModel, Field

from validators.source_policy import (ALLOWED_DECORATORS, ALLOWED_MODULES, ATTRIBUTE_BUILTINS, CLASS_WALK_NAMES,
                                      FORBIDDEN_APIS, FORBIDDEN_FRAGMENTS, FORBIDDEN_NAMES, GLOBAL_STATE_NAMES,
                                      GLOBAL_STATE_PREFIXES, INTROSPECTION_PREFIXES, MISSING, MODULES, NAMESPACES,
                                      TRITON_LANGUAGE, is_machinery, member, member_problem)

# PEP 263: a coding declaration in a comment on line 1 or 2.
CODING = re.compile(r"^[ \t\f]*#.*?coding[:=][ \t]*([-\w.]+)")


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


def _normal(name: str) -> str:
    """Python reads identifiers NFKC-normalised; getattr strings are compared the same way, to be safe."""
    return unicodedata.normalize("NFKC", name)


class _Checker:
    """Collects violations node by node; resolves attribute chains through the file's imports.

    ``check`` applies the rules for one node without recursing: the caller walks the tree, imports
    first, so every alias is known wherever it is used. An attribute chain is checked once, from its
    outermost node, root outwards, stopping at its first bad step.
    """

    def __init__(self) -> None:
        self.violations: list[Violation] = []
        self.aliases: dict[str, str] = {}  # local name -> module or object path it was imported as
        self.unresolved: set[str] = set()  # aliases whose import was rejected: not resolved again
        self.parents: dict[ast.AST, ast.AST] = {}

    def check(self, node: ast.AST) -> None:
        rule = getattr(self, f"visit_{type(node).__name__}", None)
        if rule is not None:
            rule(node)
        if self._is_chain_end(node):
            self._check_chain(node)

    def flag(self, node: ast.AST, rule: str, what: str) -> None:
        line = getattr(node, "lineno", 0)
        self.violations.append(Violation(rule=rule, line=line, message=f"Rule {rule}, line {line}: {what}."))

    # ------------------------------------------------------------------ imports

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name not in ALLOWED_MODULES or alias.name == "__future__":
                self.flag(node, "import", f"only {self._allowed()} may be imported, not {alias.name!r}")
                continue
            # "import triton.language" binds "triton"; "import triton.language as tl" binds tl.
            local = alias.asname or alias.name.split(".")[0]
            path = alias.name if alias.asname else local
            self._bind(node, local, path)
            if MODULES.get(path) is None:
                self.flag(node, "reach", f"{path} cannot be imported here, so what it reaches cannot be checked")
                self.unresolved.add(local)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = "." * node.level + (node.module or "")
        if node.level or module not in ALLOWED_MODULES:
            self.flag(node, "import", f"only {self._allowed()} may be imported from, not {module!r}")
            return
        for alias in node.names:
            if alias.name == "*":
                self.flag(node, "import", f"a star import from {module} hides which names the file uses")
                continue
            local = alias.asname or alias.name
            self._bind(node, local, f"{module}.{alias.name}")
            if module == "__future__":
                continue
            owner = MODULES.get(module)
            if owner is None:
                self.flag(node, "reach", f"{module} cannot be imported here, so what it reaches cannot be checked")
                ok = False
            else:
                ok = self._step(node, alias.name, module, owner, spelled=f"{module}.{alias.name}")[0]
            if not ok:
                self.unresolved.add(local)

    def _bind(self, node: ast.AST, local: str, path: str) -> None:
        if self.aliases.get(local, path) != path:
            self.flag(node, "import", f"the name {local!r} is imported twice as different things")
        elif local in ATTRIBUTE_BUILTINS:
            self._rebinds(node, local)
        self.aliases[local] = path

    @staticmethod
    def _allowed() -> str:
        return "torch, triton, math and their modules in validators.source_policy.NAMESPACES"

    def _rebinds(self, node: ast.AST, name: str | None) -> None:
        """Flag a binding of an imported name, or of getattr/hasattr (whose literal calls are read as attributes)."""
        if name is None:
            return
        name = _normal(name)
        if name in ATTRIBUTE_BUILTINS:
            self.flag(node, "import", f"the builtin {name!r} is rebound, so its calls would not read attributes")
        elif name in self.aliases:
            self.flag(node, "import", f"the imported name {name!r} is rebound, which hides what it refers to")

    # ------------------------------------------------------------------ names

    def visit_Name(self, node: ast.Name) -> None:
        name = _normal(node.id)
        if name in FORBIDDEN_NAMES:
            self.flag(node, "forbidden-name", f"the name {name!r} reaches files, processes or the interpreter")
        elif _is_dunder(name):
            self.flag(node, "dunder", f"the dunder name {name!r} is a classic sandbox escape")
        elif name in CLASS_WALK_NAMES and name not in self.aliases:
            self.flag(node, "introspection", f"the builtin {name!r} walks from objects to classes, their bases and "
                                             "members")
        elif name in ATTRIBUTE_BUILTINS and isinstance(node.ctx, ast.Load) and not self._is_called(node):
            self.flag(node, "dynamic-attribute", f"{name} may only be called directly with a literal name")
        if isinstance(node.ctx, (ast.Store, ast.Del)):
            self._rebinds(node, name)

    def _is_called(self, node: ast.Name) -> bool:
        parent = self.parents.get(node)
        return isinstance(parent, ast.Call) and parent.func is node

    def visit_arg(self, node: ast.arg) -> None:
        self._rebinds(node, node.arg)

    def visit_ExceptHandler(self, node: ast.ExceptHandler) -> None:
        self._rebinds(node, node.name)

    def visit_MatchAs(self, node: ast.MatchAs) -> None:
        self._rebinds(node, node.name)

    def visit_MatchStar(self, node: ast.MatchStar) -> None:
        self._rebinds(node, node.name)

    def visit_MatchMapping(self, node: ast.MatchMapping) -> None:
        self._rebinds(node, node.rest)

    def visit_MatchClass(self, node: ast.MatchClass) -> None:
        """``case C(attr=p)`` reads ``subject.attr`` by name: the same rules as any attribute on an object."""
        for attr in node.kwd_attrs:
            if not self._step(node, attr, None, MISSING)[0]:
                return

    def visit_Yield(self, node: ast.Yield | ast.YieldFrom | ast.Await) -> None:
        """A with block suspended at a yield or await stays entered after the call returns: autocast, no_grad
        or a stream context left open changes what the caller (and the reference) computes."""
        parent = self.parents.get(node)
        while parent is not None and not isinstance(parent, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            if isinstance(parent, (ast.With, ast.AsyncWith)):
                self.flag(node, "global-state", "suspending inside a with block can leave its context (autocast, "
                                                "no_grad, a stream) entered after the call returns")
                return
            parent = self.parents.get(parent)

    visit_YieldFrom = visit_Await = visit_Yield

    # ------------------------------------------------------------------ definitions

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        if _is_dunder(node.name):
            self.flag(node, "dunder", f"defining {node.name} hooks into the interpreter or torch's dispatch")
        self._rebinds(node, node.name)
        self._decorators(node)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._rebinds(node, node.name)
        if node.keywords:
            self.flag(node, "dunder", f"the class {node.name} passes {node.keywords[0].arg or '**'} to class "
                                      "creation (a metaclass hooks into the interpreter)")
        self._decorators(node)

    def _decorators(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> None:
        for decorator in node.decorator_list:
            target = decorator.func if isinstance(decorator, ast.Call) else decorator
            path = self._path(target)
            if path not in ALLOWED_DECORATORS:
                plain = all(isinstance(n, (ast.Name, ast.Attribute, ast.Load)) for n in ast.walk(target))
                spelled = ast.unparse(target) if plain else "an expression"
                self.flag(decorator, "decorator", f"the decorator {spelled} runs on {node.name} when the file is "
                                                  f"imported (only {', '.join(sorted(ALLOWED_DECORATORS))} are "
                                                  "allowed)")

    def _path(self, node: ast.expr) -> str | None:
        """The imported path a plain chain spells (``tl.x`` -> ``triton.language.x``), or None."""
        if isinstance(node, ast.Name):
            return self.aliases.get(_normal(node.id))
        if isinstance(node, ast.Attribute):
            base = self._path(node.value)
            return f"{base}.{_normal(node.attr)}" if base else None
        return None

    # ------------------------------------------------------------------ attributes and chains

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if isinstance(node.ctx, (ast.Store, ast.Del)):
            self.flag(node, "attribute-assignment",
                      f"assigning or deleting the attribute {node.attr!r} changes shared objects (monkeypatching)")

    def visit_Call(self, node: ast.Call) -> None:
        if isinstance(node.func, ast.Name) and node.func.id in ATTRIBUTE_BUILTINS and not self._literal_link(node):
            self.flag(node, "dynamic-attribute",
                      f"{node.func.id} must name its attribute with a string literal, or static checks are blind")

    @staticmethod
    def _literal_link(node: ast.AST) -> bool:
        """``getattr(x, 'name'[, default])`` or ``hasattr(x, 'name')``: an attribute read spelled as a call."""
        return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ATTRIBUTE_BUILTINS and not node.keywords and 2 <= len(node.args) <= 3
                and not any(isinstance(a, ast.Starred) for a in node.args)
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str))

    def _link(self, node: ast.AST | None) -> tuple[ast.expr, str] | None:
        """(base, attribute name) when ``node`` reads one attribute of ``base``."""
        if isinstance(node, ast.Attribute):
            return node.value, node.attr
        if self._literal_link(node):
            return node.args[0], node.args[1].value
        return None

    def _is_chain_end(self, node: ast.AST) -> bool:
        if isinstance(node, ast.Name):
            if not isinstance(node.ctx, ast.Load) or _normal(node.id) not in self.aliases:
                return False
        elif self._link(node) is None:
            return False
        link = self._link(self.parents.get(node))
        return link is None or link[0] is not node

    def _check_chain(self, end: ast.AST) -> None:
        """Resolve a chain root outwards; flag its first step out of bounds, or a module it leaves as a value."""
        steps: list[tuple[ast.AST, str]] = []
        node: ast.AST = end
        while (link := self._link(node)) is not None:
            steps.append((node, link[1]))
            node = link[0]
        path: str | None = None
        value: Any = MISSING
        if isinstance(node, ast.Name) and (name := _normal(node.id)) in self.aliases and name not in self.unresolved:
            path = self.aliases[name]
            value = self._lookup(path)
        for step, attr in reversed(steps):
            ok, path, value = self._step(step, attr, path, value)
            if not ok:
                return
        is_hasattr = isinstance(end, ast.Call) and isinstance(end.func, ast.Name) and end.func.id == "hasattr"
        if inspect.ismodule(value) and not is_hasattr:
            self.flag(end, "reach", f"the module {ast.unparse(end)} is used as a value (assigned, passed, returned "
                                    "or matched), which hides what is reached through it")

    @staticmethod
    def _lookup(path: str) -> Any:
        """The object an imported path names (a module of ``NAMESPACES`` or one member of one), or MISSING."""
        if path in NAMESPACES:
            module = MODULES.get(path)
            return MISSING if module is None else module
        owner, _, member = path.rpartition(".")
        module = MODULES.get(owner)
        return MISSING if module is None else member(module, member)

    def _step(self, node: ast.AST, attr: str, owner: str | None, value: Any,
              spelled: str | None = None) -> tuple[bool, str | None, Any]:
        """Apply the rules to ``owner.attr``, where ``value`` is what ``owner`` resolved to (MISSING: nothing).

        Returns whether the step is allowed, and the path and object it leads to.
        """
        attr = _normal(attr)
        qualified = f"{owner}.{attr}" if owner else f"<object>.{attr}"
        if not self._check_attribute_name(node, attr, owner, qualified):
            return False, None, MISSING
        if value is MISSING:
            return True, None, MISSING

        def reach(why: str) -> tuple[bool, None, Any]:
            shown = spelled if spelled is not None else ast.unparse(node)
            named = qualified if shown == qualified else f"{shown} ({qualified})"
            self.flag(node, "reach", f"{named} {why}")
            return False, None, MISSING

        problem = None
        if inspect.ismodule(value):
            members = NAMESPACES.get(value.__name__, frozenset())
            if members is not None and attr not in members:
                return reach(f"is not one of the members of {value.__name__} a kernel may use "
                             f"({', '.join(sorted(members)) or 'none'})")
            found = member(value, attr)
            if found is MISSING:
                return reach(f"does not resolve to a member of {value.__name__} here")
            if members is None and not inspect.ismodule(found):
                problem = member_problem(value, found)
        else:  # a class, function or constant reached through a namespace: its members are looked up statically
            found = member(value, attr)
            if found is MISSING:
                return True, qualified, MISSING
            if is_machinery(found):
                problem = "part of torch's TorchScript and serialisation machinery"
        if inspect.ismodule(found):
            if found.__name__ not in NAMESPACES:
                what = "is a module" if found.__name__ == qualified else f"is the module {found.__name__}"
                return reach(f"{what} outside the namespaces a kernel may use (validators.source_policy.NAMESPACES)")
            return True, found.__name__, found
        if problem:
            return reach(f"is {problem}, outside what a kernel may use")
        return True, qualified, found

    def _check_attribute_name(self, node: ast.AST, attr: str, owner: str | None, qualified: str) -> bool:
        """The name rules for ``owner.attr``; ``owner`` is a resolved path or None."""
        fragment = next(((f, why) for f, case, why in FORBIDDEN_FRAGMENTS
                         if (f in attr if case else f in attr.lower())), None)
        if not attr.isidentifier():
            self.flag(node, "dynamic-attribute", "an attribute named by a string that is not an identifier hides "
                                                 "what is read")
        elif _is_dunder(attr):
            self.flag(node, "dunder", f"the dunder attribute {attr!r} is a classic sandbox escape")
        elif attr.startswith("_"):
            self.flag(node, "private", f"the private attribute {qualified} reaches torch or Triton internals")
        elif attr.startswith(INTROSPECTION_PREFIXES) or attr == "mro":
            self.flag(node, "introspection", f"the attribute {qualified} reaches frames, code, tracebacks or "
                                             "class hierarchies")
        elif attr in FORBIDDEN_NAMES:
            self.flag(node, "forbidden-name", f"the attribute {qualified} reaches files, processes or the interpreter")
        elif attr in FORBIDDEN_APIS and not (attr == "load" and owner == TRITON_LANGUAGE):
            self.flag(node, "forbidden-api", f"{qualified} {FORBIDDEN_APIS[attr]}")
        elif fragment is not None:
            self.flag(node, "forbidden-api", f"{qualified} {fragment[1]}")
        elif attr in GLOBAL_STATE_NAMES or attr.startswith(GLOBAL_STATE_PREFIXES):
            self.flag(node, "global-state", f"{qualified} changes process-wide state (RNG, defaults, streams, hooks)")
        else:
            return True
        return False


def _defines_function(tree: ast.Module, name: str) -> bool:
    return any(isinstance(node, ast.FunctionDef) and node.name == name for node in tree.body)


def _declared_encoding(source: str) -> tuple[int, str] | None:
    """(line, codec) of a PEP 263 coding declaration that is not UTF-8, or None. Lines 1 and 2 are read by every
    way of splitting lines (a lone CR, or a line separator only str.splitlines honours), so none hides one."""
    text = source.removeprefix("\ufeff")
    for lines in (text.split("\n"), re.split(r"\r\n|\r|\n", text), text.splitlines()):
        for number, line in enumerate(lines[:2], start=1):
            match = CODING.match(line)
            if match is None:
                continue
            try:
                name = codecs.lookup(match.group(1)).name
            except LookupError:
                name = match.group(1)
            if name != "utf-8":
                return number, match.group(1)
    return None


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
    declared = _declared_encoding(source)
    if declared is not None:
        line, codec = declared
        return _first([Violation(rule="encoding", line=line, message=(
            f"Rule encoding, line {line}: the file declares the encoding {codec!r}, so Python would decode it "
            f"differently from the UTF-8 text checked here."))])
    too_deep = Violation(rule="syntax", line=0, message="Rule syntax, line 0: the file nests expressions too "
                                                         "deeply to be checked.")
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError) as exc:
        line = getattr(exc, "lineno", 0) or 0
        reason = (getattr(exc, "msg", None) or str(exc)).split(". ")[0].rstrip(".")  # one sentence
        return _first([Violation(rule="syntax", line=line, message=f"Rule syntax, line {line}: {reason}.")])
    except (RecursionError, MemoryError):
        return _first([too_deep])
    checker = _Checker()
    nodes = list(ast.walk(tree))
    for parent in nodes:
        for child in ast.iter_child_nodes(parent):
            checker.parents[child] = parent
    imports = [n for n in nodes if isinstance(n, (ast.Import, ast.ImportFrom))]
    try:
        for node in imports + [n for n in nodes if not isinstance(n, (ast.Import, ast.ImportFrom))]:
            checker.check(node)
    except RecursionError:
        return _first([too_deep])
    if not _defines_function(tree, slot_name):
        checker.violations.append(Violation(
            rule="missing-function", line=0,
            message=f"Rule missing-function, line 0: the file defines no top-level function {slot_name!r}."))
    return _first(checker.violations)
