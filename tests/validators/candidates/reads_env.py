"""Wrong: reads the environment and writes a file when imported; its arithmetic is correct.

If SG_OPT_TEST_MARKER is set, it writes there what it found in SG_OPT_TEST_API_KEY, so a test can
see both that it ran and what environment it ran in.
"""
import os

import torch

_marker = os.environ.get("SG_OPT_TEST_MARKER")
if _marker:
    with open(_marker, "w") as f:
        f.write(os.environ.get("SG_OPT_TEST_API_KEY", "<no key>"))


def tail_forward(h, idx, w, bias):
    z = torch.einsum("bkf,kgf->bkg", h[:, idx], w)
    if bias is not None:
        z = z + bias
    return z.reshape(h.shape[0], -1)
