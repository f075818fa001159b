"""The quality gate of a model change: every metric the target declares, each within its band of the baseline's.

A model change (numerics class ``model``) is meant to compute something else, so no trajectory is compared; what
must hold is the held-out quality the target declares (``targets.tuning.QualityMetric``: name, which direction is
better, how much worse than the baseline's it may be, absolute). A metric missing on either side fails: a model
change that cannot be judged is never accepted.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

from targets.tuning import QualityMetric


def quality_sentences(metrics: Sequence[QualityMetric], baseline: Mapping[str, float] | None,
                      candidate: Mapping[str, float] | None) -> list[tuple[str, float, bool, str]]:
    """Per declared metric: (metric name, how much worse than the baseline, failed, one sentence)."""
    if not metrics:
        return [("quality", math.inf, True, "the target declares no quality metric, so a model change cannot be "
                                            "judged")]
    judged = []
    for metric in metrics:
        missing = next((side for side, values in (("baseline", baseline), ("candidate", candidate))
                        if not values or metric.name not in values), None)
        if missing is not None:
            judged.append((metric.name, math.inf, True, f"quality metric {metric.name} is missing from the {missing}, "
                                                        f"so the model change cannot be judged"))
            continue
        base, cand = float(baseline[metric.name]), float(candidate[metric.name])
        worse = metric.loss(base, cand)
        judged.append((metric.name, worse, worse > metric.band,
                       f"quality {metric.name} is {cand:.4f} against the baseline's {base:.4f} ({metric.direction} is "
                       f"better): {'worse' if worse > 0 else 'no worse'} by {abs(worse):.4f}, band {metric.band:.4f}"))
    return judged
