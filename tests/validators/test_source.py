"""The static check: each rule rejects what it names, at the right line, in one sentence; attribute
chains are resolved against the real modules and must stay inside the allowed namespaces; real
kernels (torch and Triton, the project's own included) pass; the adversarial candidates that reach
outside are rejected."""

from __future__ import annotations

import ast
import inspect
import textwrap
from pathlib import Path

import pytest

from targets.haste_rec.embeddings.embedding_slots import EMBEDDING_SLOTS
from targets.haste_rec.tail.tail_slots import TAIL_SLOTS
from validators.source import check_source
from validators.source_policy import ALLOWED_MODULES, MODULES, NAMESPACES

CANDIDATES = Path(__file__).parent / "candidates"
REAL_KERNELS = Path(__file__).parents[2] / "targets" / "haste_rec"
SLOT = "tail_forward"
BODY = "def tail_forward(h, idx, w, bias):\n    return h\n"


def _case(snippet: str, rule: str, line_in_snippet: int | None = None):
    """A snippet placed after three import lines, expected to fail ``rule`` at its last (or given) line."""
    line = 3 + (line_in_snippet or snippet.count("\n") + 1)
    return pytest.param(snippet, rule, line, id=f"{rule}:{snippet.splitlines()[-1][:40]}")


def _verdict(snippet: str):
    return check_source("import torch\nimport triton\nimport triton.language as tl\n" + snippet + "\n" + BODY, SLOT)


