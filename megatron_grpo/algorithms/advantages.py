"""Advantages from rewards: ms-swift's advantage estimators and reward scalings.

All functions here take the rewards of the WHOLE generation batch (already gathered
from every data-parallel rank): group statistics need every completion of a prompt,
and batch statistics need every completion. Layout: N = num_prompts * num_generations
rows, the `num_generations` completions of one prompt contiguous.

Semantics follow ms-swift (`compute_advantages` / `compute_reward_metrics`):

* rewards R = nansum_f(w_f * r_f) over reward functions (a function may return NaN
  for "no opinion"; it then contributes nothing).
* `kl_in_reward`: R <- R - beta * KL_i before anything else, KL_i the sequence KL
  of completion i (see `sequence_kl_for_reward`). Defaults (ms-swift): False for
  `grpo`, True for `rloo` and `reinforce_plus_plus`. When it is on, the policy loss
  must not also add the KL term (policy_loss handles that with the same option).
* `advantage_estimator`:
    grpo                 A = R - mean_group(R)
    rloo                 A = K/(K-1) * (R - mean_group(R))  (= R - mean of the other K-1)
    reinforce_plus_plus  A = R - mean_group(R)  (scaled by the std of A, not of R)
* `scale_rewards` (default per estimator: grpo->group, rloo->none, r++->batch):
    group  A /= (std_group + 1e-4)   std of R in the group (r++: std of A in the group)
    batch  A /= (std_batch + 1e-4)   std of R over all N (r++: std of A over all N)
    none   A unchanged (Dr. GRPO)
    gdpo   per reward function f: z_f = (r_f - mean_group(r_f)) / (std_group(r_f) + 1e-8)
           (NaN -> 0), S = sum_f w_f z_f, A = (S - mean(S)) / (std(S) + 1e-8) over the batch.
           GDPO replaces the estimator's own advantage (as in ms-swift for grpo and rloo);
           it ignores the summed reward, hence `kl_in_reward` has no effect on it (ms-swift
           turns it off with a warning, so do we). With reinforce_plus_plus ms-swift silently
           returns unscaled advantages; we reject that combination instead.
  All std are unbiased (Bessel), as torch.std and ms-swift.
"""
from __future__ import annotations

import warnings
from typing import Callable, Dict, NamedTuple, Optional, Sequence

import torch

from ..config.groups import DEFAULT_KL_IN_REWARD, DEFAULT_SCALE_REWARDS  # ms-swift's, once
from .options import check_option

SCALE_REWARDS = ("group", "batch", "none", "gdpo")

_STD_EPS = 1e-4   # added to group/batch std (ms-swift)
_GDPO_EPS = 1e-8  # added to the per-function and final std in gdpo (ms-swift)


def default_scale_rewards(advantage_estimator: str) -> str:
    check_option("advantage_estimator", advantage_estimator, ADVANTAGE_ESTIMATORS)
    return DEFAULT_SCALE_REWARDS[advantage_estimator]


def default_kl_in_reward(advantage_estimator: str) -> bool:
    check_option("advantage_estimator", advantage_estimator, ADVANTAGE_ESTIMATORS)
    return DEFAULT_KL_IN_REWARD[advantage_estimator]


def _group_std(grouped: torch.Tensor) -> torch.Tensor:
    """Unbiased std of each row of `grouped` [G, K] -> [G]; 0 when K == 1 (no spread)."""
    if grouped.shape[1] < 2:
        return torch.zeros(grouped.shape[0], dtype=grouped.dtype, device=grouped.device)
    return grouped.std(dim=1)


def _batch_std(x: torch.Tensor) -> torch.Tensor:
    """Unbiased std of all of `x` [N] -> 0-d; 0 when N == 1."""
    return x.std() if x.numel() > 1 else torch.zeros((), dtype=x.dtype, device=x.device)


def _centered(rewards: torch.Tensor, k: int) -> torch.Tensor:
    grouped = rewards.view(-1, k)                                   # [G, K]
    return (grouped - grouped.mean(dim=1, keepdim=True)).view(-1)  # [N]


def _scale_by(values: torch.Tensor, stat_source: torch.Tensor, k: int, scale_rewards: str) -> torch.Tensor:
    """Divide `values` [N] by the group or batch std of `stat_source` [N] (+1e-4)."""
    if scale_rewards == "group":
        std = _group_std(stat_source.view(-1, k)).repeat_interleave(k)  # [N]
    elif scale_rewards == "batch":
        std = _batch_std(stat_source)
    else:  # "none"
        return values
    return values / (std + _STD_EPS)


