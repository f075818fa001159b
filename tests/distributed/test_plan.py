"""The sharding plan as configuration: owners, sample slices, and ConfigErrors for what is not built."""

import pytest

from targets.haste_rec.distributed.plan import ShardingPlan, sample_counts, sample_slice
from targets.protocol import ConfigError


def test_tables_go_round_robin_and_every_table_has_one_owner():
    plan = ShardingPlan(world_size=2, num_tables=3)
    assert [plan.tables_of(r) for r in range(2)] == [[0, 2], [1]]
    assert plan.owner_order() == [0, 2, 1]
    assert ShardingPlan(world_size=4, num_tables=3).tables_of(3) == []  # more ranks than tables: one owns none


@pytest.mark.parametrize("world_size,rows,sizes", [
    (2, 40_000, [20_000, 20_000]),
    (3, 40_000, [13_334, 13_334, 13_332]),  # uneven: the last block shorter
    (3, 31, [11, 11, 9]),
    (4, 2, [1, 1, 0, 0]),                   # more ranks than rows: the last ones hold none
    (3, 7, [3, 3, 1]),
    (1, 5, [5]),
])
def test_row_wise_blocks_cover_every_row_exactly_once_in_rank_order(world_size, rows, sizes):
    plan = ShardingPlan(world_size=world_size, num_tables=3, embedding_sharding="row-wise")
    ranges = [plan.row_range(rows, r) for r in range(world_size)]
    assert [stop - start for start, stop in ranges] == sizes
    assert [i for start, stop in ranges for i in range(start, stop)] == list(range(rows))
    block = plan.row_block(rows)  # the input dist sends row i to rank i // block: the rank that holds it
    assert all(ranges[i // block][0] <= i < ranges[i // block][1] for i in range(rows))
    assert all(plan.tables_of(r) == [0, 1, 2] for r in range(world_size))  # a block of every table on every rank


def test_samples_split_contiguously_in_rank_order():
    assert sample_counts(32, 2) == [16, 16]
    assert sample_counts(10, 3) == [4, 3, 3]
    assert [sample_slice(10, 3, r) for r in range(3)] == [(0, 4), (4, 7), (7, 10)]
    with pytest.raises(ConfigError, match="at least one sample"):
        sample_counts(2, 3)


@pytest.mark.parametrize("world_size,num_groups,sizes", [
    (2, 61, [31, 30]),     # uneven: the first ranks one group more
    (3, 9, [3, 3, 3]),
    (4, 3, [1, 1, 1, 0]),  # more ranks than groups: one owns none
    (1, 5, [5]),
])
def test_tail_groups_go_in_contiguous_blocks_each_owned_once(world_size, num_groups, sizes):
    plan = ShardingPlan(world_size=world_size, num_tables=3, tail_sharding="label-groups")
    ranges = [plan.group_range(r, num_groups) for r in range(world_size)]
    assert [len(g) for g in ranges] == sizes
    assert [g for owned in ranges for g in owned] == list(range(num_groups))  # in rank order, each once


@pytest.mark.parametrize("field,value,sentence", [
    ("embedding_sharding", "column-wise", "embedding_sharding must be one of table-wise, row-wise"),
])
def test_schemes_not_built_are_config_errors(field, value, sentence):
    with pytest.raises(ConfigError, match=sentence):
        ShardingPlan(world_size=2, num_tables=3, **{field: value})