@pytest.mark.parametrize("snippet,rule,line", [_case(*case) for case in [
    ("import os", "import"),
    ("import torch.utils.cpp_extension", "import"),
    ("from os import path", "import"),
    ("from . import helper", "import"),
    ("from math import *", "import"),
    ("import __future__", "import"),
    ("x = open('/etc/passwd').read()", "forbidden-name"),
    ("x = eval('1 + 1')", "forbidden-name"),
    ("exec('x = 1')", "forbidden-name"),
    ("k = torch.compile(abs)", "forbidden-name"),
    ("m = __import__('os')", "forbidden-name"),
    ("g = globals()", "forbidden-name"),
    ("breakpoint()", "forbidden-name"),
    ("setattr(torch, 'einsum', abs)", "forbidden-name"),
    ("help(torch)", "forbidden-name"),
    ("def f(x):\n    return x.io", "forbidden-name"),
    ("x = triton.compile", "forbidden-name"),
    ("a = getattr(torch, 'ein' + 'sum')", "dynamic-attribute"),
    ("g = getattr", "dynamic-attribute"),
    ("a = getattr(torch, 'not an identifier')", "dynamic-attribute"),
    ("a = getattr(torch, '_C')", "private"),
    ("x = torch._C._get_tracing_state()", "private"),
    ("s = (1).__class__.__base__.__subclasses__()", "dunder"),
    ("b = __builtins__", "dunder"),
    ("d = torch.__dict__", "dunder"),
    ("class A(metaclass=abs):\n    pass", "dunder", 1),
    ("class T(torch.Tensor):\n    def __torch_function__(cls, func, types, args=(), kwargs=None):\n        return 0",
     "dunder", 2),
    ("def gen():\n    yield\nx = gen().gi_frame", "introspection"),
    ("def f():\n    return f.f_back", "introspection"),
    ("def f(h):\n    return type(h)", "introspection"),
    ("def f(h):\n    return h.mro", "introspection"),
    ("x = dir(torch.Tensor)", "introspection"),
    ("x = object", "introspection"),
    ("class A:\n    def f(self):\n        return super()", "introspection"),
    ("a = getattr(torch, 'load')", "forbidden-api"),
    ("x = torch.load('weights.pt')", "forbidden-api"),
    ("torch.save(torch.ones(1), 'out.pt')", "forbidden-api"),
    ("m = torch.hub.list('owner/repo')", "forbidden-api"),
    ("t = torch.from_file('data.bin')", "forbidden-api"),
    ("t = triton.testing.do_bench(abs)", "forbidden-api"),
    ("x = torch.backends.cuda.matmul.allow_tf32", "forbidden-api"),
    ("s = '{0.__globals__}'.format(abs)", "forbidden-api"),
    ("from torch import library", "forbidden-api"),
    ("def f(x):\n    x.numpy().tofile('x.bin')", "forbidden-api"),
    ("def f(x):\n    return x.untyped_storage()", "forbidden-api"),
    ("def f(x):\n    return x.share_memory_()", "forbidden-api"),
    ("def f(x):\n    return x.as_subclass(torch.Tensor)", "forbidden-api"),
    ("def f(p):\n    return p.loads(b'')", "forbidden-api"),
    ("x = torch.UntypedStorage", "forbidden-api"),
    ("x = torch.get_device_module()", "forbidden-api"),
    ("x = torch.import_ir_module", "forbidden-api"),
    ("x = torch.PyTorchFileWriter", "forbidden-api"),
    ("s = torch.Stream()", "forbidden-api"),
    ("def f(h):\n    match h:\n        case torch.Tensor(numpy=n):\n            return n", "forbidden-api", 3),
    ("torch.cuda.set_stream(torch.cuda.Stream())", "global-state"),
    ("torch.set_default_dtype(torch.float64)", "global-state"),
    ("torch.manual_seed(0)", "global-state"),
    ("g = torch.random.get_rng_state()", "global-state"),
    ("def g():\n    with torch.autocast('cpu', dtype=torch.bfloat16):\n        yield", "global-state"),
    ("async def g():\n    with torch.no_grad():\n        await g()", "global-state"),
    ("x = triton.set_allocator", "global-state"),
    ("torch.backends.cudnn.allow_tf32 = True", "attribute-assignment"),
    ("torch.einsum = abs", "attribute-assignment"),
    ("del torch.einsum", "attribute-assignment"),
    ("@torch.no_grad()\ndef g():\n    pass", "decorator", 1),
    ("@abs\ndef g():\n    pass", "decorator", 1),
    # chains must stay inside NAMESPACES, resolved against the real modules
    ("f = torch.jit.fork(abs, 1)", "reach"),
    ("torch.ops.load_library('evil.so')", "reach"),
    ("x = torch.ops.aten.bmm", "reach"),
    ("x = torch.serialization.pickle.loads(b'')", "reach"),
    ("f = torch.nn.modules.module.io.FileIO('x.bin', 'w')", "reach"),
    ("f = torch.serialization.io.FileIO('x.bin', 'w')", "reach"),
    ("import torch.nn as nn\nx = nn.Linear", "reach"),
    ("from torch.nn import modules", "reach"),
    ("from torch import serialization", "reach"),
    ("x = getattr(torch, 'serialization')", "reach"),
    ("x = getattr(getattr(torch, 'nn'), 'modules')", "reach"),
    ("x = torch.no_such_member", "reach"),
    ("x = torch.cuda.memory_allocated()", "forbidden-api"),
    ("x = torch.ScriptModule", "reach"),
    ("x = torch.CompilationUnit('def f(x): return x')", "reach"),
    ("m = tl.extra.modules['os']", "reach"),
    ("w = tl.math.wraps", "reach"),
    ("x = tl.core.builtins", "reach"),
    ("x = triton.JITFunction", "reach"),
    ("import torch.nn.functional as F\nx = F.np", "reach"),
    ("import torch.nn.functional as F\nx = F.torch.serialization", "reach"),
    # a module used as a value: what is reached through it could no longer be resolved
    ("t = torch\nx = t.load('weights.pt')", "reach", 1),
    ("def f():\n    return (t := torch.nn.functional)", "reach"),
    ("f = lambda m=torch: m.serialization", "reach"),
    ("match torch:\n    case m:\n        pass", "reach", 1),
    ("x = f'{torch.serialization!r}'", "reach"),
    ("x = [torch][0]", "reach"),
    # rebinding an imported name, by any spelling
    ("tl = torch", "import"),
    ("import math as tl", "import"),
    ("def tl():\n    pass", "import", 1),
    ("class tl:\n    pass", "import", 1),
    ("try:\n    pass\nexcept Exception as tl:\n    pass", "import", 3),
    ("match 1:\n    case tl:\n        pass", "import", 2),
    ("match [1]:\n    case [*tl]:\n        pass", "import", 2),
    ("x = (tl := 1)", "import"),
    ("f = lambda tl: 1", "import"),
    ("del tl", "import"),
    ("def f():\n    global tl\n    tl = 1", "import"),
    # identifiers are read NFKC-normalised, as Python reads them; getattr strings too, to be safe
    ("g = \uff47\uff4c\uff4f\uff42\uff41\uff4c\uff53()", "forbidden-name"),
    ("x = torch.\uff53erialization", "reach"),
    ("x = getattr(torch, '\uff4coad')", "forbidden-api"),
    ("\uff54\uff4c = 1", "import"),
    # getattr(torch, 'cuda') is read as torch.cuda: a getattr of the file's own would receive the module itself
    ("def getattr(m, name):\n    return m.utils", "import", 1),
    ("getattr = print", "import"),
    ("from math import pi as getattr", "import"),
    ("def f(hasattr):\n    return hasattr", "import", 1),
]])
def test_each_rule_rejects_with_its_name_and_line(snippet, rule, line):
    verdict = _verdict(snippet)
    assert not verdict.ok
    assert (verdict.rule, verdict.line) == (rule, line), verdict.message
    assert verdict.message.startswith(f"Rule {rule}, line {line}: ") and verdict.message.endswith(".")
    assert verdict.message.count(". ") == 0  # one sentence


