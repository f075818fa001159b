"""A DLRM-style click model written as a team writes its first version, in plain PyTorch.

Dense features go through a bottom MLP; each categorical feature is looked up in its own ``nn.EmbeddingBag``
(dense gradients, the default); the pairwise dot products of all those vectors feed a top MLP that predicts a
click (BCE). Trained with Adam in fp32, batches built by a DataLoader from a map-style dataset, and the loss
printed with ``.item()`` every step (``train`` below): nothing sabotaged, every cost a real one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset


@dataclass(frozen=True)
class DlrmSize:
    tables: tuple[int, ...]  # rows per categorical feature
    dim: int = 16
    dense: int = 13
    ids_per_bag: int = 3
    batch: int = 512
    samples: int = 65_536


SIZES = {"tiny": DlrmSize(tables=(5_000, 2_000, 500, 100), dim=8, batch=128, samples=4_096),
         "small": DlrmSize(tables=(200_000, 100_000, 50_000, 20_000, 10_000, 5_000, 1_000, 500))}


class ClickLog(Dataset):
    """Synthetic clicks: Zipf-popular ids whose hidden weights, with the dense features, set the click rate.
    ``split`` "train" or "heldout": two draws of the same hidden model."""

    def __init__(self, size: DlrmSize, split: str):
        hidden = torch.Generator().manual_seed(0)
        gen = torch.Generator().manual_seed(1 if split == "train" else 2)
        n = size.samples if split == "train" else size.samples // 8
        self.dense = torch.randn(n, size.dense, generator=gen)
        logit = self.dense @ torch.randn(size.dense, generator=hidden) / 4
        ids = []
        for rows in size.tables:
            cdf = torch.cumsum(1.0 / torch.arange(1, rows + 1, dtype=torch.float64) ** 1.05, 0)
            table = torch.searchsorted(cdf / cdf[-1], torch.rand(n, size.ids_per_bag, generator=gen,
                                                               dtype=torch.float64)).clamp_(max=rows - 1)
            logit += torch.randn(rows, generator=hidden)[table].mean(dim=1)
            ids.append(table)
        self.ids = torch.stack(ids, dim=1)  # [n, tables, ids_per_bag]
        self.clicks = torch.bernoulli(torch.sigmoid(logit), generator=gen)

    def __len__(self) -> int:
        return len(self.clicks)

    def __getitem__(self, i: int):
        return self.dense[i], self.ids[i], self.clicks[i]


class Dlrm(nn.Module):
    def __init__(self, size: DlrmSize):
        super().__init__()
        self.bottom = nn.Sequential(nn.Linear(size.dense, 64), nn.ReLU(), nn.Linear(64, size.dim))
        self.tables = nn.ModuleList(nn.EmbeddingBag(rows, size.dim, mode="sum") for rows in size.tables)
        vectors = len(size.tables) + 1
        self.top = nn.Sequential(nn.Linear(vectors * (vectors - 1) // 2 + size.dim, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        x = self.bottom(dense)
        vectors = torch.stack([x] + [table(ids[:, t]) for t, table in enumerate(self.tables)], dim=1)
        dots = torch.bmm(vectors, vectors.transpose(1, 2))
        rows, cols = torch.triu_indices(vectors.shape[1], vectors.shape[1], offset=1, device=dots.device)
        return self.top(torch.cat([x, dots[:, rows, cols]], dim=1)).squeeze(1)


def click_loss(logits: torch.Tensor, batch) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(logits, batch[-1])


def train(size: DlrmSize = SIZES["small"], steps: int = 100, device: str = "cpu") -> None:
    """The job as its team runs it, before sg-opt: what job.py hands over, piece by piece."""
    model = Dlrm(size).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loader = DataLoader(ClickLog(size, "train"), batch_size=size.batch, shuffle=True, drop_last=True)
    for step, (dense, ids, clicks) in zip(range(steps), loader):
        loss = click_loss(model(dense.to(device), ids.to(device)), (clicks.to(device),))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"step {step}: loss {loss.item():.4f}")
