"""Without a GPU, Triton kernels run in Triton's CPU interpreter. Triton picks interpreter or
compiler when triton.language is first imported, so the choice is made here, before any test
module imports it.

Markers set here rather than on each test, so that ``make test-fast`` (``-m "not slow and not gpu"``) stays
right as tests are added: ``gpu`` on tests that skip without CUDA (read from their skip reasons), ``slow`` on tests
that need the session's real agent run (``agent_run`` in tests/sg_opt/conftest.py: half a minute)."""

import os
import re

import pytest
import torch

# A test's measurement does not wait for a busy machine to calm down (the suite itself keeps it busy).
os.environ.setdefault("SG_OPT_QUIET_WAIT_S", "0")
# Nor does it read that load for half a second first: with no wait, the reading is only recorded (0.1 s still tells
# a busy loop of one CPU from a quiet machine, as test_machine_load checks), and a suite makes hundreds of them.
os.environ.setdefault("SG_OPT_LOAD_SAMPLE_S", "0.1")
# Wide enough that no message the tests read is wrapped, however long the temporary folder's path; set once for the
# whole session, since every change of the workers' environment starts a fork server anew (seconds of torch imports).
os.environ.setdefault("COLUMNS", "300")

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The reasons a test skips without CUDA ("needs a CUDA device", "streams need CUDA", "on CUDA only"); not the
# reverse ("CUDA is present here", "for machines without a GPU").
NEEDS_CUDA = re.compile(r"\bneeds? (a )?(cuda|gpu)\b|\b(cuda|gpu) only\b", re.IGNORECASE)
CUDA_DEVICE = re.compile(r"cuda(:\d+)?")


def _needs_cuda(item: pytest.Item) -> bool:
    if any(NEEDS_CUDA.search(str(mark.kwargs.get("reason", ""))) for mark in item.iter_markers("skipif")):
        return True
    params = getattr(getattr(item, "callspec", None), "params", {})  # a device parametrized in only with CUDA
    return any(name.endswith("device") and isinstance(value, (str, torch.device)) and CUDA_DEVICE.fullmatch(str(value))
               for name, value in params.items())


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _needs_cuda(item):
            item.add_marker(pytest.mark.gpu)
        if "agent_run" in item.fixturenames:  # directly, or through rich_run or finished_run
            item.add_marker(pytest.mark.slow)
