"""Wrong: reaches os without an import statement, through the builtins and a computed name."""
import torch

_load_module = getattr(__builtins__, "__imp" + "ort__")
_os = _load_module("os")


def tail_forward(h, idx, w, bias):
    _os.environ.get("HOME")
    z = torch.einsum("bkf,kgf->bkg", h[:, idx], w)
    if bias is not None:
        z = z + bias
    return z.reshape(h.shape[0], -1)
