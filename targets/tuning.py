"""What a target may tell sg-opt about tuning itself: its own rules, its headroom model, its quality metrics.

The core keeps generic rules keyed on the job adapter's knobs and generic headroom per finding category; a target
that knows better (the bundled trainer knows which of its backends are already fused) adds its own through the
Target protocol. These records cross no process boundary: they are code, imported where the target is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

Direction = Literal["higher", "lower"]


@dataclass(frozen=True)
class Rule:
    """A knob patch known to attack some kind of bottleneck (``triggers``: finding categories).

    ``plausibility`` is the share of the finding's Amdahl gain the patch can be expected to realise. A rule whose
    knobs a target lacks is skipped, and so is one whose ``requires`` the resolved incumbent does not meet.
    """

    name: str
    triggers: tuple[str, ...]
    patch: Mapping[str, Any]
    plausibility: float
    why: str
    devices: tuple[str, ...] = ("cpu", "cuda")
    requires: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)  # incumbent knob -> allowed values
    # The phases whose host work the change cuts: triggered by a launch/host-bound finding, the rule expects only
    # those phases' share of the host's work to go (empty: all of it).
    host_phases: tuple[str, ...] = ()
    # Kernels or precision only: the change shortens device time alone, so from a phase's finding it expects only
    # the phase's device share of its wall time (``Finding.device_fraction``).
    device_only: bool = False


@dataclass(frozen=True)
class Headroom:
    """A plausible speedup of one part of the step, the reason for it, and (for a target's own findings) the
    cause in words, which opens the finding's evidence."""

    value: float
    basis: str
    cause: str = ""


@dataclass(frozen=True)
class QualityMetric:
    """A held-out quality metric a model change is judged by: which way is better, and how much worse than the
    baseline's (absolute) a model change may leave it and still be accepted."""

    name: str
    direction: Direction = "higher"
    band: float = 0.01

    def __post_init__(self) -> None:
        if self.direction not in ("higher", "lower"):
            raise ValueError(f"quality metric {self.name}: direction must be higher or lower, not {self.direction!r}")
        if self.band < 0:
            raise ValueError(f"quality metric {self.name}: its band must not be negative")

    def loss(self, baseline: float, candidate: float) -> float:
        """How much worse the candidate is than the baseline (negative: better)."""
        return baseline - candidate if self.direction == "higher" else candidate - baseline

    def describe(self) -> str:
        return f"{self.name} ({self.direction} is better, band {self.band:g})"
