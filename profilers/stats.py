"""Order statistics shared by every timing summary (torch-free, so the CLI imports it cheaply)."""

from __future__ import annotations

from typing import Sequence


def quantile(values: Sequence[float], q: float) -> float:
    """The nearest-rank q-quantile of values (q in [0, 1]): an observed value, never interpolated."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]
