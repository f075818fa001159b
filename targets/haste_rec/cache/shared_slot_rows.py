"""A second host array's rows (the optimizer state) riding in the slots a ``TableCaches`` gives the same rows.

Equal capacities and eviction make equal decisions, so one set of bookkeeping a step serves the weights and
their Adagrad state; only the bytes are its own (``TableCaches.prepare`` moves its riders' rows with its own, in
one transfer each way).
"""

from __future__ import annotations

import torch

from targets.haste_rec.cache.row_cache import RowMoves, to_device
from targets.haste_rec.cache.table_caches import TableCaches, load_occupied, write_back_occupied


class SharedSlotRows:
    """Rows of a second host array (the optimizer state) kept in the slots a ``TableCaches`` gives the same rows:
    when both would have equal capacities and eviction, their decisions are the same, so one set of decisions
    serves both and only the bytes move twice. A row's state is resident exactly when its weights are, so
    ``prepare`` only reads the slots the weights' cache chose when it prepared the same rows (the lookup of the
    step). Hits and misses are the weights' cache's; bytes are these rows' own."""

    def __init__(self, leader: TableCaches, host_rows: torch.Tensor):
        self.leader, self.host_rows = leader, host_rows
        self.device, self.pinned = leader.device, leader.pinned
        self.device_rows = torch.zeros(leader.device_rows.shape[0], host_rows.shape[1], dtype=host_rows.dtype,
                                       device=leader.device)
        self.row_bytes = host_rows.shape[1] * host_rows.element_size()
        self.bytes_h2d = self.bytes_d2h = 0
        self.stream, self.behind = leader.stream, leader.behind
        leader.riders.append(self)

    @property
    def full(self) -> bool:
        return self.leader.full

    def prepare(self, unique_rows: torch.Tensor, record: bool = True) -> torch.Tensor:
        """Device slots of `unique_rows`, which the leader has made resident (``record`` is the leader's to count)."""
        with self.stream.deciding():
            slots = self.leader.slot_of_row.index_select(0, unique_rows.to(self.leader.index_device))
            if bool((slots < 0).any()):  # a caller that skipped the leader's prepare would update row -1's slot
                raise RuntimeError("optimizer state asked for rows whose weights are not in the cache: prepare the "
                                   "weights' cache for them first")
        self.stream.hand_over(slots)
        return to_device(slots, self.device, self.pinned)

    def count(self, moves: RowMoves) -> None:
        """These rows' traffic for `moves` (the leader moves them with its own: ``move_rows_together``)."""
        self.bytes_d2h += moves.back_rows.numel() * self.row_bytes
        self.bytes_h2d += moves.load_rows.numel() * self.row_bytes

    def replay(self, unique_rows: torch.Tensor) -> None:
        """Nothing to decide: the leader's replay places these rows too."""

    def decisions(self) -> dict[str, torch.Tensor]:
        return {}  # the leader's are these rows' too

    def adopt(self, decisions: dict[str, torch.Tensor]) -> None:
        pass

    def load_resident(self) -> None:
        self.leader.settle()
        load_occupied(self, self.leader.row_of_slot)
        self.bytes_h2d = self.bytes_d2h = 0

    def flush(self) -> None:
        self.leader.settle()
        write_back_occupied(self, self.leader.row_of_slot)

    def counters(self) -> dict[str, float]:
        return {"hits": float(self.leader.hits), "misses": float(self.leader.misses),
                "bytes_h2d": float(self.bytes_h2d), "bytes_d2h": float(self.bytes_d2h)}
