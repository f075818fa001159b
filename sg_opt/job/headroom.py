"""The adapter's headroom model (``Target.headroom``): how much of a phase its generic knobs can plausibly win,
given the values they have. Categories it does not know take the core's generic figures (``profilers.findings``).
"""

from __future__ import annotations

from typing import Any, Mapping

from targets.protocol import Headroom


def job_headroom(category: str, knobs: Mapping[str, Any]) -> Headroom | None:
    if category == "data-wait":
        if knobs.get("data_workers", 0) == 0 and not knobs.get("prefetch_to_device", False):
            return Headroom(3.5, "batches are built in the training process between steps; loader workers build "
                                 "them while the step runs")
        return Headroom(1.5, "loading already overlaps the step; what is left is the copy and the hand-over")
    if category == "optimizer":
        if knobs.get("optimizer_impl") in ("default", "for-loop"):
            return Headroom(3.0, "a loop of elementwise ops per parameter, one pass over the optimizer state each; "
                                 "a fused update makes one")
        if knobs.get("sparse_embedding_grads") is False:
            return Headroom(3.0, "every table row is updated every step; sparse gradients update the looked-up rows")
        return Headroom(1.3, "the update is already batched and sparse where it can be")
    return None
