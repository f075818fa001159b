"""Wrong: allocates the output with torch.empty and, off by one, never writes the last group."""
import torch


def tail_forward(h, idx, w, bias):
    batch = h.shape[0]
    groups, size, _ = w.shape
    z = torch.empty(batch, groups, size, dtype=h.dtype, device=h.device)
    for k in range(groups - 1):
        z[:, k] = h[:, idx[k]] @ w[k].T
        if bias is not None:
            z[:, k] += bias[k]
    return z.reshape(batch, groups * size)
