"""The sharded MLP in one process: shards partition the features, rebuild the full weights at any
world size, and their partial sums add up to the unsharded MLP."""

import pytest
import torch

from tp.mlp import ShardedMLP, down_rows, full_weights, gate_up_columns, reference_mlp, shard_range


def test_shards_partition_the_features_and_refuse_uneven_splits():
    assert [shard_range(12, r, 3) for r in range(3)] == [range(0, 4), range(4, 8), range(8, 12)]
    with pytest.raises(ValueError, match="split evenly"):
        shard_range(10, 0, 4)
    with pytest.raises(ValueError):
        shard_range(8, 2, 2)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_shards_of_any_world_size_rebuild_the_full_weights(world):
    hidden, inter = 6, 8
    gate_up, down = full_weights(5, hidden, inter)
    shards = [shard_range(inter, r, world) for r in range(world)]
    cols = [gate_up_columns(5, hidden, inter, s) for s in shards]
    gates = torch.cat([c[:, :len(s)] for c, s in zip(cols, shards)], dim=1)
    ups = torch.cat([c[:, len(s):] for c, s in zip(cols, shards)], dim=1)
    assert torch.equal(torch.cat([gates, ups], dim=1), gate_up)
    assert torch.equal(torch.cat([down_rows(5, hidden, inter, s) for s in shards]), down)
    assert not torch.equal(full_weights(6, hidden, inter)[0], gate_up)


def test_partial_sums_add_up_to_the_unsharded_mlp_and_one_alone_does_not():
    hidden, inter, world = 16, 32, 4
    x = torch.randn(5, hidden, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    want = reference_mlp(x, *full_weights(2, hidden, inter))
    parts = [ShardedMLP.from_seed(2, hidden, inter, r, world, dtype=torch.float64,
                                  device="cpu").partial(x) for r in range(world)]
    assert ((sum(parts) - want).norm() / want.norm()).item() < 1e-13
    assert ((parts[0] - want).norm() / want.norm()).item() > 0.1
