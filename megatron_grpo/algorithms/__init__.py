"""GRPO math as pure tensor functions: no Megatron import, no config object.

advantages   rewards [N, F] -> advantages [N] + reward metrics (estimators, reward scaling)
policy_loss  per-token loss: ratios, clipping variants, KL estimators, entropy mask,
             overlong filter, rollout importance-sampling correction
aggregation  per-token coefficients from global counts: split-invariant step loss
metrics      rank-reducible metric partials and their finalisation

Typical use in one micro-batch (counts all-reduced beforehand, see aggregation):

    loss_cfg = LossConfig(loss_type="dapo", ...)              # once per run
    out = compute_policy_loss(logps, adv, mask, loss_cfg, old_logps=old, ...)
    loss = local_loss(out.per_token_loss, out.loss_mask, "dapo", normalizer)
    parts = policy_metric_partials(out, loss_type="dapo", epsilon=0.2)
"""
from .advantages import (ADVANTAGE_ESTIMATORS, SCALE_REWARDS, AdvantageOutput, compute_advantages,
                         default_kl_in_reward, default_scale_rewards, reward_metrics, sequence_kl_for_reward)
from .aggregation import (COMPLETION_TOKENS, LOSS_NORMALIZERS, LOSS_TOKENS, SEQUENCES, aggregate_loss,
                          count_partials, counts_from_masks, local_loss, loss_normalizer, token_coefficients)
from .metrics import (finalize_metrics, merge_partials, policy_metric_partials, rollout_metric_partials,
                      stack_partials, unstack_partials)
from .options import check_option
from .policy_loss import (IMPORTANCE_SAMPLING_LEVELS, KL_ESTIMATORS, LOSS_TYPES, ROLLOUT_IS_MODES,
                          LossConfig, LossTypeParams, PolicyLossOutput, compute_policy_loss, entropy_threshold,
                          rollout_is_weights)

__all__ = [
    "ADVANTAGE_ESTIMATORS", "SCALE_REWARDS", "AdvantageOutput", "compute_advantages", "default_kl_in_reward",
    "default_scale_rewards", "reward_metrics", "sequence_kl_for_reward",
    "COMPLETION_TOKENS", "LOSS_NORMALIZERS", "LOSS_TOKENS", "SEQUENCES", "aggregate_loss", "count_partials",
    "counts_from_masks", "local_loss", "loss_normalizer", "token_coefficients",
    "finalize_metrics", "merge_partials", "policy_metric_partials", "rollout_metric_partials",
    "stack_partials", "unstack_partials", "check_option",
    "IMPORTANCE_SAMPLING_LEVELS", "KL_ESTIMATORS", "LOSS_TYPES", "ROLLOUT_IS_MODES", "LossConfig", "LossTypeParams",
    "PolicyLossOutput",
    "compute_policy_loss", "entropy_threshold", "rollout_is_weights",
]
