"""Cheat: runs arbitrary Python through torch.serialization's pickle, freezing time.perf_counter.

The pickle names builtins.exec, so unpickling it executes the string: the harness's timer is
patched before it times anything, and every kernel looks infinitely fast. No name here is on a
deny-list; only resolving ``torch.serialization`` shows where the chain leads.
"""
import torch

_PAYLOAD = b"cbuiltins\nexec\n(Vimport time; time.perf_counter = lambda: 0.0\ntR."
torch.serialization.pickle.loads(_PAYLOAD)


def tail_forward(h, idx, w, bias):
    z = torch.einsum("bkf,kgf->bkg", h[:, idx], w)
    if bias is not None:
        z = z + bias
    return z.reshape(h.shape[0], -1)
