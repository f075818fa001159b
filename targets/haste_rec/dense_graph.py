"""The dense part of the fused-loss step as CUDA graphs (knob ``dense_cuda_graph``).

At size `large` the tuned step is host-bound: 11.4 ms of host work in a 13.1 ms profiled step against
5.7 ms of device work (an H200, 2026-11-30), most of it launching the small kernels of the encoder, the
head, the fused tail and the losses, forward and backward. Replaying them as CUDA graphs costs one launch
per phase. The kernels and their order are the ones eager mode runs, so the numbers are those of eager
mode up to the library's choice of algorithms under capture (class ``reorder``).

Each phase is one graphed callable (``torch.cuda.make_graphed_callables``): encoder, head, the tail with
its loss, the head's loss. So the profiler still finds each phase's kernels under its name, and backward
replays their backward graphs in reverse order. What depends on the batch's shape stays outside: the
pooled embeddings before the encoder, and the positives (rows and columns, one per label), which enter
as fixed-shape tensors, the tail's [K, B] bitmask and the head's dense 0/1 targets.

A graph holds the addresses it was captured with. HASTE's rewiring changes the tail's slot index in
place, and with it the slot CSR the tail kernel reads (``slot_csr``: new tensors), so the graphs are
captured again after every rewire; the capture keeps the CSR it used alive.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch
from torch import nn

from targets.protocol import ConfigError

WARMUP_ITERS = 3  # eager iterations on a side stream before capture (make_graphed_callables' default)


def check_dense_graph(config: Mapping[str, Any], device: torch.device) -> None:
    """ConfigError unless the dense part of this config can be captured as CUDA graphs (checked before the
    session starts its loader's processes; the tail's group size is checked by ``DenseGraphs``)."""
    if device.type != "cuda":
        raise ConfigError("dense_cuda_graph needs a CUDA device")
    if config["tail_backend"] != "triton-fused-loss":
        raise ConfigError("dense_cuda_graph needs tail_backend triton-fused-loss")
    if config["precision"] == "bf16-autocast" or config["compile_encoder"]:
        raise ConfigError("dense_cuda_graph cannot capture bf16 autocast or a compiled encoder")


@contextlib.contextmanager
def _thread_local_capture() -> Iterator[None]:
    """make_graphed_callables captures in CUDA's "global" mode, which forbids other threads' unsafe calls while
    it captures; the loader's pin-memory thread makes them (the pinned allocator queries its events). Its
    captures here use "thread_local" mode: only this thread's stream is captured, and other threads go on.
    (torch.cuda.graph is looked up at call time; make_graphed_callables takes no mode of its own.)"""
    original = torch.cuda.graph
    torch.cuda.graph = functools.partial(original, capture_error_mode="thread_local")
    try:
        yield
    finally:
        torch.cuda.graph = original


class _Part(nn.Module):
    """One phase's forward as a module whose parameters are exactly the ones it reads:
    make_graphed_callables returns gradients for a module's ``parameters()``."""

    def __init__(self, fn: Callable[..., torch.Tensor], params: Iterable[nn.Parameter]):
        super().__init__()
        object.__setattr__(self, "fn", fn)  # a plain attribute, so the owner's other parameters stay out
        for i, p in enumerate(params):
            self.register_parameter(f"p{i}", p)

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.fn(*args)


class DenseGraphs:
    """encoder -> head -> tail + loss -> head loss of a ``HasteRecSession``, replayed as CUDA graphs."""

    def __init__(self, session):
        from targets.haste_rec.tail.triton_fused_bce import resolve_positives_format
        size = session.model.output.group_size
        if resolve_positives_format("auto", size) != "bits":
            raise ConfigError(f"dense_cuda_graph needs the tail's positives as a bitmask (groups of at most 64 "
                              f"labels, not {size})")
        self.session = session
        self.parts: tuple[Callable[..., torch.Tensor], ...] | None = None
        self.index_version: int | None = None
        self.captures = 0
        self._keep: Any = None  # the slot CSR the tail graph reads

    def _modules(self) -> tuple[_Part, _Part, _Part, _Part]:
        s = self.session
        out, batch_size = s.model.output, s.batch_size
        return (
            _Part(lambda pooled, dense: s.encoder(s._encoder_input(pooled, dense)), s.model.encoder.parameters()),
            _Part(out.head_logits, out.head_parameters()),
            _Part(lambda h, bits: out.tail_bce_loss(h, None, None, 1.0 / batch_size, positives=bits),
                  out.tail_parameters()),
            _Part(lambda head, targets: s._head_loss(head, targets, batch_size), ()),
        )

    def _capture(self, pooled: torch.Tensor, dense: torch.Tensor, bits: torch.Tensor,
                 targets: torch.Tensor) -> None:
        from targets.haste_rec.tail.triton_tail_backward import slot_csr
        s = self.session
        out = s.model.output
        self.parts = None  # the old graphs' memory goes before the new ones take theirs
        self._keep = slot_csr(out.tail_index, out.tail_dims)

        def leaf(columns: int) -> torch.Tensor:  # a sample input of its own for each part that takes one
            return torch.zeros(pooled.shape[0], columns, device=pooled.device, dtype=s.compute_dtype,
                               requires_grad=True)
        samples = ((pooled.detach().clone().requires_grad_(pooled.requires_grad), dense.detach().clone()),
                   (leaf(out.hidden),), (leaf(out.hidden), bits.clone()), (leaf(out.n_head), targets.clone()))
        with _thread_local_capture():
            self.parts = tuple(torch.cuda.make_graphed_callables(self._modules(), samples,
                                                                 num_warmup_iters=WARMUP_ITERS,
                                                                 allow_unused_input=True))
        self.index_version = out.tail_index._version
        self.captures += 1

    def loss(self, batch) -> torch.Tensor:
        """The fused-loss step's loss (``HasteRecSession.fused_loss``) through the graphs, each in its phase."""
        from targets.haste_rec.tail.triton_fused_bce import tail_positive_bits
        s = self.session
        phase, out, batch_size = s.timer, s.model.output, batch.batch_size
        with phase("embed"):
            pooled = s.model.embeddings(batch)
        with phase("tail"):
            rows, cols = s._positives(batch)
            groups, size = out.tail_weight.shape[:2]
            bits = tail_positive_bits(rows, cols - out.n_head, groups, size, batch_size)
        with phase("loss"):
            targets = s._head_targets(rows, cols, batch_size)
        if self.parts is None or self.index_version != out.tail_index._version:
            self._capture(pooled, batch.dense, bits, targets)
        encoder, head_part, tail_part, head_loss = self.parts
        with phase("encoder"):
            h = encoder(pooled, batch.dense)
        with phase("head"):
            head = head_part(h)
        with phase("tail"):
            tail = tail_part(h, bits)
        with phase("loss"):
            return head_loss(head, targets) + tail
