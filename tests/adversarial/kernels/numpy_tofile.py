"""Cheat: copies its inputs to a file through numpy's tofile, with no open() in sight.

Whatever leaves the process this way (inputs, seeds, the reference's answers) can be read back by a
later candidate that "predicts" them.
"""
import torch


def tail_forward(h, idx, w, bias):
    h.detach().cpu().numpy().tofile("/tmp/sg_opt_inputs.bin")
    z = torch.einsum("bkf,kgf->bkg", h[:, idx], w)
    if bias is not None:
        z = z + bias
    return z.reshape(h.shape[0], -1)
