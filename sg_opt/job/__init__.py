"""The job adapter: a plain PyTorch training job (model, optimizer, data, loss) as a Target sg-opt tunes with
generic knobs it applies itself. ``from sg_opt import TorchJob``."""

from sg_opt.job.spec import TorchJob
from targets.tuning import QualityMetric

__all__ = ["QualityMetric", "TorchJob"]