def grpo_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str) -> torch.Tensor:
    """rewards [N] -> A [N] = (R - group mean) / (std of R + 1e-4)."""
    return _scale_by(_centered(rewards, num_generations), rewards, num_generations, scale_rewards)


def rloo_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str) -> torch.Tensor:
    """rewards [N] -> leave-one-out A [N] = K/(K-1) (R - group mean), optionally / std of R."""
    k = num_generations
    adv = _centered(rewards, k)
    if k > 1:
        adv = adv * (k / (k - 1))
    return _scale_by(adv, rewards, k, scale_rewards)


def reinforce_plus_plus_advantages(rewards: torch.Tensor, num_generations: int,
                                   scale_rewards: str) -> torch.Tensor:
    """rewards [N] -> A [N] = (R - group mean), divided by the std of that centred A."""
    adv = _centered(rewards, num_generations)
    return _scale_by(adv, adv, num_generations, scale_rewards)


# name -> fn(rewards [N], num_generations, scale_rewards in {group, batch, none}) -> [N]
ADVANTAGE_ESTIMATORS: Dict[str, Callable[[torch.Tensor, int, str], torch.Tensor]] = {
    "grpo": grpo_advantages,
    "rloo": rloo_advantages,
    "reinforce_plus_plus": reinforce_plus_plus_advantages,
}


def _nanstd_rows(x: torch.Tensor) -> torch.Tensor:
    """Unbiased std of each row of `x` [G, K] ignoring NaN -> [G, 1]; NaN when < 2 values."""
    valid = ~torch.isnan(x)
    count = valid.sum(dim=1, keepdim=True).to(x.dtype)
    mean = torch.nanmean(x, dim=1, keepdim=True)
    sq = torch.where(valid, (x - mean) ** 2, torch.zeros_like(x)).sum(dim=1, keepdim=True)
    return torch.sqrt(sq / (count - 1))  # count == 1 -> 0/0 = NaN, count == 0 -> NaN


def gdpo_advantages(rewards_per_func: torch.Tensor, reward_weights: torch.Tensor,
                    num_generations: int) -> torch.Tensor:
    """rewards_per_func [N, F], reward_weights [F] -> A [N] (GDPO, see module docstring)."""
    k = num_generations
    summed = torch.zeros(rewards_per_func.shape[0], dtype=rewards_per_func.dtype,
                         device=rewards_per_func.device)                    # [N]
    for f in range(rewards_per_func.shape[1]):
        r = rewards_per_func[:, f].view(-1, k)                              # [G, K]
        z = (r - torch.nanmean(r, dim=1, keepdim=True)) / (_nanstd_rows(r) + _GDPO_EPS)
        # Missing rewards and one-valued groups have no signal: 0, not NaN.
        summed = summed + reward_weights[f] * torch.nan_to_num(z, nan=0.0).view(-1)
    return (summed - summed.mean()) / (_batch_std(summed) + _GDPO_EPS)


def sequence_kl_for_reward(old_logps: torch.Tensor, ref_logps: torch.Tensor,
                           completion_mask: torch.Tensor) -> torch.Tensor:
    """KL_i used by `kl_in_reward`: sum over the completion of (old - ref) log-probs.

    old_logps, ref_logps, completion_mask: [B, L] -> [B]. As ms-swift, the k1 estimator
    summed (not averaged) over the sequence, evaluated at the sampling policy.
    """
    mask = completion_mask.bool()
    diff = torch.where(mask, old_logps - ref_logps, torch.zeros_like(old_logps))
    return diff.sum(dim=-1)


class AdvantageOutput(NamedTuple):
    advantages: torch.Tensor          # [N]
    rewards: torch.Tensor             # [N] weighted (and KL-penalised) rewards
    metrics: Dict[str, torch.Tensor]  # 0-d tensors, names as ms-swift logs them


