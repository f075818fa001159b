"""Cheat: opens an aten IMPL library and replaces aten::bmm's CPU kernel, which the reference's einsum runs on.

torch.library.Library("aten", "IMPL") overrides a built-in operator for the whole process (with one
warning), so the float64 reference computes whatever the candidate says, here in fp16.
"""
import torch

_lib = torch.library.Library("aten", "IMPL")


def _fp16_bmm(a, b):
    return (a.half()[:, :, :, None] * b.half()[:, None, :, :]).sum(2).to(a.dtype)


_lib.impl("bmm", _fp16_bmm, "CPU")


def tail_forward(h, idx, w, bias):
    z = torch.einsum("bkf,kgf->bkg", h[:, idx], w)
    if bias is not None:
        z = z + bias
    return z.reshape(h.shape[0], -1)
