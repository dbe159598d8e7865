"""ElasticBatches (issue 45): the same global batch, data order and randomness at any world size."""

from __future__ import annotations

import pytest

from trainguard.producers.training.elastic import ElasticBatches, shards_from_env

torch = pytest.importorskip("torch")


def test_every_world_trains_the_same_global_batch_and_each_sample_of_an_epoch_once() -> None:
    data = ElasticBatches(1000, global_batch=96, shards=8, seed=5)  # 10 steps an epoch, 40 samples dropped
    assert data.steps_per_epoch == 10 and data.shard_size == 12
    for world in range(1, 9):  # 3, 5, 6, 7 do not divide the shards: loads differ by one
        for step in (0, 7, 13):
            mine = [data.mine(step, rank, world) for rank in range(world)]
            ids = [i for rank in mine for _, batch in rank for i in batch]
            assert sorted(ids) == sorted(i for s in range(8) for i in data.shard(step, s))
            assert len(ids) == 96 == len(set(ids))
            assert max(map(len, mine)) - min(map(len, mine)) <= 1
            # DDP averages over `world`: the shards' weights sum to 1 per update
            assert sum(data.weight(world) for rank in mine for _ in rank) / world == pytest.approx(1)
    for epoch in range(2):
        steps = range(epoch * 10, epoch * 10 + 10)
        seen = [i for step in steps for s in range(8) for i in data.shard(step, s)]
        assert len(seen) == 960 == len(set(seen))
    assert data.shard(0, 0) != data.shard(10, 0)  # another epoch, another permutation


def test_a_shards_randomness_does_not_depend_on_who_trains_it() -> None:
    data = ElasticBatches(256, global_batch=64, shards=4, seed=1)
    torch.manual_seed(123)
    with data.rng(7, 2):
        first = torch.rand(5)
    outside = torch.rand(1)
    torch.manual_seed(999)  # another rank's RNG, another world's history
    with data.rng(7, 2):
        again = torch.rand(5)
    with data.rng(7, 3):
        other = torch.rand(5)
    assert torch.equal(first, again) and not torch.equal(first, other)
    torch.manual_seed(123)
    assert torch.equal(torch.rand(1), outside)  # the global RNG is as if nothing drew


def test_its_checkpoint_state_refuses_another_configuration() -> None:
    data = ElasticBatches(256, global_batch=64, shards=4, seed=1)
    ElasticBatches(256, global_batch=64, shards=4, seed=1).load_state_dict(data.state_dict())
    with pytest.raises(ValueError, match="global_batch changed: checkpoint 64, now 32"):
        ElasticBatches(256, global_batch=32, shards=4, seed=1).load_state_dict(data.state_dict())
    with pytest.raises(ValueError, match="multiple of shards 3"):
        ElasticBatches(256, global_batch=64, shards=3)
    with pytest.raises(ValueError, match="rank 4 of world 4"):
        data.shards_of(4, 4)
    assert shards_from_env({"TRAINGUARD_ELASTIC_SHARDS": "8", "WORLD_SIZE": "4"}) == 8
    assert shards_from_env({"WORLD_SIZE": "4"}) == 4
