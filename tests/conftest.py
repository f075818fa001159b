"""Without a GPU, Triton kernels run in Triton's CPU interpreter. Triton picks interpreter or
compiler when triton.language is first imported, so the choice is made here, before any test
module imports it."""

import os

import torch

# A test's measurement does not wait for a busy machine to calm down (the suite itself keeps it busy).
os.environ.setdefault("SG_OPT_QUIET_WAIT_S", "0")

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
