"""Causes read from the coarse profile: not which phase is slow, but why, in terms a knob can answer.

Each detector looks for the mark a cause leaves in torch.profiler's events, whatever the target:

- dense-embedding-grads: a dense embedding backward op (``aten::embedding_dense_backward``,
  ``aten::_embedding_bag_dense_backward``): every step writes a table-sized gradient and the optimizer reads and
  updates every row of every table. Its share is the optimizer phase's (where the table-sized update runs) plus the
  backward's zeroing and scatter of those gradients.
- unfused-optimizer: an optimizer phase making at least ``UNFUSED_OPS`` op calls a step, none of them fused or
  foreach: one pass over parameters and state per elementwise op.
- host-sync (CUDA): the host blocked on the device outside the data phase (an ``.item()``, a ``.cpu()``, a
  ``.tolist()``): the host cannot queue the next step meanwhile, so the device idles while it catches up.
- unpinned-copies (CUDA): host-to-device copies from pageable memory: staged by the driver, and each waits for
  every kernel queued before it.

Launch-bound steps and idle device gaps are the launch/host-bound finding's (``profilers.findings``): its evidence
says which of the two it is (many launches, or host work between few).
"""

from __future__ import annotations

from dataclasses import dataclass

from profilers.records import CoarseProfile

DENSE_EMBEDDING_BACKWARD = ("aten::embedding_dense_backward", "aten::_embedding_bag_dense_backward")
FUSED_MARKS = ("_fused_", "_foreach_")  # in the name of every fused or foreach optimizer op
UNFUSED_OPS = 20  # op calls a step in the optimizer phase from which an un-fused loop is the likely cause
TOP_NAMED = 3
# Ops that move or allocate rather than compute: left out of the ops an evidence sentence names.
HOUSEKEEPING = ("aten::_to_copy", "aten::copy_", "aten::to", "aten::empty", "aten::empty_strided", "aten::view",
                "aten::as_strided", "aten::detach", "aten::item", "aten::_local_scalar_dense", "aten::resize_")


@dataclass(frozen=True)
class Cause:
    """A cause found in the profile: its finding category, phase, share of the step and the evidence sentence."""

    category: str
    phase: str | None
    share: float
    evidence: str


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def _share(coarse: CoarseProfile, phase: str) -> float:
    timing = coarse.phases.get(phase)
    return timing.share if timing is not None else 0.0


def dense_embedding_grads(coarse: CoarseProfile) -> list[Cause]:
    calls = {op: n for ops in coarse.phase_ops.values() for op, n in ops.items() if op in DENSE_EMBEDDING_BACKWARD}
    if not calls:
        return []
    ops = ", ".join(f"{op} x{n:.0f}" for op, n in sorted(calls.items()))
    optimizer, backward = _share(coarse, "optimizer"), _share(coarse, "backward")
    share = optimizer + backward / 2  # the zeroing and scatter of the table-sized gradients: half the backward, say
    evidence = (f"embedding tables get dense gradients ({ops} a step): every step writes a table-sized gradient and "
                f"the optimizer updates every row; optimizer takes {optimizer:.1%} and backward {backward:.1%} of the "
                f"{_ms(coarse.step_s)} step.")
    return [Cause("dense-embedding-grads", "optimizer", min(1.0, share), evidence)]


def unfused_optimizer(coarse: CoarseProfile) -> list[Cause]:
    ops = coarse.phase_ops.get("optimizer", {})
    calls = sum(ops.values())
    if calls < UNFUSED_OPS or any(mark in op for op in ops for mark in FUSED_MARKS):
        return []
    math = {op: n for op, n in ops.items() if op not in HOUSEKEEPING} or ops
    top = ", ".join(f"{op} x{n:.0f}" for op, n in sorted(math.items(), key=lambda kv: (-kv[1], kv[0]))[:TOP_NAMED])
    share = _share(coarse, "optimizer")
    evidence = (f"the optimizer makes {calls:.0f} op calls a step, none fused or foreach ({top}, ...): one pass over "
                f"parameters and state per elementwise op; optimizer takes {share:.1%} of the {_ms(coarse.step_s)} "
                f"step.")
    return [Cause("unfused-optimizer", "optimizer", share, evidence)]


def host_syncs(coarse: CoarseProfile) -> list[Cause]:
    waits = [w for w in coarse.host_waits if w.phase != "data"]
    if not waits or coarse.step_s <= 0:
        return []
    waited = sum(w.wait_s for w in waits)
    idle = coarse.device_idle_fraction if coarse.device_idle_fraction is not None else 1.0
    share = min(waited / coarse.step_s, idle)
    named = ", ".join(f"{w.op} in {w.phase} x{w.calls:.0f} ({_ms(w.wait_s)})" for w in waits[:TOP_NAMED])
    evidence = (f"the host waits for the device {sum(w.calls for w in waits):.0f} times a step outside data "
                f"({named}): it queues nothing meanwhile, and the device is idle {idle:.1%} of the "
                f"{_ms(coarse.step_s)} step.")
    return [Cause("host-sync", None, share, evidence)]


def unpinned_copies(coarse: CoarseProfile) -> list[Cause]:
    if not coarse.pageable_copy_s or coarse.step_s <= 0:
        return []
    data = coarse.phases.get("data")
    waited = data.host_wait_s if data is not None else 0.0
    share = min(1.0, max(coarse.pageable_copy_s, waited) / coarse.step_s)
    evidence = (f"host-to-device copies from pageable memory take {_ms(coarse.pageable_copy_s)} a step on the device "
                f"and the host waits {_ms(waited)} in data: each is staged by the driver and waits for the kernels "
                f"queued before it.")
    return [Cause("unpinned-copies", "data", share, evidence)]


def causes(coarse: CoarseProfile) -> list[Cause]:
    return (dense_embedding_grads(coarse) + unfused_optimizer(coarse) + host_syncs(coarse)
            + unpinned_copies(coarse))
