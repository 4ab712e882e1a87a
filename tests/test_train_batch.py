"""train/batch.py's data-parallel layout: `dp_shard` against the trainer's original
slicing (each optimizer step's slice, every dp-th sample), `dp_unshard` its inverse."""
import pytest

from megatron_grpo.train.batch import dp_indices, dp_shard, dp_unshard


@pytest.mark.parametrize("n,per_step,dp", [(8, 8, 1), (8, 4, 2), (16, 8, 4), (12, 6, 3), (8, 2, 2)])
def test_dp_shard_is_the_step_slices_strided(n, per_step, dp):
    batch = [f"s{j}" for j in range(n)]
    steps = [batch[k * per_step:(k + 1) * per_step] for k in range(n // per_step)]
    shards = [dp_shard(batch, per_step, dp, r) for r in range(dp)]
    for r in range(dp):
        assert shards[r] == [sl[r::dp] for sl in steps]
        assert [[batch[j] for j in idx] for idx in dp_indices(n, per_step, dp, r)] == shards[r]
    assert dp_unshard(shards, n, per_step) == batch
    owned = sorted(j for r in range(dp) for idx in dp_indices(n, per_step, dp, r) for j in idx)
    assert owned == list(range(n))          # every sample on exactly one DP rank


def test_dp_unshard_refuses_a_share_of_the_wrong_shape():
    shards = [dp_shard(list(range(8)), 4, 2, r) for r in range(2)]
    shards[1] = [shards[1][0]]
    with pytest.raises(ValueError, match="DP rank 1"):
        dp_unshard(shards, 8, 4)


@pytest.mark.parametrize("n,per_step,dp,group", [(16, 8, 2, 4), (24, 12, 3, 2), (16, 16, 2, 4), (8, 8, 1, 4)])
def test_dp_shard_keeps_groups_whole(n, per_step, dp, group):
    """loss_type real: each rank gets whole groups (every dp-th group of a step)."""
    batch = [(j // group, j) for j in range(n)]                 # (group id, sample)
    shards = [dp_shard(batch, per_step, dp, r, group) for r in range(dp)]
    for r in range(dp):
        for part in shards[r]:
            ids = [g for g, _ in part]
            assert len(part) == per_step // dp
            assert all(ids[i:i + group] == [ids[i]] * group for i in range(0, len(ids), group))
            assert sorted(set(ids)) == [g for g in sorted(set(ids)) if (g % (per_step // group)) % dp == r]
    assert dp_unshard(shards, n, per_step, group) == batch
    with pytest.raises(ValueError, match="whole groups"):
        dp_indices(n, per_step, per_step, 0, group)
