"""How long the machine made tasks wait during each timed block: the kernel's pressure stall information (PSI).

In the 2026-12-04 `large-cached` run on an H200 both sides of an A/A calibration slowed together for a few blocks
(from about 47 to 68-152 ms, then back), and a measurement's incumbent ran 79-221 ms a block where its
calibration had put it at 47.7: something outside the two workers held the machine, and the measurement files could not say what.
Linux counts, per resource, the time in which at least one task was stalled waiting for it
(``/proc/pressure/{cpu,memory,io}``, the "some" line's ``total`` in microseconds); its growth over a block, over
the block's wall time, is the share of the block lost to waiting. Memory pressure means reclaim or thrashing (too
many workers for the host's memory), io means page-cache writeback or reads in the way, cpu means more runnable
threads than cores (our own trainer's thread team counts too, so cpu says least on its own). A kernel without
PSI (``psi=0``, or a container that hides it) gives None, and nothing else changes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

PSI_DIR = Path("/proc/pressure")
RESOURCES = ("cpu", "memory", "io")
NOTABLE_SHARE = 0.05  # a resource that stalled tasks for this share of some block is worth a sentence


def stall_totals(psi_dir: Path = PSI_DIR) -> dict[str, int] | None:
    """Microseconds since boot in which some task waited on each resource; None where the kernel keeps no count."""
    totals = {}
    for resource in RESOURCES:
        try:
            text = (psi_dir / resource).read_text()
        except OSError:
            return None
        for line in text.splitlines():
            if line.startswith("some ") and "total=" in line:
                totals[resource] = int(line.rsplit("total=", 1)[1])
        if resource not in totals:
            return None
    return totals


def stall_shares(before: Mapping[str, int] | None, after: Mapping[str, int] | None,
                 seconds: float) -> dict[str, float] | None:
    """Each resource's stall time between two ``stall_totals`` over `seconds` of wall time (0: no task waited; 1:
    some task waited throughout); None when either count is missing."""
    if before is None or after is None or seconds <= 0:
        return None
    return {r: max(0.0, (after[r] - before[r]) / 1e6 / seconds) for r in RESOURCES if r in before and r in after}


def pressure_note(blocks: Sequence[Mapping[str, float] | None]) -> str | None:
    """A sentence naming the resources that stalled tasks for at least NOTABLE_SHARE of some block, with the
    largest share and how many blocks reached it; None when none did or nothing was counted."""
    said = []
    counted = [b for b in blocks if b]
    for resource in RESOURCES:
        shares = [b.get(resource, 0.0) for b in counted]
        high = [s for s in shares if s >= NOTABLE_SHARE]
        if high:
            said.append(f"{resource} {max(high):.0%} of a block at most ({len(high)} of {len(shares)} blocks over "
                        f"{NOTABLE_SHARE:.0%})")
    return "the machine stalled tasks waiting for " + ", ".join(said) if said else None
