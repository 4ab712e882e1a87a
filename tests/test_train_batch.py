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


def _reference_collate(samples, pad_id, pad_to_multiple_of, pad_to_length):
    """`collate` written one sample at a time (the layout it documents), for comparison."""
    import torch

    lengths = [len(s.prompt_ids) + len(s.completion_ids) - 1 for s in samples]
    seq = max(max(lengths), pad_to_length or 0)
    seq = -(-seq // pad_to_multiple_of) * pad_to_multiple_of
    b = len(samples)
    out = {"input_ids": torch.full((b, seq), pad_id), "targets": torch.full((b, seq), pad_id),
           "completion_mask": torch.zeros((b, seq), dtype=torch.bool)}
    fields = [f for f in ("old_logps", "ref_logps", "rollout_logps")
              if all(getattr(s, f) is not None for s in samples)]
    out.update({f: torch.zeros((b, seq)) for f in fields})
    for i, s in enumerate(samples):
        tokens = list(s.prompt_ids) + list(s.completion_ids)
        p, c = len(s.prompt_ids), len(s.completion_ids)
        for j in range(len(tokens) - 1):
            out["input_ids"][i, j], out["targets"][i, j] = tokens[j], tokens[j + 1]
        model = [1] * c if s.loss_mask is None else s.loss_mask
        k = 0
        for j in range(c):
            if model[j]:
                out["completion_mask"][i, p - 1 + j] = True
                for f in fields:
                    out[f][i, p - 1 + j] = float(getattr(s, f)[k])
                k += 1
    out["lengths"] = torch.tensor(lengths)
    out["advantages"] = torch.tensor([s.advantage for s in samples])
    out["truncated"] = torch.tensor([s.truncated for s in samples])
    return out


@pytest.mark.parametrize("seed", range(6))
def test_collate_equals_the_per_sample_layout(seed):
    """Random micro-batches (prompt and completion lengths, loss masks with environment
    tokens, per-token values as lists and as tensors, padding options): every tensor
    equal to the one-sample-at-a-time reference."""
    import random

    import torch

    from megatron_grpo.train.batch import Sample, collate

    rng = random.Random(seed)
    with_masks, with_logps = seed % 2 == 1, seed % 3 != 0
    samples = []
    for _ in range(rng.randint(1, 9)):
        p, c = rng.randint(1, 12), rng.randint(1, 14)
        mask = [rng.randint(0, 1) for _ in range(c)] if with_masks and rng.random() < 0.7 else None
        n = c if mask is None else sum(mask)
        logps = [rng.uniform(-5, 0) for _ in range(n)]
        samples.append(Sample(
            prompt_ids=[rng.randint(1, 99) for _ in range(p)],
            completion_ids=[rng.randint(1, 99) for _ in range(c)],
            advantage=rng.uniform(-1, 1), truncated=rng.random() < 0.3, loss_mask=mask,
            rollout_logps=logps if with_logps else None,
            old_logps=torch.tensor(logps) if with_logps and seed % 2 == 0 else None))
    kw = dict(pad_id=rng.choice([0, 7]), pad_to_multiple_of=rng.choice([1, 4]),
              pad_to_length=rng.choice([None, 30]))
    got, want = collate(samples, **kw), _reference_collate(samples, **kw)
    assert set(want) <= set(got)
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
    assert torch.equal(got["position_ids"],
                       torch.arange(got["input_ids"].shape[1]).expand_as(got["input_ids"]))
