"""Wrong: computes in fp16 and patches torch.einsum, which the reference uses, to do the same.

With the patch in place the reference agrees with the sloppy output, so only a check that torch
itself was left alone (static: no attribute assignment; dynamic: the worker's global-state
snapshot) can reject it.
"""
import torch

_einsum = torch.einsum


def _fp16_einsum(equation, *operands):
    return _einsum(equation, *(x.half() for x in operands)).to(operands[0].dtype)


torch.einsum = _fp16_einsum


def tail_forward(h, idx, w, bias):
    z = _fp16_einsum("bkf,kgf->bkg", h[:, idx], w)
    if bias is not None:
        z = z + bias
    return z.reshape(h.shape[0], -1)
