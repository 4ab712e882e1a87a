"""Dynamic sampling and advantages over a generation batch (no vLLM: batches are built
directly, the sampler is a list)."""
import torch

from megatron_grpo.train.batch import Sample
from megatron_grpo.train.rollout_step import GenerationBatch, collect_rollouts, finish_batch


def _batch(tag, group_rewards, k=2):
    samples, rows = [], []
    for g, rs in enumerate(group_rewards):
        for j in range(k):
            samples.append(Sample(prompt_ids=[1], completion_ids=[2, 3],
                                  meta={"prompt_index": f"{tag}{g}"}))
            rows.append([rs[j]])
    n = len(samples)
    return GenerationBatch(samples, ["t"] * n, [f"{tag}{i // k}" for i in range(n)],
                           torch.tensor(rows, dtype=torch.float32), {},
                           {"timing/generate": 1.0})


def test_dynamic_sample_replaces_flat_groups():
    draws = iter([_batch("a", [[1, 1], [0, 1]]), _batch("b", [[0, 0], [1, 0]]),
                  _batch("c", [[0, 1], [1, 0]])])
    out = collect_rollouts(lambda: next(draws), 2, 2, dynamic_sample=True, max_resample_times=3)
    # a1 (varied) then b1 (varied): two groups, one resampling round.
    assert [s.meta["prompt_index"] for s in out.samples] == ["a1", "a1", "b1", "b1"]
    assert out.metrics["dynamic_sample/resample_rounds"] == 1.0
    assert out.timing["timing/generate"] == 2.0


def test_dynamic_sample_pads_when_rounds_run_out():
    draws = iter([_batch("a", [[1, 1], [0, 1]]), _batch("b", [[0, 0], [1, 1]])])
    out = collect_rollouts(lambda: next(draws), 2, 2, dynamic_sample=True, max_resample_times=1)
    assert [s.meta["prompt_index"] for s in out.samples] == ["a1", "a1", "a0", "a0"]


def test_without_dynamic_sample_and_advantages():
    b = _batch("a", [[1, 0], [2, 2]])
    out = finish_batch(collect_rollouts(lambda: b, 2, 2), 2, reward_names=["r"])
    adv = [s.advantage for s in out.samples]
    assert adv[0] > 0 > adv[1] and adv[2] == adv[3] == 0.0
    assert out.metrics["frac_reward_zero_std"] == 0.5
    assert out.metrics["completions/mean_length"] == 2.0
