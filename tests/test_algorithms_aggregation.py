"""The normalisation contract: the loss and the gradient of one optimizer step do not
depend on how its completions are split over data-parallel ranks and micro-batches.

Single process: "ranks" and micro-batches are index partitions of one batch; their count
partials are summed (what the all-reduce does) before the coefficients are built."""
import pytest
import torch

from megatron_grpo.algorithms import (aggregate_loss, compute_policy_loss, count_partials,
                                      counts_from_masks, entropy_threshold, local_loss, loss_normalizer,
                                      token_coefficients)
from megatron_grpo.algorithms.aggregation import COMPLETION_TOKENS, LOSS_TOKENS, SEQUENCES
from tests.test_algorithms_policy_loss import LMAX, TOKEN_LOSS_TYPES, make_batch, reference_loss

S, L = 8, 9

# Each split: a list of "ranks", each a list of micro-batches (completion indices).
SPLITS = {
    "one_shot": [[list(range(S))]],
    "dp1_mb4": [[[0, 1], [2, 3], [4, 5], [6, 7]]],
    "dp2_mb2_interleaved": [[[0, 5], [2, 7]], [[1, 4], [3, 6]]],
    "dp2_uneven": [[[3], [0, 1, 2]], [[7, 4, 5, 6]]],
}


def _options(loss_type):
    return dict(loss_type=loss_type, epsilon=0.2, epsilon_high=1.1 if loss_type == "cispo" else 0.28,
                delta=1.4 if loss_type != "cispo" else None, beta=0.05, overlong_filter=True,
                top_entropy_quantile=0.7, importance_sampling_level="sequence_token",
                rollout_importance_sampling_mode="token_truncate", rollout_importance_sampling_threshold=1.3)


def _micro_out(bt, logps, idx, o, threshold):
    kw = {k: v for k, v in o.items() if k != "loss_type"}
    return compute_policy_loss(
        logps[idx], bt["adv"][idx], bt["mask"][idx], old_logps=bt["old"][idx], ref_logps=bt["ref"][idx],
        entropy=bt["entropy"][idx], truncated=bt["truncated"][idx], rollout_logps=bt["rollout"][idx],
        loss_type=o["loss_type"], entropy_threshold_value=threshold, **kw)


def step_loss(bt, logps, ranks, o, generation_counts=None):
    """Sum over ranks and micro-batches of the local losses, with global counts and threshold."""
    micro = [idx for rank in ranks for idx in rank]
    loss_mask = bt["mask"]
    if o.get("overlong_filter"):
        loss_mask = loss_mask & ~bt["truncated"].unsqueeze(-1)
    # 1. counts: each micro-batch's partials, summed (= all-reduce SUM over DP of per-rank sums)
    counts = sum(count_partials(loss_mask[idx], bt["mask"][idx]) for idx in micro)
    # 2. the global entropy threshold over the gathered entropies of every loss token
    gathered = torch.cat([bt["entropy"][idx][loss_mask[idx]] for idx in micro])
    threshold = entropy_threshold(gathered, o["top_entropy_quantile"])
    norm = loss_normalizer(o["loss_type"], counts, max_completion_length=LMAX,
                           generation_counts=counts if generation_counts is None else generation_counts)
    total = 0.0
    for idx in micro:
        out = _micro_out(bt, logps, idx, o, threshold)
        total = total + local_loss(out.per_token_loss, out.loss_mask, o["loss_type"], norm)
    return total


@pytest.mark.parametrize("loss_type", TOKEN_LOSS_TYPES)  # real: test_algorithms_policy_loss
def test_loss_and_grad_invariant_to_split(loss_type):
    bt = make_batch(31, b=S, l=L, empty_row=False)
    o = _options(loss_type)
    results = {}
    for name, ranks in SPLITS.items():
        lp = bt["logps"].clone().requires_grad_()
        loss = step_loss(bt, lp, ranks, o)
        loss.backward()
        results[name] = (loss.detach(), lp.grad)
    ref_lp = bt["logps"].clone().requires_grad_()
    ref = reference_loss(bt, ref_lp, o)
    ref.backward()
    for name, (loss, grad) in results.items():
        torch.testing.assert_close(loss, ref.detach(), rtol=1e-10, atol=1e-12, msg=name)
        torch.testing.assert_close(grad, ref_lp.grad, rtol=1e-9, atol=1e-12, msg=name)
    assert ref_lp.grad.abs().sum() > 0


