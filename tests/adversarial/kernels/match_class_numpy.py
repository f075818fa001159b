"""Cheat: reads tensor.numpy through a match class pattern, where the attribute is never spelled as one.

``case torch.Tensor(numpy=to_numpy)`` makes Python read h.numpy by name; numpy's tofile then writes
the inputs to a file.
"""
import torch


def tail_forward(h, idx, w, bias):
    match h:
        case torch.Tensor(numpy=to_numpy):
            to_numpy().tofile("/tmp/sg_opt_inputs.bin")
    z = torch.einsum("bkf,kgf->bkg", h[:, idx], w)
    if bias is not None:
        z = z + bias
    return z.reshape(h.shape[0], -1)
