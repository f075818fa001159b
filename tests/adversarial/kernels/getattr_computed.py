"""Cheat: reaches torch.load by a name computed at run time, so no literal 'load' appears.

getattr with a built name is invisible to any list of names, so the only safe rule is that getattr
takes a string literal.
"""
import torch

_NAME = "".join(["lo", "ad"])
_weights = getattr(torch, _NAME)


def tail_forward(h, idx, w, bias):
    z = torch.einsum("bkf,kgf->bkg", h[:, idx], w)
    if bias is not None:
        z = z + bias
    return z.reshape(h.shape[0], -1)