def test_a_chain_is_reported_once_at_its_first_step_out_of_bounds():
    verdict = _verdict("x = torch.serialization.pickle.loads(b'')")
    assert [v.rule for v in verdict.violations] == ["reach"]
    assert "torch.serialization is a module outside the namespaces" in verdict.message
    aliased = _verdict("y = tl.extra.modules")
    assert "tl.extra.modules (triton.language.extra.modules) is not one of the members" in aliased.message


@pytest.mark.parametrize("snippet", [
    "from __future__ import annotations",
    "import math\nfrom triton import language as language",
    "from torch import cuda\nfrom triton.language import load",
    "from torch.nn import functional",
    "from triton import Config, cdiv, next_power_of_2",
    "def ok(h, s):\n    with torch.cuda.stream(s):\n        return torch.nn.functional.relu(h) * math.pi",
    "def ok(x):\n    return tl.load(x) + triton.language.load(x) + getattr(x, 'shape')[0]",
    "import triton.language\ndef ok(x):\n    return triton.language.store(x, 1)",
    "import torch.nn.functional as F\ndef ok(x):\n    return F.relu(x) + torch.linalg.vector_norm(x) + "
    "torch.special.expit(x) + torch.fft.fft(x).real",
    "from triton.language.extra import libdevice\nfrom triton.language.extra.cuda import libdevice as ld\n"
    "@triton.jit\ndef ok(x):\n    return libdevice.exp(x) + tl.extra.libdevice.exp(x) + tl.math.exp(x) + ld.exp(x)",
    "def ok(h):\n    s = torch.cuda.current_stream(h.device)\n    p = torch.cuda.get_device_properties(h.device)\n"
    "    with torch.cuda.device(h.device), torch.cuda.stream(s):\n        return p.multi_processor_count",
    "@triton.autotune(configs=[triton.Config({'B': 16})], key=['n'])\n@triton.heuristics({'E': lambda a: 1})\n"
    "@triton.jit(do_not_specialize=['n'])\ndef ok(x, n, B: tl.constexpr, E: tl.constexpr):\n    pass",
    "x = (torch.float32.itemsize, tl.float32, torch.contiguous_format, torch.pi, torch.newaxis, torch.Tensor.add_)",
    "x = hasattr(torch, 'cuda')",
    "def ok(x):\n    return f'{x!r:>10} {x.shape}'",
    "def ok(x):\n    match x.dim():\n        case 2:\n            return x.t()\n        case n:\n            return n",
    "def ok(x):\n    return x.data_ptr() + x.pin_memory().numel() + x.storage_offset() + x.type(torch.float64).numel()",
    "def ok(n):\n    with torch.no_grad():\n        steps = [i for i in range(n)]\n    yield from steps",
])
def test_ordinary_kernel_code_passes(snippet):
    verdict = _verdict(("import math\n" if "math." in snippet else "") + snippet)
    assert verdict.ok, verdict.message


def test_load_is_allowed_only_through_triton_language():
    assert not _verdict("import torch as tl2\nx = tl2.load('w.pt')").ok
    assert not check_source("import torch as tl\n" + BODY + "x = tl.load('w.pt')\n", SLOT).ok


def test_every_namespace_and_listed_member_resolves_here():
    """The allow-list names real things in the installed torch and triton (a rename would silently narrow it)."""
    for name, members in NAMESPACES.items():
        module = MODULES.get(name)
        assert module is not None, name
        for member in members or ():
            assert hasattr(module, member) or MODULES.get(f"{name}.{member}") is not None, f"{name}.{member}"
    assert ALLOWED_MODULES == frozenset(NAMESPACES) | {"__future__"}


