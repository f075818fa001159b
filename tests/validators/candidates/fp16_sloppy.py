"""Wrong: computes in fp16 whatever precision it is asked for, then casts back."""
import torch


def tail_forward(h, idx, w, bias):
    z = torch.einsum("bkf,kgf->bkg", h[:, idx].half(), w.half())
    if bias is not None:
        z = z + bias.half()
    return z.reshape(h.shape[0], -1).to(h.dtype)
