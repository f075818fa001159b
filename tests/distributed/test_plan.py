"""The sharding plan as configuration: owners, sample slices, and ConfigErrors for what is not built."""

import pytest

from targets.haste_rec.distributed.plan import ShardingPlan, sample_counts, sample_slice
from targets.protocol import ConfigError


def test_tables_go_round_robin_and_every_table_has_one_owner():
    plan = ShardingPlan(world_size=2, num_tables=3)
    assert [plan.tables_of(r) for r in range(2)] == [[0, 2], [1]]
    assert plan.owner_order() == [0, 2, 1]
    assert ShardingPlan(world_size=4, num_tables=3).tables_of(3) == []  # more ranks than tables: one owns none


def test_samples_split_contiguously_in_rank_order():
    assert sample_counts(32, 2) == [16, 16]
    assert sample_counts(10, 3) == [4, 3, 3]
    assert [sample_slice(10, 3, r) for r in range(3)] == [(0, 4), (4, 7), (7, 10)]
    with pytest.raises(ConfigError, match="at least one sample"):
        sample_counts(2, 3)


@pytest.mark.parametrize("field,value,sentence", [
    ("embedding_sharding", "row-wise", "embedding_sharding row-wise is not implemented yet"),
    ("tail_sharding", "label-groups", "tail_sharding label-groups is not implemented yet"),
    ("embedding_sharding", "column-wise", "embedding_sharding must be one of table-wise, row-wise"),
])
def test_schemes_not_built_are_config_errors(field, value, sentence):
    with pytest.raises(ConfigError, match=sentence):
        ShardingPlan(world_size=2, num_tables=3, **{field: value})