@pytest.mark.parametrize("member", [
    "load", "save", "from_file", "compile", "fork", "get_device_module", "import_ir_module", "get_file_path",
    "PyTorchFileReader", "PyTorchFileWriter", "CompilationUnit", "ScriptModule", "UntypedStorage", "TypedStorage",
    "Stream", "Event", "set_default_dtype", "manual_seed", "default_generator", "serialization", "ops", "library",
    "jit", "utils", "multiprocessing", "classes", "storage", "hub", "os", "sys", "builtins", "importlib", "ctypes",
    "cuda.memory", "cuda.Stream", "cuda.graphs", "cuda.CUDAGraph", "cuda.nccl", "cuda.set_per_process_memory_fraction",
])
def test_top_level_torch_members_that_escape_are_refused(member):
    verdict = check_source(f"import torch\nx = torch.{member}\n" + BODY, SLOT)
    assert not verdict.ok and verdict.line == 2, member


@pytest.mark.parametrize("source,line", [
    ("# coding: utf-7\n" + BODY, 1),
    ("#!/usr/bin/env python\n# -*- coding: latin-1 -*-\n" + BODY, 2),
    ("# vim: set fileencoding=unicode_escape :\n" + BODY, 1),
    ("#\u2028\n# coding: utf-7\n" + BODY, 2),  # a separator only str.splitlines honours does not hide it
    ("# coding: no-such-codec\n" + BODY, 1),
])
def test_a_coding_declaration_other_than_utf8_is_rejected(source, line):
    verdict = check_source(source, SLOT)
    assert (verdict.rule, verdict.line) == ("encoding", line), verdict.message
    assert verdict.message.count(". ") == 0


def test_utf8_declarations_and_late_coding_comments_pass():
    for source in ("# -*- coding: utf-8 -*-\n" + BODY, "# coding=UTF8\n" + BODY,
                   "x = 1\ny = 2\n# coding: utf-7\n" + BODY):
        assert check_source(source, SLOT).ok, source


def test_syntax_size_and_missing_function():
    broken = check_source("def tail_forward(:\n", SLOT)
    assert (broken.rule, broken.line) == ("syntax", 1)
    big = check_source("x = 1\n" * 20_000 + BODY, SLOT, max_bytes=64_000)
    assert big.rule == "size" and "120" in big.message
    for source in ("import torch\ndef other(h):\n    return h\n",
                   "tail_forward = lambda h, idx, w, bias: h\n",
                   "class K:\n    def tail_forward(self, h):\n        return h\n",
                   "def outer():\n    def tail_forward(h):\n        return h\n"):
        assert check_source(source, SLOT).rule == "missing-function", source
    assert check_source("import torch\n" + BODY, "tail_backward_input").rule == "missing-function"


def test_every_violation_is_listed_in_line_order():
    verdict = check_source("import os\nimport torch\nx = torch.load('a')\ny = torch._C\n", SLOT)
    assert [(v.rule, v.line) for v in verdict.violations] == [
        ("import", 1), ("forbidden-api", 3), ("private", 4), ("missing-function", 0)]
    assert verdict.rule == "import"


def test_null_bytes_and_nesting_too_deep_to_parse_are_syntax_rejections():
    assert check_source("x = 1\0\n" + BODY, SLOT).rule == "syntax"
    for source in ("import torch\nx = torch" + ".a" * 30_000, "x = " + "-" * 60_000 + "1", "x = h" + "[0]" * 20_000):
        verdict = check_source(source + "\n" + BODY, SLOT)
        assert (verdict.rule, verdict.line) == ("syntax", 0) and "too deeply" in verdict.message
    hinted = check_source("x = [1] = 2\n" + BODY, SLOT)  # Python's own message has two sentences
    assert hinted.rule == "syntax" and hinted.message.count(". ") == 0


@pytest.mark.parametrize("name", ["correct", "triton_correct", "cached", "partial_write", "special_shapes",
                                  "modifies_input", "produces_nan", "fp16_sloppy", "reuses_buffer", "hangs"])
