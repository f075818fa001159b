"""Cheat: writes a file without open(), through the io module that torch.nn.modules.module imported.

It leaves a marker the next stage of a pipeline would trust (or overwrites one the harness wrote);
``torch.serialization.io`` and ``torch.storage.io`` lead to the same io.FileIO.
"""
import torch


def tail_forward(h, idx, w, bias):
    with torch.nn.modules.module.io.FileIO("/tmp/sg_opt_verdict.json", "w") as out:
        out.write(b'{"ok": true}')
    z = torch.einsum("bkf,kgf->bkg", h[:, idx], w)
    if bias is not None:
        z = z + bias
    return z.reshape(h.shape[0], -1)
