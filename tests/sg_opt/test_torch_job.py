"""The job adapter: a plain PyTorch job as a Target, its knob space from what it learns about the job, and each
generic knob keeping the numerics class it declares."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import sg_opt
from sg_opt import QualityMetric, TorchJob
from targets.protocol import ConfigError, Session
from targets.registry import resolve_target
from validators.numerics import compare
from targets.worker import run_numerics
from targets.worker_protocol import NumericsData, WorkerRequest

ROWS = (300, 120, 40)


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.tables = nn.ModuleList(nn.EmbeddingBag(rows, 4, mode="sum") for rows in ROWS)
        self.head = nn.Sequential(nn.Linear(4 * len(ROWS) + 3, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, dense, ids):
        pooled = [table(ids[:, t]) for t, table in enumerate(self.tables)]
        return self.head(torch.cat([dense, *pooled], dim=1)).squeeze(1)


def tiny_data(split: str) -> TensorDataset:
    gen = torch.Generator().manual_seed(0 if split == "train" else 1)
    n = 512
    ids = torch.stack([torch.randint(0, rows, (n, 2), generator=gen) for rows in ROWS], dim=1)
    return TensorDataset(torch.randn(n, 3, generator=gen), ids, torch.randint(0, 2, (n,), generator=gen).float())


def bce(logits, batch):
    return F.binary_cross_entropy_with_logits(logits, batch[-1])


def tiny_job(optimizer=lambda params: torch.optim.Adam(params, lr=1e-2), **more) -> TorchJob:
    return TorchJob(**{"model": Tiny, "optimizer": optimizer, "data": tiny_data, "loss": bce, "batch_size": 32,
                       "name": "tiny-job", "heldout_batches": 2, **more})


JOB = tiny_job()
TARGET = JOB.target()


def numerics(config: dict, steps: int = 6, target=TARGET) -> NumericsData:
    session = target.build(target.knob_space.resolve(config), "default", {}, "cpu", 0)
    return run_numerics(session, WorkerRequest(target=target.name, size="default", mode="numerics", steps=steps))


def test_the_public_api_and_the_target_it_makes():
    assert sg_opt.TorchJob is TorchJob
    space = TARGET.knob_space
    assert space["sparse_embedding_grads"].numerics == "model"  # SparseAdam is not Adam
    assert space["optimizer_impl"].choices == ("default", "for-loop", "foreach", "fused")
    assert space["data_workers"].numerics == space["metrics_every"].numerics == "exact"
    assert space["embedding_fusion"].is_active(space.resolve({"sparse_embedding_grads": True}))
    assert TARGET.quality_metrics == (QualityMetric("heldout_loss", "lower", 0.01),)
    session = TARGET.build(space.resolve({}), "default", {}, "cpu", 0)
    assert isinstance(session, Session) and session.phase_names == TARGET.phases
    assert set(session.quality()) == {"heldout_loss"}


def test_sparse_gradients_keep_the_math_of_plain_sgd_and_adagrad():
    sgd = tiny_job(lambda params: torch.optim.SGD(params, lr=0.1)).target().knob_space
    adagrad = tiny_job(lambda params: torch.optim.Adagrad(params, lr=0.1)).target().knob_space
    momentum = tiny_job(lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)).target().knob_space
    assert sgd["sparse_embedding_grads"].numerics == adagrad["sparse_embedding_grads"].numerics == "reorder"
    assert "sparse_embedding_grads" not in {k.name for k in momentum}  # no sparse optimizer of its math
    plain = TorchJob(model=lambda: nn.Linear(3, 1), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                     data=lambda split: TensorDataset(torch.randn(64, 3), torch.randn(64, 1)),
                     loss=lambda out, batch: F.mse_loss(out, batch[-1]), batch_size=8).target()
    assert not {"sparse_embedding_grads", "embedding_fusion"} & {k.name for k in plain.knob_space}


@pytest.mark.parametrize("config,numerics_class", [
    ({"data_workers": 1}, "exact"),
    ({"metrics_every": 10}, "exact"),
    ({"optimizer_impl": "foreach"}, "reorder"),
    ({"optimizer_impl": "fused"}, "reorder"),
])
def test_each_knob_keeps_its_numerics_class(config, numerics_class):
    verdict = compare(numerics({}), numerics(config), numerics_class)
    assert verdict.ok, verdict.detail


def test_sparse_gradients_under_sgd_and_fused_tables_keep_the_numerics():
    sgd = tiny_job(lambda params: torch.optim.SGD(params, lr=0.1)).target()
    dense = numerics({}, target=sgd)
    assert compare(dense, numerics({"sparse_embedding_grads": True}, target=sgd), "reorder").ok
    fused = numerics({"sparse_embedding_grads": True, "embedding_fusion": True}, target=sgd)
    assert compare(dense, fused, "reorder").ok
    assert set(fused.digest["norms"]) == set(dense.digest["norms"])  # the fused table read back per bag


def test_sparse_adam_is_another_model_and_trains():
    adam = numerics({"sparse_embedding_grads": True}, steps=12)
    assert not compare(numerics({}, steps=12), adam, "reorder").ok
    assert adam.losses[-1] < adam.losses[0]


def test_deferred_metrics_log_the_same_losses():
    logged: dict[int, list[tuple[int, float]]] = {1: [], 10: []}
    for every in logged:
        job = tiny_job(log=lambda step, loss, every=every: logged[every].append((step, loss)))
        session = job.target().build(job.target().knob_space.resolve({"metrics_every": every}), "default", {},
                                     "cpu", 0)
        for _ in range(20):
            session.step()
    assert logged[1] == logged[10] and [step for step, _ in logged[1]] == list(range(20))


def test_cuda_only_and_unknown_sizes_are_one_sentence():
    with pytest.raises(ConfigError, match="CUDA"):
        TARGET.build(TARGET.knob_space.resolve({"cuda_graphs": True}), "default", {}, "cpu", 0)
    sized = tiny_job(sizes={"one": None}, model=lambda size: Tiny(), data=lambda size, split: tiny_data(split))
    with pytest.raises(ConfigError, match="no size"):
        sized.build_model("two")


def test_a_job_is_a_target_by_module_attr():
    assert resolve_target("tests.sg_opt.test_torch_job:JOB") is TARGET
