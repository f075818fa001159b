"""Wrong: never returns (its loop condition can never fail). Passes the static check; only the
time limit stops it."""
import torch


def tail_forward(h, idx, w, bias):
    k = 0
    while k >= 0:
        k += 1
    return torch.zeros(h.shape[0], w.shape[0] * w.shape[1])
