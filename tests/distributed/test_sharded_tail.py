"""The label-group-sharded tail's parts: owned groups are the full layer's, rewire as it does, and the
exchanges gather and reduce-scatter uneven shares (2 gloo processes).

The trained equivalence with the single process is test_sharded_training's; these pin the pieces it
rests on, including the cases that run cannot reach (a rank without groups, uneven sample counts).
"""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from targets.haste_rec.distributed.plan import ShardingPlan
from targets.haste_rec.distributed.sharded_tail import _GatherRows, all_gather_padded
from targets.haste_rec.tail.haste import HasteOutput, zero_rewired_state

H, TAIL_DIMS, FAN_IN, GROUP_SIZE, NUM_GROUPS = 24, 20, 6, 4, 7


def _layer(groups_owned: range | None = None) -> HasteOutput:
    """A layer of 3 head labels and NUM_GROUPS groups, the last one padded."""
    labels = torch.randperm(3 + NUM_GROUPS * GROUP_SIZE - 2, generator=torch.Generator().manual_seed(5))
    groups = torch.cat([labels[3:], torch.tensor([-1, -1])]).reshape(NUM_GROUPS, GROUP_SIZE)
    return HasteOutput(H, TAIL_DIMS, labels[:3], groups, FAN_IN, seed=3, groups_owned=groups_owned)


def _parts(world_size: int) -> list[HasteOutput]:
    plan = ShardingPlan(world_size=world_size, num_tables=1, tail_sharding="label-groups")
    return [_layer(plan.group_range(r, NUM_GROUPS)) for r in range(world_size)]


@pytest.mark.parametrize("world_size", [2, 3, 8], ids=["even-ish", "uneven", "more-ranks-than-groups"])
def test_owned_groups_train_and_rewire_as_the_full_layers_slices(world_size):
    full, parts = _layer(), _parts(world_size)
    h = torch.randn(5, H, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(torch.cat([p.tail_logits(h) for p in parts], dim=1), full.tail_logits(h))
        assert all(torch.equal(p.head_logits(h), full.head_logits(h)) for p in parts)
    layers = [full, *parts]
    optimizers = [torch.optim.SGD(layer.tail_parameters(), lr=0.5, momentum=0.9) for layer in layers]
    generators = [torch.Generator().manual_seed(7) for _ in layers]  # the one rewiring generator, on every rank
    cat = lambda name: torch.cat([getattr(p, name) for p in parts])  # noqa: E731
    for step in range(3):
        for layer, optimizer in zip(layers, optimizers):
            layer.tail_logits(h).sin().sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        for name in ("tail_weight", "tail_bias"):  # the batch sums of other shapes may round differently
            torch.testing.assert_close(cat(name), getattr(full, name), rtol=1e-5, atol=0)
        with torch.no_grad():  # from equal weights, the rewiring must agree bit for bit
            for part in parts:
                part.tail_weight.copy_(full.tail_weight[part.groups_owned.start:part.groups_owned.stop])
        for layer, optimizer, generator in zip(layers, optimizers, generators):
            zero_rewired_state(optimizer, layer.rewire(0.5, generator))
        for name in ("tail_index", "tail_weight"):
            assert torch.equal(cat(name), getattr(full, name)), (name, step)
    assert not torch.equal(full.tail_index, _layer().tail_index)  # it did rewire


def test_a_rank_without_groups_still_sends_its_hidden_states_gradient_back():
    """Its (empty) tail loss must reach h, so that its reduce-scatter meets the other ranks'."""
    empty = _parts(8)[-1]
    assert len(empty.groups_owned) == 0 and empty.tail_weight.shape == (0, GROUP_SIZE, FAN_IN)
    h = torch.randn(5, H, requires_grad=True)
    logits = empty.tail_logits(h)
    assert logits.shape == (5, 0)
    torch.nn.functional.binary_cross_entropy_with_logits(logits, torch.zeros_like(logits), reduction="sum").backward()
    assert h.grad is not None and not h.grad.any()


def _exchange_on_two_ranks(rank: int, store_path: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    try:
        counts = [3, 2]  # uneven samples
        rows = torch.arange(5 * 4, dtype=torch.float32).view(5, 4)
        mine = rows[sum(counts[:rank]):sum(counts[:rank + 1])].clone().requires_grad_(True)
        everyone = _GatherRows.apply(mine, counts, rank, None)
        assert torch.equal(everyone, rows)
        (everyone * (rank + 1)).sum().backward()  # rank r's loss weighs every row by r + 1
        assert torch.equal(mine.grad, torch.full_like(mine, 3.0))  # summed over the two ranks: 1 + 2
        columns = torch.full((2, 3 - rank), float(rank))  # uneven columns
        assert all_gather_padded(columns, [3, 2], None, dim=1).tolist() == [[0, 0, 0, 1, 1]] * 2
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_the_exchanges_gather_and_reduce_scatter_uneven_shares(tmp_path):
    mp.start_processes(_exchange_on_two_ranks, args=(str(tmp_path / "store"),), nprocs=2, start_method="spawn")
