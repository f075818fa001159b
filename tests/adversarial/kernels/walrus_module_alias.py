"""Cheat: rebinds torch to a plain local with a walrus, so the chain through it is no longer an import.

``t`` is not an imported name, so ``t.serialization.pickle.loads`` would look like attributes of some
object; the module may not be used as a value at all.
"""
import torch


def tail_forward(h, idx, w, bias):
    if (t := torch) is not None:
        t.serialization.pickle.loads(b"cbuiltins\nprint\n(Vhello\ntR.")
    z = torch.einsum("bkf,kgf->bkg", h[:, idx], w)
    if bias is not None:
        z = z + bias
    return z.reshape(h.shape[0], -1)