def test_candidates_that_only_compute_pass_the_static_check(name):
    """These are wrong only in what they compute: the dynamic check must catch them (test_kernel)."""
    verdict = check_source((CANDIDATES / f"{name}.py").read_text(), SLOT)
    assert verdict.ok, verdict.message


@pytest.mark.parametrize("name,rule,line,also", [
    ("reads_env", "import", 6, {"forbidden-name"}),  # import os, then os.environ and open()
    ("import_tricks", "dynamic-attribute", 4, {"dunder"}),  # getattr(__builtins__, "__imp" + "ort__")
    ("patches_reference", "attribute-assignment", 16, set()),  # torch.einsum = ...
    ("crashes", "import", 2, {"forbidden-name"}),  # ctypes
    ("forges_result", "import", 2, {"forbidden-name"}),  # json, os, sys, open
    ("side_stream", "forbidden-api", 12, set()),  # torch.cuda.Stream; test_kernel checks the race dynamically
])
def test_candidates_that_reach_outside_are_rejected_statically(name, rule, line, also):
    verdict = check_source((CANDIDATES / f"{name}.py").read_text(), SLOT)
    assert not verdict.ok
    assert (verdict.rule, verdict.line) == (rule, line), verdict.message
    assert also <= {v.rule for v in verdict.violations}


# ----------------------------------------------------------------------------- the project's own kernels

# Each Triton kernel module and the launcher it exposes for a kernel slot.
REAL_LAUNCHERS = {
    "triton_tail": "tail_forward_triton",
    "triton_tail_backward": "tail_backward_input_triton",
    "triton_perlabel": "perlabel_forward_triton",
    "triton_fused_bce": "tail_fused_bce_triton",
    "triton_embedding": "embedding_pool_forward",
}
# Project plumbing around the kernels, not kernel code, and why a candidate could not hold it as written.
NOT_KERNEL_LEVEL = {
    "interpreter_active": "asks triton.runtime whether the CPU interpreter is on",
    "slot_csr": "caches on a weakref and the tensor's private _version",
    "_kernel_positives": "names a wrong argument's type with type(x).__name__ in its error",
}


def _kernel_level(path: Path) -> tuple[str, set[str]]:
    """The file as a candidate would hold it, and the names of its @triton.jit kernels.

    Kept: imports of allowed modules, module-level constants and every top-level function except
    ``NOT_KERNEL_LEVEL``. Dropped: imports of project modules and the standard library, and classes
    (frozen-dataclass configs with ``__post_init__``), none of which a kernel needs.
    """
    tree = ast.parse(path.read_text(encoding="utf-8"))
    kept, kernels = [], set()
    for node in tree.body:
        if isinstance(node, ast.Import) and all(a.name in ALLOWED_MODULES for a in node.names):
            kept.append(node)
        elif isinstance(node, ast.ImportFrom) and node.module in ALLOWED_MODULES:
            kept.append(node)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            kept.append(node)
        elif isinstance(node, ast.FunctionDef) and node.name not in NOT_KERNEL_LEVEL:
            kept.append(node)
            if any(ast.unparse(d) == "triton.jit" for d in node.decorator_list):
                kernels.add(node.name)
    return ast.unparse(ast.Module(body=kept, type_ignores=[])), kernels


@pytest.mark.parametrize("module,launcher", sorted(REAL_LAUNCHERS.items()))
def test_the_projects_triton_kernels_pass_as_candidates(module, launcher):
    (path,) = REAL_KERNELS.rglob(f"{module}.py")
    source, kernels = _kernel_level(path)
    assert kernels and launcher in source
    verdict = check_source(source, launcher)
    assert verdict.ok, verdict.violations


def test_every_triton_kernel_module_the_project_ships_is_covered():
    shipped = {p.stem for p in REAL_KERNELS.rglob("*.py") if "@triton.jit" in p.read_text(encoding="utf-8")}
    assert shipped == set(REAL_LAUNCHERS)


@pytest.mark.parametrize("slot", TAIL_SLOTS + EMBEDDING_SLOTS, ids=lambda s: s.name)
def test_the_slot_references_pass_as_candidates(slot):
    """The torch references the proposer is shown as templates (the embedding ones call the store's own
    row_ops functions, plain names to this check)."""
    fn = slot.reference
    source = "import torch\nimport torch.nn.functional as F_nn\n\n" + textwrap.dedent(inspect.getsource(fn))
    verdict = check_source(source, fn.__name__)
    assert verdict.ok, verdict.message