def compute_advantages(
    rewards_per_func: torch.Tensor,
    num_generations: int,
    *,
    reward_weights: Optional[Sequence[float] | torch.Tensor] = None,
    advantage_estimator: str = "grpo",
    scale_rewards: Optional[str] = None,
    kl_in_reward: Optional[bool] = None,
    beta: float = 0.0,
    kl_values: Optional[torch.Tensor] = None,
    reward_func_names: Optional[Sequence[str]] = None,
) -> AdvantageOutput:
    """Advantages [N] and reward metrics from per-function rewards [N, F].

    `scale_rewards` / `kl_in_reward` None take the estimator's default. `kl_values` [N]
    (see `sequence_kl_for_reward`) is required when kl_in_reward is on and beta != 0.
    """
    check_option("advantage_estimator", advantage_estimator, ADVANTAGE_ESTIMATORS)
    if scale_rewards is None:
        scale_rewards = default_scale_rewards(advantage_estimator)
    check_option("scale_rewards", scale_rewards, SCALE_REWARDS)
    if scale_rewards == "gdpo" and advantage_estimator == "reinforce_plus_plus":
        raise ValueError("scale_rewards='gdpo' is not supported with advantage_estimator='reinforce_plus_plus'; "
                         "valid advantage_estimator values with gdpo: 'grpo', 'rloo'")
    if kl_in_reward is None:
        kl_in_reward = default_kl_in_reward(advantage_estimator)
    if scale_rewards == "gdpo" and kl_in_reward:
        # GDPO normalises each reward function; a KL penalty on the sum would be ignored.
        warnings.warn("scale_rewards='gdpo' does not support kl_in_reward=True; using kl_in_reward=False")
        kl_in_reward = False

    if rewards_per_func.dim() != 2:
        raise ValueError(f"rewards_per_func must be [N, F], got shape {tuple(rewards_per_func.shape)}")
    n, num_funcs = rewards_per_func.shape
    if num_generations < 1 or n % num_generations != 0:
        raise ValueError(f"num_generations={num_generations} must be >= 1 and divide the number of "
                         f"completions N={n}")
    if not rewards_per_func.is_floating_point():
        rewards_per_func = rewards_per_func.float()
    dtype, device = rewards_per_func.dtype, rewards_per_func.device
    if reward_weights is None:
        weights = torch.ones(num_funcs, dtype=dtype, device=device)
    else:
        weights = torch.as_tensor(reward_weights, dtype=dtype, device=device)
        if weights.shape != (num_funcs,):
            raise ValueError(f"reward_weights has {weights.numel()} values for {num_funcs} reward functions")
    if reward_func_names is None:
        reward_func_names = [f"reward_func_{i}" for i in range(num_funcs)]
    if len(reward_func_names) != num_funcs:
        raise ValueError(f"reward_func_names has {len(reward_func_names)} names for {num_funcs} reward functions")

    rewards = (rewards_per_func * weights).nansum(dim=1)  # [N]
    use_kl = kl_in_reward and beta != 0.0
    if use_kl:
        if kl_values is None:
            raise ValueError("kl_in_reward=True with beta != 0 needs kl_values (see sequence_kl_for_reward)")
        rewards = rewards - beta * kl_values.to(dtype)

    if scale_rewards == "gdpo":
        advantages = gdpo_advantages(rewards_per_func, weights, num_generations)
    else:
        advantages = ADVANTAGE_ESTIMATORS[advantage_estimator](rewards, num_generations, scale_rewards)

    metrics = reward_metrics(rewards, rewards_per_func, num_generations, scale_rewards, reward_func_names)
    if use_kl:
        metrics["kl"] = torch.nanmean(kl_values.to(dtype))
    return AdvantageOutput(advantages, rewards, metrics)


def reward_metrics(rewards: torch.Tensor, rewards_per_func: torch.Tensor, num_generations: int,
                   scale_rewards: str, reward_func_names: Sequence[str]) -> Dict[str, torch.Tensor]:
    """ms-swift's reward metrics over the whole generation batch.

    reward                 mean of R (= mean over groups of the group means; groups are equal-sized)
    reward_std             mean over groups of the group std of R; with scale_rewards='batch' the
                           batch std of R (ms-swift reports the std that scaled the advantages)
    frac_reward_zero_std   fraction of groups whose std of R is 0 (all answers scored alike)
    rewards/{name}/mean    nanmean of the raw reward function over all completions
    rewards/{name}/std     unbiased std of its non-NaN values (0 with fewer than 2)
    """
    grouped = rewards.view(-1, num_generations)  # [G, K]
    group_std = _group_std(grouped)              # [G]
    metrics = {"reward": grouped.mean(dim=1).mean()}
    if scale_rewards == "batch":
        metrics["reward_std"] = _batch_std(rewards)
    else:
        metrics["reward_std"] = group_std.mean()
    if num_generations > 1:
        zero_std = torch.isclose(group_std, torch.zeros_like(group_std))
    else:
        zero_std = torch.ones_like(group_std, dtype=torch.bool)
    metrics["frac_reward_zero_std"] = zero_std.to(rewards.dtype).mean()
    for f, name in enumerate(reward_func_names):
        col = rewards_per_func[:, f]
        valid = col[~torch.isnan(col)]
        metrics[f"rewards/{name}/mean"] = torch.nanmean(col)
        metrics[f"rewards/{name}/std"] = _batch_std(valid)  # 0 with fewer than 2 values
    return metrics
