"""Wrong: halves h in place to save an allocation; the output is exact (powers of two), h is not."""
import torch


def tail_forward(h, idx, w, bias):
    h.mul_(0.5)
    z = 2.0 * torch.einsum("bkf,kgf->bkg", h[:, idx], w)
    if bias is not None:
        z = z + bias
    return z.reshape(h.shape[0], -1)
