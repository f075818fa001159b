"""The least work each phase of a haste_rec step must do: the FLOP/byte model behind its floor.

The floor belongs to the computation, not to an implementation: it depends on the model's shapes,
the precision (bytes per element and which matmul ceiling applies) and where the tables live (bus
bytes), never on how a kernel happens to do it. So it counts what any correct implementation must
touch once: the rows a batch looks up, each weight read for the forward and again for the
backward, each gradient written once and read once by its optimizer, optimizer state read and
written once. It does not count what a fused implementation avoids: the logits (a fused loss never
writes them), a table-sized dense gradient (a row-wise update touches only the rows used), or
intermediate copies. Host<->device bytes are a batch's own bytes plus the embedding store's measured
traffic per step (`bus_bytes_per_step`: cache misses, write-backs, host rows or pooled vectors); the
latter is zero for device-resident tables.

Shapes are read off the built session (the real head size, groups and a real batch's ids), so the
model follows the knobs that change them.
"""

from __future__ import annotations

import torch

from targets.protocol import PhaseWork

INDEX_BYTES = 8  # int64 ids, offsets and fan-in indices
ROW_DTYPE_BYTES = 4  # tables and their Adagrad state are fp32 in every mode


def _batch_bus_bytes(batch) -> float:
    """Bytes of one batch as it crosses to the device: ids, offsets, dense features, labels."""
    tensors = [*batch.ids, *batch.offsets, batch.dense, batch.labels, batch.label_offsets]
    return float(sum(t.numel() * t.element_size() for t in tensors))


def step_work(session, bus_bytes_per_step: float = 0.0) -> dict[str, PhaseWork]:
    """Per phase of one training step of `session`, the least FLOPs and bytes (see the module doc);
    `bus_bytes_per_step` is the embedding store's measured host<->device traffic."""
    size, model, precision = session.size, session.model, session.config["precision"]
    act = 2 if precision in ("bf16", "bf16-autocast") else 4       # bytes per activation element
    par = 2 if precision == "bf16" else 4                          # bytes per dense parameter element
    dtype = "bfloat16" if act == 2 else "float32"
    batch = session.data.train_batch(0)
    B, D, T = batch.batch_size, size.embedding_dim, size.num_tables
    looked_up = sum(ids.numel() for ids in batch.ids)
    unique_rows = sum(int(torch.unique(ids).numel()) for ids in batch.ids)
    in_dim = T * D + size.num_dense
    E, H = size.encoder_hidden, size.hidden
    out = model.output
    n_head = out.n_head
    K, G, Fi = out.tail_weight.shape
    enc_params = in_dim * E + E + E * H + H
    head_params = n_head * H + n_head
    tail_params = K * G * Fi + (K * G if out.tail_bias is not None else 0)
    dense_params = enc_params + head_params + tail_params
    enc_flops = 2 * B * (in_dim * E + E * H)
    head_flops = 2 * B * H * n_head
    tail_flops = 2 * B * K * G * Fi
    activations = B * (in_dim + E + H)
    row_bytes = D * ROW_DTYPE_BYTES
    return {
        "data": PhaseWork(bus_bytes=_batch_bus_bytes(batch)),
        "embed": PhaseWork(bytes=looked_up * row_bytes + B * T * row_bytes,
                           bus_bytes=bus_bytes_per_step),
        "encoder": PhaseWork(flops=enc_flops, bytes=par * enc_params + act * activations, dtype=dtype),
        "head": PhaseWork(flops=head_flops, bytes=par * head_params + act * B * H, dtype=dtype),
        "tail": PhaseWork(flops=tail_flops, bytes=par * tail_params + INDEX_BYTES * K * Fi + act * B * H,
                          dtype=dtype),
        "loss": PhaseWork(),
        # dX and dW of every dense layer; weights read again, gradients written once, activations read
        # and their gradients written, the pooled gradient scattered to the rows looked up.
        "backward": PhaseWork(flops=2 * (enc_flops + head_flops + tail_flops),
                              bytes=2 * par * dense_params + 2 * act * activations + looked_up * row_bytes,
                              dtype=dtype),
        # Adam (p, g, m, v read; p, m, v written), SGD with momentum (p, g, m read; p, m written),
        # row-wise Adagrad over the rows used (row and its gradient read, row written, state r/w).
        "optimizer": PhaseWork(bytes=7 * par * enc_params + 5 * par * (head_params + tail_params)
                               + unique_rows * (3 * row_bytes + 2 * ROW_DTYPE_BYTES)),
    }
