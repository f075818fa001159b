"""Wrong: writes every call into one cached output buffer per shape, so an earlier result changes."""
import torch

_buffers = {}


def tail_forward(h, idx, w, bias):
    batch = h.shape[0]
    groups, size, _ = w.shape
    key = (batch, groups, size, h.dtype, h.device)
    if key not in _buffers:
        _buffers[key] = torch.empty(batch, groups, size, dtype=h.dtype, device=h.device)
    out = _buffers[key]
    out.copy_(torch.einsum("bkf,kgf->bkg", h[:, idx], w))
    if bias is not None:
        out += bias
    return out.reshape(batch, -1)
