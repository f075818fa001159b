"""Cheat: reaches aten::einsum through torch.ops and registers a Python kernel for it with py_impl.

A Python kernel registered this way replaces aten's wherever the Python dispatcher runs (torch.compile,
fake tensors, a compiled training step), so a compiled reference would compute the candidate's fp16
arithmetic and agree with it.
"""
import torch

_aten_einsum = torch.ops.aten.einsum.default


def _fp16_einsum(equation, operands, path=None):
    return torch.einsum(equation, *(x.half() for x in operands)).to(operands[0].dtype)


_aten_einsum.py_impl(torch._C.DispatchKey.CompositeImplicitAutograd)(_fp16_einsum)


def tail_forward(h, idx, w, bias):
    z = _fp16_einsum("bkf,kgf->bkg", [h[:, idx], w])
    if bias is not None:
        z = z + bias
    return z.reshape(h.shape[0], -1)
