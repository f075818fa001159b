"""Wrong: multiplies through logarithms, which are NaN for negative operands."""
import torch


def tail_forward(h, idx, w, bias):
    logs = torch.log(h[:, idx])[:, :, None, :] + torch.log(w)[None]  # [B, K, G, F]
    z = torch.exp(logs).sum(-1)
    if bias is not None:
        z = z + bias
    return z.reshape(h.shape[0], -1)
