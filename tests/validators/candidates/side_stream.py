"""Wrong (CUDA only): computes on a side stream and returns without making the caller's stream wait.

The side stream waits for the caller's inputs, burns about 0.1 s so the race is reliable, then
writes the output; the missing ``caller.wait_stream(side)`` means a read on the caller's stream
can see the output before it is written.
"""
import torch


def tail_forward(h, idx, w, bias):
    caller = torch.cuda.current_stream(h.device)
    side = torch.cuda.Stream(h.device)
    side.wait_stream(caller)
    batch = h.shape[0]
    groups, size, _ = w.shape
    z = torch.empty(batch, groups, size, dtype=h.dtype, device=h.device)
    with torch.cuda.stream(side):
        burn = torch.ones(4096, 4096, device=h.device)
        for _ in range(40):
            burn = torch.tanh(burn @ burn)
        z.copy_(torch.einsum("bkf,kgf->bkg", h[:, idx], w))
        if bias is not None:
            z += bias
    return z.reshape(batch, -1)
