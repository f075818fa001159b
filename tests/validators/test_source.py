"""The static check: each rule rejects what it names, at the right line, in one sentence; real
kernels (torch and Triton) pass; the adversarial candidates that reach outside are rejected."""

from __future__ import annotations

from pathlib import Path

import pytest

from validators.source import check_source

CANDIDATES = Path(__file__).parent / "candidates"
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
    ("from torch.nn import functional", "import"),
    ("x = open('/etc/passwd').read()", "forbidden-name"),
    ("x = eval('1 + 1')", "forbidden-name"),
    ("exec('x = 1')", "forbidden-name"),
    ("k = torch.compile(abs)", "forbidden-name"),
    ("m = __import__('os')", "forbidden-name"),
    ("g = globals()", "forbidden-name"),
    ("breakpoint()", "forbidden-name"),
    ("setattr(torch, 'einsum', abs)", "forbidden-name"),
    ("a = getattr(torch, 'ein' + 'sum')", "dynamic-attribute"),
    ("g = getattr", "dynamic-attribute"),
    ("a = getattr(torch, '_C')", "private"),
    ("a = getattr(torch, 'load')", "forbidden-api"),
    ("s = (1).__class__.__base__.__subclasses__()", "dunder"),
    ("b = __builtins__", "dunder"),
    ("x = torch._C._get_tracing_state()", "private"),
    ("def gen():\n    yield\nx = gen().gi_frame", "introspection"),
    ("def f():\n    return f.f_back", "introspection"),
    ("class T(torch.Tensor):\n    def __torch_function__(cls, func, types, args=(), kwargs=None):\n        return 0",
     "dunder", 2),
    ("f = torch.jit.fork(abs, 1)", "forbidden-api"),
    ("help(torch)", "forbidden-name"),
    ("x = torch.load('weights.pt')", "forbidden-api"),
    ("torch.save(torch.ones(1), 'out.pt')", "forbidden-api"),
    ("m = torch.hub.list('owner/repo')", "forbidden-api"),
    ("torch.ops.load_library('evil.so')", "forbidden-api"),
    ("t = torch.from_file('data.bin')", "forbidden-api"),
    ("t = triton.testing.do_bench(abs)", "forbidden-api"),
    ("x = torch.backends.cuda.matmul.allow_tf32", "forbidden-api"),
    ("s = '{0.__globals__}'.format(abs)", "forbidden-api"),
    ("t = torch\nx = t.load('weights.pt')", "forbidden-api"),
    ("torch.cuda.set_stream(torch.cuda.Stream())", "global-state"),
    ("torch.set_default_dtype(torch.float64)", "global-state"),
    ("torch.manual_seed(0)", "global-state"),
    ("g = torch.random.get_rng_state()", "global-state"),
    ("torch.backends.cudnn.allow_tf32 = True", "attribute-assignment"),
    ("torch.einsum = abs", "attribute-assignment"),
    ("del torch.einsum", "attribute-assignment"),
    ("tl = torch", "import"),
]])
def test_each_rule_rejects_with_its_name_and_line(snippet, rule, line):
    verdict = _verdict(snippet)
    assert not verdict.ok
    assert (verdict.rule, verdict.line) == (rule, line), verdict.message
    assert verdict.message.startswith(f"Rule {rule}, line {line}: ") and verdict.message.endswith(".")
    assert verdict.message.count(". ") == 0  # one sentence


@pytest.mark.parametrize("snippet", [
    "from __future__ import annotations",
    "import math\nfrom triton import language as language",
    "from torch import cuda\nfrom triton.language import load",
    "def ok(h, s):\n    with torch.cuda.stream(s):\n        return torch.nn.functional.relu(h) * math.pi",
    "def ok(x):\n    return tl.load(x) + triton.language.load(x) + getattr(x, 'shape')[0]",
    "import triton.language\ndef ok(x):\n    return triton.language.store(x, 1)",
])
def test_ordinary_kernel_code_passes(snippet):
    verdict = _verdict(("import math\n" if "math." in snippet else "") + snippet)
    assert verdict.ok, verdict.message


def test_load_is_allowed_only_through_triton_language():
    assert not _verdict("import torch as tl2\nx = tl2.load('w.pt')").ok
    assert not check_source("import torch as tl\n" + BODY + "x = tl.load('w.pt')\n", SLOT).ok


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


def test_null_bytes_are_a_syntax_rejection():
    assert check_source("x = 1\0\n" + BODY, SLOT).rule == "syntax"


@pytest.mark.parametrize("name", ["correct", "triton_correct", "cached", "partial_write", "special_shapes",
                                  "modifies_input", "produces_nan", "fp16_sloppy", "reuses_buffer", "hangs",
                                  "side_stream"])
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
])
def test_candidates_that_reach_outside_are_rejected_statically(name, rule, line, also):
    verdict = check_source((CANDIDATES / f"{name}.py").read_text(), SLOT)
    assert not verdict.ok
    assert (verdict.rule, verdict.line) == (rule, line), verdict.message
    assert also <= {v.rule for v in verdict.violations}