@pytest.mark.parametrize("loss_type", TOKEN_LOSS_TYPES)  # real: test_algorithms_policy_loss
def test_steps_per_generation_two(loss_type):
    """Two optimizer steps from one generation batch: each step's loss is split-invariant;
    dapo/cispo normalise by the generation batch's tokens, so the two steps add up to the
    one-shot loss of the whole generation batch."""
    bt = make_batch(47, b=S, l=L, empty_row=False)
    o = _options(loss_type)
    o["top_entropy_quantile"] = 1.0  # the threshold would differ per step; tested above
    gen_counts = count_partials(bt["mask"] & ~bt["truncated"].unsqueeze(-1), bt["mask"])
    steps = [[0, 1, 2, 3], [4, 5, 6, 7]]
    step_results = []
    for step in steps:
        per_split = []
        for ranks in ([[step]], [[step[:1], step[1:3]], [step[3:]]]):
            lp = bt["logps"].clone().requires_grad_()
            loss = step_loss(bt, lp, ranks, o, generation_counts=gen_counts)
            loss.backward()
            per_split.append((loss.detach(), lp.grad))
        torch.testing.assert_close(per_split[0][0], per_split[1][0], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(per_split[0][1], per_split[1][1], rtol=1e-9, atol=1e-12)
        step_results.append(per_split[0][0])
    if loss_type in ("dapo", "cispo", "fipo"):
        whole = step_loss(bt, bt["logps"].clone(), [[list(range(S))]], o, generation_counts=gen_counts)
        torch.testing.assert_close(step_results[0] + step_results[1], whole, rtol=1e-10, atol=1e-12)


def test_count_partials_and_normalizers():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    truncated = torch.tensor([False, False, True])
    loss_mask = mask & ~truncated.unsqueeze(-1)
    c = count_partials(loss_mask, mask)
    assert c.dtype == torch.float64
    assert (c[LOSS_TOKENS].item(), c[COMPLETION_TOKENS].item(), c[SEQUENCES].item()) == (4.0, 8.0, 3.0)
    # the same counts from the masks of all completions, given in pieces
    torch.testing.assert_close(counts_from_masks([loss_mask[:1], loss_mask[1:]], [mask[:1], mask[1:]]), c)
    assert loss_normalizer("grpo", c).item() == 3.0
    assert loss_normalizer("bnpo", c).item() == 4.0
    assert loss_normalizer("dr_grpo", c, max_completion_length=16).item() == 48.0
    assert loss_normalizer("dapo", c, generation_counts=2 * c).item() == 16.0
    assert loss_normalizer("cispo", c, generation_counts=c).item() == 8.0
    # every completion filtered: normaliser 1, not 0
    assert loss_normalizer("bnpo", count_partials(torch.zeros_like(mask), mask)).item() == 1.0
    coef = token_coefficients("grpo", loss_mask, 3.0, dtype=torch.float64)
    torch.testing.assert_close(coef.sum(dim=-1), torch.tensor([1 / 3, 1 / 3, 0.0], dtype=torch.float64))


def test_context_parallel_token_slices_with_full_sequence_counts():
    """A completion split over two CP ranks: the per-sequence mean (grpo) needs the full
    length; counting on one CP rank keeps S right."""
    bt = make_batch(5, b=S, l=L, empty_row=False)
    lp = bt["logps"].clone().requires_grad_()
    out = compute_policy_loss(lp, bt["adv"], bt["mask"], old_logps=bt["old"])
    counts = count_partials(out.loss_mask)
    norm = loss_normalizer("grpo", counts)
    one_shot = local_loss(out.per_token_loss, out.loss_mask, "grpo", norm)
    full_n = out.loss_mask.sum(dim=-1)
    halves = [slice(0, L // 2), slice(L // 2, L)]
    split = sum(aggregate_loss(out.per_token_loss[:, h],
                               token_coefficients("grpo", out.loss_mask[:, h], norm, sequence_token_counts=full_n,
                                                  dtype=torch.float64)) for h in halves)
    torch.testing.assert_close(split, one_shot, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("fn", ["loss_normalizer", "token_coefficients"])
def test_unknown_loss_type_raises_with_valid_list(fn):
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError) as err:
        if fn == "loss_normalizer":
            loss_normalizer("token_mean", count_partials(mask))
        else:
            token_coefficients("token_mean", mask, 1.0)
    msg = str(err.value)
    assert "loss_type" in msg and "'token_mean'" in msg
    assert all(repr(v) in msg for v in ("grpo", "bnpo", "dr_grpo", "dapo", "cispo"))


def test_missing_normalizer_inputs_raise():
    c = count_partials(torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="max_completion_length"):
        loss_normalizer("dr_grpo", c)
    with pytest.raises(ValueError, match="generation_counts"):
        loss_normalizer("dapo", c)
