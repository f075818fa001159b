"""The DLRM-style job of model.py handed to sg-opt through its job adapter: all the glue it needs.

    sg-opt targets --target examples.dlrm.job:target
    sg-opt optimize --target examples.dlrm.job:target --size small --device cpu --tier offline --max-minutes 10
"""

import torch

from examples.dlrm.model import SIZES, ClickLog, Dlrm, click_loss
from sg_opt import TorchJob

job = TorchJob(
    name="dlrm",
    description="a DLRM-style click model: per-feature EmbeddingBags, Adam, fp32",
    model=Dlrm,
    optimizer=lambda params: torch.optim.Adam(params, lr=1e-3),
    data=ClickLog,
    loss=click_loss,
    batch_size=lambda size: size.batch,
    sizes=SIZES,
    log=lambda step, loss: None,  # where the team printed loss.item() every step
)
target = job.target()
