"""The prompt sampler: deterministic epochs, and a resume that repeats and skips nothing."""
import json
from collections import Counter

import pytest

from megatron_grpo.data import PromptSampler, shard


def test_each_epoch_is_a_permutation_and_seeded():
    s = PromptSampler(10, prompts_per_batch=5, seed=3)
    epoch0 = s.next_batch() + s.next_batch()
    epoch1 = s.next_batch() + s.next_batch()
    assert sorted(epoch0) == sorted(epoch1) == list(range(10))
    assert epoch0 != epoch1                                 # reshuffled per epoch
    assert s.epoch == 2 and s.position == 0 and s.consumed == 20
    again = PromptSampler(10, prompts_per_batch=5, seed=3)
    assert again.next_batch() + again.next_batch() == epoch0
    other = PromptSampler(10, prompts_per_batch=5, seed=4)
    assert other.next_batch() + other.next_batch() != epoch0
    plain = PromptSampler(10, prompts_per_batch=4, seed=3, shuffle=False)
    assert [plain.next_batch() for _ in range(3)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1]]


def test_batches_cross_epochs_without_dropping():
    s = PromptSampler(7, prompts_per_batch=3, seed=0)
    seq = [i for _ in range(7) for i in s.next_batch()]     # 21 prompts = 3 full epochs
    for e in range(3):
        assert sorted(seq[7 * e:7 * (e + 1)]) == list(range(7))
    assert s.batches_for_epochs(1) == 3 and s.batches_for_epochs(2.5) == 6


@pytest.mark.parametrize("stop_after", [0, 1, 3, 4, 9])
def test_resume_continues_exactly(stop_after):
    n, per_batch, total = 11, 4, 12
    reference = PromptSampler(n, per_batch, seed=9)
    expected = [reference.next_batch() for _ in range(total)]

    first = PromptSampler(n, per_batch, seed=9)
    got = [first.next_batch() for _ in range(stop_after)]
    state = json.loads(json.dumps(first.state_dict()))     # as a checkpoint stores it
    resumed = PromptSampler(n, per_batch, seed=9)
    resumed.load_state_dict(state)
    got += [resumed.next_batch() for _ in range(total - stop_after)]
    assert got == expected
    # Over whole epochs no prompt is repeated or skipped.
    flat = [i for b in got for i in b]
    full = len(flat) // n * n
    assert Counter(flat[:full]) == Counter({i: full // n for i in range(n)})


def test_resume_with_another_batch_size_keeps_the_order():
    a = PromptSampler(10, 4, seed=1)
    a.next_batch()
    state = a.state_dict()
    b = PromptSampler(10, 2, seed=1)
    b.load_state_dict(state)
    assert b.next_batch() + b.next_batch() == PromptSampler(10, 4, seed=1).order(0)[4:8]


@pytest.mark.parametrize("change", [{"num_prompts": 12}, {"seed": 2}, {"shuffle": False}])
def test_resume_refuses_a_different_dataset_or_seed(change):
    state = PromptSampler(10, 4, seed=1).state_dict()
    kwargs = {"num_prompts": 10, "prompts_per_batch": 4, "seed": 1, "shuffle": True, **change}
    with pytest.raises(ValueError, match="cannot resume the data order"):
        PromptSampler(**kwargs).load_state_dict(state)


def test_shard():
    assert shard([5, 6, 7, 8], 0, 2) == [5, 6] and shard([5, 6, 7, 8], 1, 2) == [7, 8]
    with pytest.raises(ValueError, match="do not split evenly over 3 ranks"):
        shard([1, 2, 3, 4], 0, 3)
    with pytest.raises(ValueError):
        PromptSampler(0, 1)
