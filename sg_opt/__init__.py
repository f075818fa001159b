"""sg-opt: makes sparse-model training faster without changing what it computes, and proves both.

The public API: ``TorchJob`` (a plain PyTorch job as a target sg-opt tunes) and ``QualityMetric`` (how a model
change is judged). Both load on first use, so that ``import sg_opt`` in a worker pulls in no more than it needs.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["QualityMetric", "TorchJob"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        import sg_opt.job

        return getattr(sg_opt.job, name)
    raise AttributeError(f"module 'sg_opt' has no attribute {name!r}")
