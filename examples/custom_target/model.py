"""A user's own click-through-rate model, written the way a team writes its first version.

Dense features go through a bottom MLP; each of a few categorical features is looked up in its own
``nn.EmbeddingBag``; a pairwise dot-product *interaction* of all those vectors feeds a top MLP that
predicts a click (BCE). This is DLRM's shape, small enough for a CPU.

The first version builds each batch with a Python loop over samples (``batch_build = "loop"``) and
lets autograd produce dense gradients for the embedding tables (``sparse_embedding_grads = false``):
both are what people write first, and both are real costs sg-opt can find.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from targets.protocol import PhaseTimer, sequence_digest


@dataclass(frozen=True)
class CtrSize:
    batch: int
    dense: int
    tables: tuple[int, ...]  # rows per categorical feature
    dim: int
    ids_per_bag: int


SIZES = {"tiny": CtrSize(batch=256, dense=8, tables=(50_000, 20_000, 5_000, 1_000), dim=16, ids_per_bag=3),
         "small": CtrSize(batch=1024, dense=13, tables=(400_000, 200_000, 50_000, 10_000, 1_000), dim=32,
                          ids_per_bag=4)}


def interaction(vectors: torch.Tensor) -> torch.Tensor:
    """The reference kernel: upper-triangle pairwise dot products of [B, N, D] vectors -> [B, N(N-1)/2]."""
    n = vectors.shape[1]
    dots = torch.bmm(vectors, vectors.transpose(1, 2))
    rows, cols = torch.triu_indices(n, n, offset=1, device=vectors.device)
    return dots[:, rows, cols]


class ClickLog:
    """A fixed synthetic click log: Zipf-popular ids whose hidden weights, with the dense features, set
    the click rate. Batches are read from it in a seeded random order, so both ways of building a batch
    return the very same tensors."""

    EXAMPLES_PER_BATCH = 32  # the log holds this many batches' worth of examples

    def __init__(self, size: CtrSize, seed: int):
        gen = torch.Generator().manual_seed(seed)
        n, k = size.batch * self.EXAMPLES_PER_BATCH, size.ids_per_bag
        self.size, self.gen = size, gen
        self.dense = torch.randn(n, size.dense, generator=gen)
        self.ids = [torch.multinomial(1.0 / torch.arange(1, rows + 1, dtype=torch.float64) ** 1.05, n * k,
                                      replacement=True, generator=gen).view(n, k) for rows in size.tables]
        logit = self.dense @ torch.randn(size.dense, generator=gen) / 3
        for table_ids, rows in zip(self.ids, size.tables):
            logit += torch.randn(rows, generator=gen)[table_ids].mean(dim=1)
        self.clicks = torch.bernoulli(torch.sigmoid(logit), generator=gen)

    def next_rows(self) -> torch.Tensor:
        return torch.randint(0, len(self.clicks), (self.size.batch,), generator=self.gen)

    def batch_loop(self) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
        """The first version: gather one example at a time, then stack."""
        rows = self.next_rows().tolist()
        dense = torch.stack([self.dense[r] for r in rows])
        ids = [torch.stack([table[r] for r in rows]) for table in self.ids]
        return dense, ids, torch.stack([self.clicks[r] for r in rows])

    def batch_vectorized(self) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
        """The same rows gathered for the whole batch at once."""
        rows = self.next_rows()
        return self.dense[rows], [table[rows] for table in self.ids], self.clicks[rows]


class CtrModel(nn.Module):
    def __init__(self, size: CtrSize, sparse_grads: bool, interact):
        super().__init__()
        self.bottom = nn.Sequential(nn.Linear(size.dense, 64), nn.ReLU(), nn.Linear(64, size.dim))
        self.tables = nn.ModuleList(nn.EmbeddingBag(rows, size.dim, mode="sum", sparse=sparse_grads)
                                    for rows in size.tables)
        pairs = (len(size.tables) + 1) * len(size.tables) // 2
        self.top = nn.Sequential(nn.Linear(pairs + size.dim, 64), nn.ReLU(), nn.Linear(64, 1))
        self.interact = interact

    def forward(self, dense: torch.Tensor, ids: list[torch.Tensor]) -> torch.Tensor:
        x = self.bottom(dense)
        vectors = torch.stack([x] + [table(i) for table, i in zip(self.tables, ids)], dim=1)
        return self.top(torch.cat([x, self.interact(vectors)], dim=1)).squeeze(1)


class CtrSession:
    """One configuration of the model, ready to train (the ``targets.protocol.Session`` contract)."""

    phase_names = ("data", "forward", "backward", "optimizer")

    def __init__(self, config, size_name: str, kernels, device: torch.device, seed: int):
        size = SIZES[size_name]
        torch.manual_seed(seed)
        self.device, self.batch_size, self.timer = device, size.batch, PhaseTimer(device)
        self.data = ClickLog(size, seed)
        self.build_batch = self.data.batch_loop if config["batch_build"] == "loop" else self.data.batch_vectorized
        self.model = CtrModel(size, config["sparse_embedding_grads"], kernels.get("interaction", interaction)).to(device)
        self.dense_params = [p for n, p in self.model.named_parameters() if not n.startswith("tables")]
        self.opt = torch.optim.SGD(self.model.parameters(), lr=config["learning_rate"])
        self.probe_batch = ClickLog(size, seed + 1).batch_vectorized()
        self.record_grad_norms, self._norms = False, {}

    def step(self) -> torch.Tensor:
        with self.timer("data"):
            dense, ids, click = self.build_batch()
            dense, ids, click = dense.to(self.device), [i.to(self.device) for i in ids], click.to(self.device)
        with self.timer("forward"):
            loss = nn.functional.binary_cross_entropy_with_logits(self.model(dense, ids), click)
        with self.timer("backward"):
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
        if self.record_grad_norms:
            self._norms = {"dense": float(torch.linalg.vector_norm(torch.stack(
                [p.grad.norm() for p in self.dense_params])))}
        with self.timer("optimizer"):
            self.opt.step()
        return loss.detach()

    def probe(self) -> dict[str, list[float]]:
        dense, ids, _ = self.probe_batch
        with torch.no_grad():
            return {"logits": self.model(dense.to(self.device), [i.to(self.device) for i in ids])[:64].tolist()}

    def grad_norms(self) -> dict[str, float]:
        return dict(self._norms)

    def param_digest(self) -> dict:
        params = list(self.model.parameters())
        return {"sha256": sequence_digest(params),
                "norms": {name: float(p.detach().norm()) for name, p in self.model.named_parameters()}}

    def quality(self) -> dict[str, float]:
        dense, ids, click = self.probe_batch
        with torch.no_grad():
            loss = nn.functional.binary_cross_entropy_with_logits(
                self.model(dense.to(self.device), [i.to(self.device) for i in ids]), click.to(self.device))
        return {"logloss": float(loss)}

    def counters(self) -> dict[str, float]:
        return {}
