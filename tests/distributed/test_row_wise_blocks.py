"""Row-wise sharding's local parts, in one process: each rank's store of row blocks starts as the
single-process store's rows, and the input dist splits every bag by row owner with block-local ids.

The collectives themselves run in test_sharded_training.py (torchrun, real gloo ranks); here nothing
is exchanged, so the blocks (an empty one included) are checked directly.
"""

import pytest
import torch

from targets.haste_rec.data.batch import Batch
from targets.haste_rec.distributed.exchange import RowWiseInputDist
from targets.haste_rec.distributed.plan import ShardingPlan
from targets.haste_rec.distributed.sharded_embeddings import RowWiseEmbeddings
from targets.haste_rec.embeddings.embedding_config import EmbeddingConfig
from targets.haste_rec.embeddings.embeddings import EmbeddingStore
from targets.protocol import ConfigError

CPU = torch.device("cpu")
TABLE_ROWS = (7, 2, 5)  # on 3 ranks: blocks of 3, 1 and 2 rows; table 1 has none on rank 2
DIM = 4
ACCESS_COUNTS = [torch.arange(rows) for rows in TABLE_ROWS]


def rank_embeddings(plan: ShardingPlan, rank: int, cfg: EmbeddingConfig) -> RowWiseEmbeddings:
    """A rank's row-wise embeddings without a process group (building them exchanges nothing)."""
    return RowWiseEmbeddings(plan, rank, TABLE_ROWS, DIM, cfg, CPU, seed=3, group=None, weighted=False,
                             access_counts=ACCESS_COUNTS, max_unique_per_batch=[1, 1, 1])


@pytest.mark.parametrize("world_size,placement,grad_mode,blocks", [
    (3, "device", "dense", [(3, 1, 2), (3, 1, 2), (1, 0, 1)]),
    (3, "host", "sparse", [(3, 1, 2), (3, 1, 2), (1, 0, 1)]),
    (2, "cached", "fused", [(4, 1, 3), (3, 1, 2)]),  # cached needs every block non-empty: 2 ranks
])
def test_every_rank_holds_its_blocks_as_the_single_process_store_draws_them(world_size, placement, grad_mode, blocks):
    cfg = EmbeddingConfig(placement=placement, grad_mode=grad_mode, cache_plan="planned", cache_fraction=0.5)
    plan = ShardingPlan(world_size=world_size, num_tables=len(TABLE_ROWS), embedding_sharding="row-wise")
    stores = [rank_embeddings(plan, rank, cfg).store for rank in range(world_size)]
    assert [s.layout.table_rows for s in stores] == blocks
    whole = EmbeddingStore(TABLE_ROWS, DIM, cfg, CPU, seed=3, access_counts=ACCESS_COUNTS).full_tables()
    for t, table in enumerate(whole):
        assert torch.equal(torch.cat([s.full_tables()[t] for s in stores]), table)
    if placement == "cached":  # planned on each block's own access counts: half of each block, at least one row
        assert [s.cache_rows for s in stores] == [[2, 1, 2], [2, 1, 1]]


def test_an_empty_block_under_placement_cached_is_a_config_error():
    plan = ShardingPlan(world_size=3, num_tables=len(TABLE_ROWS), embedding_sharding="row-wise")
    for rank in range(3):  # every rank, so that none waits on a peer that stopped
        with pytest.raises(ConfigError, match="leaves rank 2 none of table 1"):
            rank_embeddings(plan, rank, EmbeddingConfig(placement="cached", grad_mode="fused"))


def test_an_empty_block_pools_zeros_and_takes_its_gradient():
    plan = ShardingPlan(world_size=3, num_tables=len(TABLE_ROWS), embedding_sharding="row-wise")
    store = rank_embeddings(plan, 2, EmbeddingConfig()).store  # rows 6 of table 0, none of 1, 4 of 2
    empty = torch.zeros(0, dtype=torch.int64)
    bags = Batch(ids=[torch.tensor([0, 0]), empty, torch.tensor([0])],
                 offsets=[torch.tensor([0, 1]), torch.tensor([0, 0]), torch.tensor([0, 1])],
                 weights=[None] * 3, dense=torch.zeros(2, 0), labels=empty,
                 label_offsets=torch.zeros(3, dtype=torch.int64))
    pooled = store(bags)
    assert torch.equal(pooled[:, DIM:2 * DIM], torch.zeros(2, DIM))
    pooled.sum().backward()
    store.optimizer_step()
    assert store.grad_sq_norm() == pytest.approx((2 ** 2 + 1) * DIM)  # row 6 in both bags, row 4 in one


def test_bags_are_split_by_row_owner_with_block_local_ids_in_bag_order():
    plan = ShardingPlan(world_size=3, num_tables=2, embedding_sharding="row-wise")
    dist = RowWiseInputDist(plan, 0, (7, 2), group=None, device=CPU, weighted=True)  # blocks of 3 and 1 rows
    batch = Batch(ids=[torch.tensor([0, 6, 3, 4]), torch.tensor([1, 0, 1])],
                  offsets=[torch.tensor([0, 3]), torch.tensor([0, 1])],
                  weights=[torch.tensor([0.1, 0.2, 0.3, 0.4]), None], dense=torch.zeros(2, 0),
                  labels=torch.zeros(0, dtype=torch.int64), label_offsets=torch.zeros(3, dtype=torch.int64))
    lengths, ids, weights = dist._send_order(batch)
    # per destination rank, [table, sample] lengths: rank 0 gets row 0 of table 0 (sample 0) and of
    # table 1 (sample 1); rank 1 rows 3 and 4 (local 0, 1) and row 1 of table 1 twice; rank 2 row 6
    assert lengths.tolist() == [1, 0, 0, 1] + [1, 1, 1, 1] + [1, 0, 0, 0]
    assert ids.tolist() == [0, 0] + [0, 1, 0, 0] + [0]
    assert weights.tolist() == pytest.approx([0.1, 1.0] + [0.3, 0.4, 1.0, 1.0] + [0.2])  # unweighted: ones
