"""Wrong: memoises the first output for each input shape and returns it for any later inputs."""
import torch

_results = {}


def tail_forward(h, idx, w, bias):
    key = (tuple(h.shape), tuple(w.shape), bias is None)
    if key not in _results:
        z = torch.einsum("bkf,kgf->bkg", h[:, idx], w)
        if bias is not None:
            z = z + bias
        _results[key] = z.reshape(h.shape[0], -1)
    return _results[key]
