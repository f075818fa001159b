"""Wrong: correct only for the slot's published shapes; anything else gets zeros."""
import torch

KNOWN = {(64, 96, 50, 7, 13), (1000, 300, 1111, 24, 37), (512, 512, 20940, 32, 64)}


def tail_forward(h, idx, w, bias):
    batch, dims = h.shape
    groups, size, fan_in = w.shape
    if (batch, dims, groups, size, fan_in) not in KNOWN:
        return torch.zeros(batch, groups * size, dtype=h.dtype, device=h.device)
    z = torch.einsum("bkf,kgf->bkg", h[:, idx], w)
    if bias is not None:
        z = z + bias
    return z.reshape(batch, -1)
