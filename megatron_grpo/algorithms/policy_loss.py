"""Per-token GRPO policy loss: importance ratios, clipping variants, KL, entropy mask,
overlong filter and the rollout importance-sampling correction.

Tensors are padded `[B, L]`: B completions (rows), L the longest completion, a boolean
`completion_mask` marking real completion tokens. A caller with packed sequences (THD)
scatters its `[T]` log-probs into this layout first. Under context parallelism each
rank holds its own positions of every row; the sequence-level quantities (sequence
ratios, per-sequence means) then reduce per-row sums across CP ranks (`sequence_sums`,
end of this docstring) instead of reconstructing each completion, as ms-swift does.

Order of operations (ms-swift's Megatron GRPO loss), per token t of completion i:

1. loss mask: completion mask, minus every token of a truncated completion when
   `overlong_filter` is on.
   On-policy distillation (ms-swift's OPD-RL, `teacher_logps` given): the advantage of
   every token gets the teacher's signed log-ratio on the sampled token,
     A_t <- A_i + teacher_kl_coef * (teacher_logp_t - old_logp_t)
   (the k1 estimate of -KL(policy || teacher) as a per-token reward), and `teacher_kl`
   holds the k3 estimate exp(d) - d - 1, d = teacher - old, for the metric.
2. log importance weight, from log r_t = logp_t - old_logp_t
   (`old_logps` None means on-policy: old = logp detached, ratio 1 with gradient):
     token           w_t = log r_t
     sequence        w_t = mean_t' log r_t' over the completion (GSPO), shape [B, 1]
     sequence_token  w_t = logp_t - sg(logp_t) + sg(mean_t' log r_t') (GSPO-token)
   coef1 = exp(w).
3. policy term by `loss_type` (A_t the advantage, eps_lo = epsilon, eps_hi = epsilon_high):
     grpo | bnpo | dr_grpo | dapo:
        coef2 = clip(coef1, 1 - eps_lo, 1 + eps_hi);  coef1 <- min(coef1, delta) if delta
        (two-sided clipping, TRL's `delta`); l = -min(coef1 A, coef2 A)
     cispo: l = -sg(min(coef1, eps_hi)) * A * logp_t  (TRL/ms-swift: eps_hi is an absolute
        cap on the ratio here, e.g. 5.0; `delta` does not apply)
     sapo (SAPO, https://arxiv.org/abs/2511.20347): a soft gate instead of the clip,
        l = -g_tau(coef1) * A,  g_tau(r) = sigmoid(tau (r - 1)) * 4 / tau,
        tau = tau_pos where A > 0 else tau_neg (its gradient at r = 1 is 1, as the ratio's;
        epsilon and `delta` do not apply)
     fipo (FIPO, https://arxiv.org/abs/2603.19835): the grpo term times a detached influence
        weight from the discounted future KL of each token (`fipo_influence`):
        l = -min(coef1 A, coef2 A) * sg(I_t)
     real (REAL, https://arxiv.org/abs/2602.05630): a group-level loss on the sequence
        scores S_i = mean_t (logp_t - old_t) (token log-ratios, whatever the importance-
        sampling level), `real_row_losses`; the rows of one group (num_generations
        consecutive rows, so a micro-batch holds whole groups) split by their advantage
        into P (A_i > 0) and N (A_i <= 0); only groups with both contribute:
          loss_g = log(1 + sum_{i in N} exp(S_i / tau)) + log(1 + sum_{i in P} exp(-S_i / tau)),
        tau = real_tau. Steps 4 and 6 do not apply (LossConfig refuses them), and the KL
        term of step 5 is NOT added to the per-token loss: REAL normalises it on its own
        (token mean, aggregation.py), so it comes back in `per_token_kl` only.
4. `top_entropy_quantile` q < 1: l <- l * [H_t >= tau], tau the (1 - q) quantile of the
   entropies of the loss-mask tokens (`entropy_threshold`; pass the global tau in
   distributed use). The KL term below is not masked (ms-swift).
5. `beta` != 0 and not `kl_in_reward`: l <- l + beta * KL_t, KL_t one of
     k1 = logp - ref,  k2 = (logp - ref)^2 / 2,
     k3 = exp(ref - logp) - (ref - logp) - 1 (default; ms-swift clamps ref - logp to
          [-20, 20] and the result to [-10, 10], and so do we).
6. rollout importance sampling (`rollout_importance_sampling_mode`), weights from the
   sampling engine's log-probs, detached: rho_t = exp(clip(old_t - rollout_t, -20, 20)),
   C = `rollout_importance_sampling_threshold`, rho_seq = exp(mean_t clip(old - rollout)):
     token_truncate     W_t = min(rho_t, C)
     token_mask         W_t = rho_t if rho_t <= C else 0
     sequence_truncate  W_t = min(rho_seq, C)
     sequence_mask      W_t = rho_t if rho_seq <= C else 0
   l <- l * W_t (the KL term included).
7. off-policy sequence mask (`off_policy_sequence_mask_delta` d, DeepSeek-V3.2): drop every
   token of completion i from the loss mask when
     mean_t (behaviour_t - logp_t) > d  and  A_i < 0,
   behaviour = the rollout log-probs when given, else the old ones (ms-swift); A_i the
   completion's mean advantage. Applied to the loss mask, so it acts on whatever the
   aggregation does with it (ms-swift masks completion_mask before aggregating).

Every per-token input (logps, old/ref/rollout log-probs, [B, L] advantages, entropy) may
hold anything in its padding, NaN and inf included: each is passed through `torch.where`
with the mask before any arithmetic, so neither the loss nor the gradient sees it (a
multiplication by the mask would not do: NaN * 0 = NaN, and a NaN that reaches a
per-row reduction poisons the whole row's gradient at the sequence levels).

The result is the per-token loss, zero outside the loss mask; `aggregation` turns it into
the step's loss.

Context parallelism (CP): each CP rank holds some positions of every row. Every
per-sequence mean above (the sequence importance weight, the sequence rollout IS
ratio) is a ratio of two per-row sums, so a caller under CP passes `sequence_sums`: a
function [B, k] per-row partial sums of this rank's tokens -> the sums over the whole
row (an all-reduce over the CP group, differentiable for the sequence-level weights).
None means the rows are whole (the default, and CP=1).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, NamedTuple, Optional

import torch

from .options import check_option

IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence", "sequence_token")
ROLLOUT_IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")

# Safety bounds of ms-swift: log-ratios beyond +-20 come from padding or a broken engine.
_LOG_RATIO_BOUND = 20.0
_K3_BOUND = 10.0


# [B, k] per-row partial sums of this rank -> [B, k] sums over the whole rows (see above).
SequenceSums = Callable[[torch.Tensor], torch.Tensor]


def masked_sequence_mean(x: torch.Tensor, mask: torch.Tensor,
                         sequence_sums: Optional[SequenceSums] = None) -> torch.Tensor:
    """Per-row mean of x [B, L] over mask [B, L] -> [B]; 0 for an empty row.

    sequence_sums: under CP, completes this rank's per-row (sum, count) into the whole
    row's (module docstring); None when each row is whole.
    """
    mask = mask.to(x.dtype)
    if sequence_sums is None:
        return (x * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1.0)
    sums = sequence_sums(torch.stack([(x * mask).sum(dim=-1), mask.sum(dim=-1)], dim=-1))  # [B, 2]
    return sums[:, 0] / sums[:, 1].clamp(min=1.0)


# ---- KL estimators: fn(logps [B, L], ref_logps [B, L]) -> [B, L] -------------------------

def kl_k1(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    return logps - ref_logps


def kl_k2(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logps - ref_logps) ** 2


def kl_k3(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    d = torch.clamp(ref_logps - logps, min=-_LOG_RATIO_BOUND, max=_LOG_RATIO_BOUND)
    return torch.clamp(torch.exp(d) - d - 1.0, min=-_K3_BOUND, max=_K3_BOUND)


KL_ESTIMATORS: Dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "k1": kl_k1, "k2": kl_k2, "k3": kl_k3,
}


@dataclass(frozen=True)
class LossTypeParams:
    """Hyper-parameters of single loss types (ms-swift's option names and defaults).

    One object travels from the config to `compute_policy_loss`, so a new loss type's
    option is a field here and in the config group, nothing in between.
    """
    tau_pos: float = 1.0                          # sapo: gate temperature where A > 0
    tau_neg: float = 1.05                         # sapo: gate temperature where A <= 0
    fipo_decay_rate: float = 32.0                 # fipo: half-life (tokens) of the future-KL discount
    fipo_clip_range: Optional[float] = 0.2        # fipo: influence clipped to 1 +- this; None/0: off
    fipo_clip_high_only: bool = True              # fipo: clip to [1, 1 + range] instead
    fipo_safety_threshold: Optional[float] = 4.0  # fipo: A < 0 and ratio above it -> I in [0.8, 1]
    real_tau: float = 0.5                         # real: temperature of the sequence scores
    num_generations: int = 1                      # real: rows per group (consecutive rows)

    def __post_init__(self) -> None:
        for name in ("tau_pos", "tau_neg", "fipo_decay_rate", "real_tau", "num_generations"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be > 0")
        if self.fipo_clip_range is not None and self.fipo_clip_range < 0:
            raise ValueError(f"fipo_clip_range={self.fipo_clip_range!r} must be >= 0 (or None: no clip)")


# ---- policy terms: fn(coef1, advantages, logps, epsilon_low, epsilon_high, delta, params) -> per-token loss

def clipped_surrogate(coef1: torch.Tensor, advantages: torch.Tensor, logps: torch.Tensor,
                      epsilon_low: float, epsilon_high: float, delta: Optional[float],
                      params: LossTypeParams) -> torch.Tensor:
    """PPO clipped objective, negated; `delta` caps the unclipped ratio (two-sided clipping)."""
    coef2 = torch.clamp(coef1, 1.0 - epsilon_low, 1.0 + epsilon_high)
    if delta is not None:
        coef1 = torch.clamp(coef1, max=delta)
    return -torch.min(coef1 * advantages, coef2 * advantages)


def cispo_surrogate(coef1: torch.Tensor, advantages: torch.Tensor, logps: torch.Tensor,
                    epsilon_low: float, epsilon_high: float, delta: Optional[float],
                    params: LossTypeParams) -> torch.Tensor:
    """CISPO: REINFORCE on logp weighted by the detached, upper-clipped IS ratio."""
    weight = torch.clamp(coef1, max=epsilon_high).detach()
    return -weight * advantages * logps


def sapo_surrogate(coef1: torch.Tensor, advantages: torch.Tensor, logps: torch.Tensor,
                   epsilon_low: float, epsilon_high: float, delta: Optional[float],
                   params: LossTypeParams) -> torch.Tensor:
    """SAPO: -g_tau(r) A with the soft gate g_tau(r) = sigmoid(tau (r - 1)) 4 / tau."""
    def gate(tau: float) -> torch.Tensor:
        return torch.sigmoid(tau * (coef1 - 1.0)) * (4.0 / tau)
    return -torch.where(advantages > 0, gate(params.tau_pos), gate(params.tau_neg)) * advantages


def real_surrogate(coef1: torch.Tensor, advantages: torch.Tensor, logps: torch.Tensor,
                   epsilon_low: float, epsilon_high: float, delta: Optional[float],
                   params: LossTypeParams) -> torch.Tensor:
    """REAL has no per-token term: compute_policy_loss builds it from whole rows."""
    return torch.zeros_like(logps)


# loss_type -> policy term. How each loss_type is normalised lives in aggregation.py;
# fipo's influence weight and real's group loss are applied in compute_policy_loss (they
# need whole rows).
LOSS_TYPES: Dict[str, Callable[..., torch.Tensor]] = {
    "grpo": clipped_surrogate,
    "bnpo": clipped_surrogate,
    "dr_grpo": clipped_surrogate,
    "dapo": clipped_surrogate,
    "cispo": cispo_surrogate,
    "sapo": sapo_surrogate,
    "fipo": clipped_surrogate,
    "real": real_surrogate,
}


def real_row_losses(scores: torch.Tensor, seq_advantages: torch.Tensor, has_tokens: torch.Tensor,
                    num_generations: int, real_tau: float) -> torch.Tensor:
    """REAL's group loss, spread over the rows of each group -> [B] row values v_i.

    scores [B] S_i (mean token log-ratio, with gradient), seq_advantages [B] A_i,
    has_tokens [B] bool (the row has loss tokens); rows i*G .. i*G+G-1 form group i,
    G = num_generations. With P = {A_i > 0}, N = {A_i <= 0} of a group g that has both:
        loss_g = logsumexp([0, S_N / tau]) + logsumexp([0, -S_P / tau])
    and v_i = loss_g * G / k_g on the k_g rows of g that have tokens (0 elsewhere), so
    the grpo weighting (1/n_i per token, 1/S over the step's S rows; aggregation.py)
    gives sum_g loss_g / (S / G): the mean over the step's groups, groups without both
    signs counting as 0 -- ms-swift's per micro-batch sum over valid groups / groups.
    """
    b = scores.shape[0]
    if b % num_generations:
        raise ValueError(f"loss_type='real' needs whole groups in a micro-batch: {b} rows is not a "
                         f"multiple of num_generations={num_generations}")
    s = (scores / real_tau).view(-1, num_generations)                                # [g, G]
    pos = (seq_advantages > 0).view(-1, num_generations)                             # [g, G]
    valid = pos.any(dim=1) & (~pos).any(dim=1)                                       # [g]
    zero = torch.zeros_like(s[:, :1])
    neg_inf = torch.full_like(s, float("-inf"))
    neg = torch.logsumexp(torch.cat([torch.where(pos, neg_inf, s), zero], dim=1), dim=1)
    pos_l = torch.logsumexp(torch.cat([torch.where(pos, -s, neg_inf), zero], dim=1), dim=1)
    group_loss = torch.where(valid, neg + pos_l, torch.zeros_like(neg))              # [g]
    rows = has_tokens.view(-1, num_generations)
    k = rows.sum(dim=1, keepdim=True).clamp(min=1).to(s.dtype)                        # [g, 1]
    v = group_loss.unsqueeze(-1) * num_generations / k                               # [g, G]
    return torch.where(rows, v, torch.zeros_like(v)).reshape(b)


def off_policy_sequence_keep(logps: torch.Tensor, behaviour_logps: torch.Tensor,
                             seq_advantages: torch.Tensor, mask: torch.Tensor, delta: float,
                             sequence_sums: Optional[SequenceSums] = None) -> torch.Tensor:
    """Off-policy sequence mask -> [B] bool, False for the completions to drop:
    mean_t (behaviour_t - logp_t) over `mask` > delta and A_i < 0 (module docstring, 7)."""
    gap = masked_sequence_mean((behaviour_logps - logps).detach(), mask, sequence_sums)  # [B]
    return ~((gap > delta) & (seq_advantages < 0))


def discounted_suffix_sum(d: torch.Tensor, gamma: float, block: int = 128) -> torch.Tensor:
    """F_t = sum_{s >= t} gamma^(s - t) d_s along the last dim of d [B, L] -> [B, L].

    Blocks of `block` positions from the end: inside a block a [c, c] matmul with the
    upper-triangular decay matrix, across blocks the recurrence
    F_t = (block-local part) + gamma^(end - t) F_end, so memory stays O(B L + block^2)
    and work O(B L block) instead of an [L, L] matrix.
    """
    n = d.shape[-1]
    out = []
    carry = torch.zeros_like(d[..., :1])                                            # F_end, [B, 1]
    for start in reversed(range(0, n, block)):
        end = min(n, start + block)
        t = torch.arange(start, end, device=d.device, dtype=d.dtype)
        dist = t.unsqueeze(0) - t.unsqueeze(1)                                      # [c, c]: s - t
        decay = torch.where(dist >= 0, gamma ** dist.clamp(min=0), torch.zeros_like(dist))
        blk = d[..., start:end] @ decay.t() + carry * gamma ** (end - t)            # [B, c]
        out.append(blk)
        carry = blk[..., :1]
    return torch.cat(out[::-1], dim=-1) if out else d.clone()


def fipo_influence(log_ratio: torch.Tensor, coef1: torch.Tensor, advantages: torch.Tensor,
                   mask: torch.Tensor, delta: Optional[float],
                   params: LossTypeParams) -> Dict[str, torch.Tensor]:
    """FIPO's detached influence weight and its diagnostics, all [B, L].

    log_ratio [B, L] = logp - old (token level, whatever the importance-sampling level),
    coef1 the importance weight ([B, L] or [B, 1]), mask [B, L] the loss mask.
    With d_t = log_ratio_t on mask tokens (0 elsewhere, and 0 where coef1 > delta if
    `delta` is set) and gamma = 2 ** (-1 / fipo_decay_rate):
        F_t = sum_{s >= t} gamma^(s - t) d_s                 (discounted future KL)
        I_t = clip(exp(F_t), lo, 1 + fipo_clip_range),  lo = 1 if fipo_clip_high_only
              else 1 - fipo_clip_range                      (no clip when the range is None/0)
        I_t <- clip(I_t, 0.8, 1.0) where A_t < 0 and coef1_t > fipo_safety_threshold
    Returns {"future_kl": F, "influence_weight": I, "safety_keep": bool mask of tokens
    the safety rule left alone}.
    """
    d = torch.where(mask, log_ratio.detach(), torch.zeros_like(log_ratio))          # [B, L]
    if delta is not None:
        d = torch.where((coef1.detach() > delta).expand_as(d), torch.zeros_like(d), d)
    gamma = 2.0 ** (-1.0 / params.fipo_decay_rate)
    future_kl = torch.where(mask, discounted_suffix_sum(d, gamma), torch.zeros_like(d))  # [B, L]
    weight = torch.exp(future_kl)
    if params.fipo_clip_range:
        lo = 1.0 if params.fipo_clip_high_only else 1.0 - params.fipo_clip_range
        weight = torch.clamp(weight, lo, 1.0 + params.fipo_clip_range)
    keep = torch.ones_like(mask)
    if params.fipo_safety_threshold is not None:
        keep = ~((advantages < 0) & (coef1.detach() > params.fipo_safety_threshold))
        weight = torch.where(keep, weight, torch.clamp(weight, 0.8, 1.0))
    return {"future_kl": future_kl, "influence_weight": weight, "safety_keep": keep}


def log_importance_weights(logps: torch.Tensor, old_logps: torch.Tensor, mask: torch.Tensor,
                           importance_sampling_level: str,
                           sequence_sums: Optional[SequenceSums] = None) -> torch.Tensor:
    """logps, old_logps, mask [B, L] -> log importance weight [B, L] ([B, 1] for 'sequence').

    sequence_sums: see the module docstring (CP); it must pass gradients for 'sequence'.
    """
    check_option("importance_sampling_level", importance_sampling_level, IMPORTANCE_SAMPLING_LEVELS)
    log_ratio = logps - old_logps
    if importance_sampling_level == "token":
        return log_ratio
    seq = masked_sequence_mean(log_ratio, mask, sequence_sums).unsqueeze(-1)  # [B, 1]
    if importance_sampling_level == "sequence":
        return seq
    # sequence_token: the sequence ratio as value, each token's own gradient.
    return logps - logps.detach() + seq.detach()


def quantile(values: torch.Tensor, q: float) -> torch.Tensor:
    """Linear-interpolation quantile of a 1-D tensor (numpy's default); NaN when empty.

    Sorting instead of torch.quantile, which refuses inputs over 2**24 elements (a step's
    gathered entropies can exceed that).
    """
    n = values.numel()
    if n == 0:
        return torch.full((), float("nan"), dtype=values.dtype, device=values.device)
    ordered = values.reshape(-1).sort().values
    pos = q * (n - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, n - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def entropy_threshold(entropy: torch.Tensor, top_entropy_quantile: float,
                      mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Entropy below which tokens get no policy loss: the (1 - q) quantile -> 0-d tensor.

    entropy: any shape; mask: same shape (tokens to consider), or None for all non-NaN
    values (e.g. the entropies of every loss token gathered from all ranks).
    """
    if not 0.0 < top_entropy_quantile <= 1.0:
        raise ValueError(f"top_entropy_quantile={top_entropy_quantile!r} must be in (0, 1]")
    values = entropy.detach()
    values = values[mask.bool()] if mask is not None else values.reshape(-1)
    values = values[~torch.isnan(values)]
    return quantile(values, 1.0 - top_entropy_quantile)


def loss_mask_after_overlong_filter(completion_mask: torch.Tensor, truncated: Optional[torch.Tensor],
                                    overlong_filter: bool) -> torch.Tensor:
    """completion_mask [B, L], truncated [B] -> loss mask [B, L] (bool)."""
    mask = completion_mask.bool()
    if overlong_filter:
        if truncated is None:
            raise ValueError("overlong_filter=True needs the per-completion `truncated` flags")
        mask = mask & ~truncated.bool().unsqueeze(-1)
    return mask


def rollout_is_weights(old_logps: torch.Tensor, rollout_logps: torch.Tensor, completion_mask: torch.Tensor,
                       rollout_importance_sampling_mode: str,
                       rollout_importance_sampling_threshold: float,
                       sequence_sums: Optional[SequenceSums] = None) -> torch.Tensor:
    """Detached IS weights [B, L] correcting for the sampler/trainer mismatch (see module doc).

    sequence_sums: see the module docstring (CP; used by the sequence modes).
    """
    mode = check_option("rollout_importance_sampling_mode", rollout_importance_sampling_mode, ROLLOUT_IS_MODES)
    threshold = rollout_importance_sampling_threshold
    if not threshold > 0:
        raise ValueError(f"rollout_importance_sampling_threshold={threshold!r} must be > 0")
    mask = completion_mask.bool()
    log_ratio = torch.clamp((old_logps - rollout_logps).detach(), -_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
    log_ratio = torch.where(mask, log_ratio, torch.zeros_like(log_ratio))
    ratio = torch.exp(log_ratio)                                           # [B, L]
    if mode == "token_truncate":
        return torch.clamp(ratio, max=threshold)
    if mode == "token_mask":
        return torch.where(ratio <= threshold, ratio, torch.zeros_like(ratio))
    seq_ratio = torch.exp(masked_sequence_mean(log_ratio, mask, sequence_sums)).unsqueeze(-1)  # [B, 1]
    if mode == "sequence_truncate":
        return torch.clamp(seq_ratio, max=threshold).expand_as(ratio)
    return ratio * (seq_ratio <= threshold).to(ratio.dtype)  # sequence_mask


class PolicyLossOutput(NamedTuple):
    per_token_loss: torch.Tensor                 # [B, L], 0 outside loss_mask
    loss_mask: torch.Tensor                      # [B, L] bool: completion mask minus filtered completions
    ratio: torch.Tensor                          # [B, L] detached exp(log importance weight), before delta
    advantages: torch.Tensor                     # [B, L] advantages broadcast per token
    per_token_kl: Optional[torch.Tensor]         # [B, L] KL estimate (None without a KL term)
    is_weights: Optional[torch.Tensor]           # [B, L] rollout IS weights (None when off)
    entropy_mask: Optional[torch.Tensor]         # [B, L] bool (None without top_entropy_quantile)
    entropy_threshold: Optional[torch.Tensor]    # 0-d threshold used (None without it)
    fipo: Optional[Dict[str, torch.Tensor]] = None  # fipo only: `fipo_influence`'s [B, L] tensors
    teacher_kl: Optional[torch.Tensor] = None    # [B, L] k3 of teacher vs old (with teacher_logps)


def _zero_outside(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # `where`, not `* mask`: padding may hold NaN/inf (e.g. entropy padded with NaN), and
    # NaN * 0 is NaN; `where` also sends exactly zero gradient to those positions.
    return torch.where(mask, x, torch.zeros_like(x))


@dataclass(frozen=True)
class LossConfig:
    """The options of the per-token loss (ms-swift's names and defaults), built once per run
    and passed whole to `compute_policy_loss`: a new loss option is a field here, its
    config option, and its test (docs/architecture.md, "Options travel whole"). Checked on
    construction, so a bad value fails before any start-up.
    """
    loss_type: str = "grpo"
    epsilon: float = 0.2
    epsilon_high: Optional[float] = None              # None: epsilon
    delta: Optional[float] = None                     # two-sided clipping cap; None: off
    importance_sampling_level: str = "token"
    beta: float = 0.0
    kl_estimator: str = "k3"
    kl_in_reward: bool = False
    top_entropy_quantile: float = 1.0
    overlong_filter: bool = False
    rollout_importance_sampling_mode: Optional[str] = None
    rollout_importance_sampling_threshold: float = 2.0
    off_policy_sequence_mask_delta: Optional[float] = None  # None: off
    teacher_kl_coef: float = 1.0                      # weight of the teacher's log-ratio
    loss_params: LossTypeParams = LossTypeParams()    # sapo / fipo / real options

    def __post_init__(self) -> None:
        check_option("loss_type", self.loss_type, LOSS_TYPES)
        check_option("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        check_option("importance_sampling_level", self.importance_sampling_level,
                     IMPORTANCE_SAMPLING_LEVELS)
        if self.rollout_importance_sampling_mode is not None:
            check_option("rollout_importance_sampling_mode", self.rollout_importance_sampling_mode,
                         ROLLOUT_IS_MODES)
        if not 0.0 < self.top_entropy_quantile <= 1.0:
            raise ValueError(f"top_entropy_quantile={self.top_entropy_quantile!r} must be in (0, 1]")
        if self.loss_type == "real":
            # REAL's loss lives on sequence scores: these per-token options would change nothing.
            for name, off in (("top_entropy_quantile", 1.0), ("rollout_importance_sampling_mode", None),
                              ("importance_sampling_level", "token")):
                if getattr(self, name) != off:
                    raise ValueError(f"loss_type='real' does not use {name} (got {getattr(self, name)!r}); "
                                     f"leave it at {off!r}")


def compute_policy_loss(
    logps: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    config: Optional[LossConfig] = None,
    *,
    old_logps: Optional[torch.Tensor] = None,
    ref_logps: Optional[torch.Tensor] = None,
    entropy: Optional[torch.Tensor] = None,
    entropy_threshold_value: Optional[torch.Tensor | float] = None,
    truncated: Optional[torch.Tensor] = None,
    rollout_logps: Optional[torch.Tensor] = None,
    teacher_logps: Optional[torch.Tensor] = None,
    sequence_sums: Optional[SequenceSums] = None,
    **options,
) -> PolicyLossOutput:
    """Per-token GRPO loss of a micro-batch (module docstring gives the formulas).

    logps [B, L] current policy log-probs (with grad); advantages [B] or [B, L];
    completion_mask [B, L]; old/ref/rollout/teacher logps and entropy [B, L]; truncated [B].
    Padding (completion_mask False) of every [B, L] input may hold anything, NaN/inf too.
    `config`: the loss options (`LossConfig`, built once per run); a one-off call may give
    them as keywords instead (`LossConfig`'s field names), not both.
    `entropy_threshold_value`: the global threshold in distributed use; None computes
    it from this call's loss tokens (under CP pass it: this rank holds part of the rows).
    `sequence_sums`: under CP, the per-row sum reduction (module docstring).
    """
    c = _loss_config(config, options)
    _check_inputs(c, ref_logps=ref_logps, entropy=entropy, rollout_logps=rollout_logps,
                  sequence_sums=sequence_sums)
    mask = completion_mask.bool()                                          # [B, L]
    loss_mask = loss_mask_after_overlong_filter(mask, truncated, c.overlong_filter)
    # Padding positions of the inputs may hold anything; make them 0 so no NaN/inf reaches
    # either the loss or the gradient.
    logps = _zero_outside(logps, mask)
    old = logps.detach() if old_logps is None else _zero_outside(old_logps.detach(), mask)
    adv, teacher_kl = _token_advantages(advantages, logps, old, mask, teacher_logps, c)
    if c.off_policy_sequence_mask_delta is not None:
        behaviour = old if rollout_logps is None else _zero_outside(rollout_logps.detach(), mask)
        seq_adv = masked_sequence_mean(adv, loss_mask, sequence_sums)                # [B]
        keep = off_policy_sequence_keep(logps, behaviour, seq_adv, loss_mask,
                                        c.off_policy_sequence_mask_delta, sequence_sums)
        loss_mask = loss_mask & keep.unsqueeze(-1)

    is_weights = None
    if c.rollout_importance_sampling_mode is not None:
        is_weights = rollout_is_weights(old, _zero_outside(rollout_logps.detach(), mask), mask,
                                        c.rollout_importance_sampling_mode,
                                        c.rollout_importance_sampling_threshold, sequence_sums)

    per_token, coef1, fipo = _loss_type_terms(logps, old, adv, mask, loss_mask, c, sequence_sums)

    entropy_mask = threshold = None
    if c.top_entropy_quantile < 1.0:
        entropy_mask, threshold = _entropy_mask(entropy, mask, loss_mask, c.top_entropy_quantile,
                                                entropy_threshold_value)
        per_token = per_token * entropy_mask.to(per_token.dtype)

    per_token_kl = None
    if c.beta != 0.0 and not c.kl_in_reward:
        per_token_kl = KL_ESTIMATORS[c.kl_estimator](logps, _zero_outside(ref_logps.detach(), mask))
        if c.loss_type != "real":     # real: normalised apart (aggregation.py)
            per_token = per_token + c.beta * per_token_kl

    if is_weights is not None:
        per_token = per_token * is_weights

    return PolicyLossOutput(
        per_token_loss=_zero_outside(per_token, loss_mask),
        loss_mask=loss_mask,
        ratio=coef1.detach().expand_as(logps),
        advantages=adv,
        per_token_kl=per_token_kl,
        is_weights=is_weights,
        entropy_mask=entropy_mask,
        entropy_threshold=threshold,
        fipo=fipo,
        teacher_kl=teacher_kl,
    )


def _loss_config(config: Optional[LossConfig], options: dict) -> LossConfig:
    """`config`, or one built from the keyword options of a one-off call (never both: two
    sources of the same option would leave one of them silently ignored)."""
    if config is None:
        return LossConfig(**options)
    if options:
        raise TypeError(f"compute_policy_loss: pass the loss options either as `config` or as "
                        f"keywords, not both (got {sorted(options)})")
    return config


def _check_inputs(c: LossConfig, *, ref_logps, entropy, rollout_logps, sequence_sums) -> None:
    """Refuse a call that lacks an input its options need, before any tensor work: a missing
    input would otherwise surface as a shape or None error far from its cause."""
    if c.rollout_importance_sampling_mode is not None and rollout_logps is None:
        raise ValueError(f"rollout_importance_sampling_mode={c.rollout_importance_sampling_mode!r} "
                         "needs rollout_logps (the sampling engine's log-probs)")
    if c.beta != 0.0 and not c.kl_in_reward and ref_logps is None:
        raise ValueError("beta != 0 with kl_in_reward=False needs ref_logps")
    if c.top_entropy_quantile < 1.0 and entropy is None:
        raise ValueError(f"top_entropy_quantile={c.top_entropy_quantile} needs the per-token entropy")
    if c.loss_type == "fipo" and sequence_sums is not None:
        raise ValueError("loss_type='fipo' is not supported with context parallelism yet (its future KL "
                         "runs along whole rows); use --context_parallel_size 1 or another loss_type")


def _token_advantages(advantages: torch.Tensor, logps: torch.Tensor, old: torch.Tensor,
                      mask: torch.Tensor, teacher_logps: Optional[torch.Tensor],
                      c: LossConfig) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(advantages [B, L], teacher k3 [B, L] or None): the advantages broadcast per token,
    plus the teacher's weighted log-ratio to the old policy under on-policy distillation
    (module docstring, step 1); 0 outside `mask`."""
    adv = advantages.detach()
    adv = (adv.unsqueeze(-1) if adv.dim() == 1 else adv).to(logps.dtype).expand_as(logps)  # [B, L]
    teacher_kl = None
    if teacher_logps is not None:
        if c.loss_type in ("real", "fipo"):
            raise ValueError(f"loss_type={c.loss_type!r} needs one advantage per completion; a "
                             "teacher's per-token advantages work with the other loss types")
        d = _zero_outside(teacher_logps.detach(), mask) - old
        adv = adv + c.teacher_kl_coef * d
        teacher_kl = _zero_outside(torch.exp(d) - d - 1, mask)
    return _zero_outside(adv, mask), teacher_kl  # per-token advantages have padding too


def _loss_type_terms(logps: torch.Tensor, old: torch.Tensor, adv: torch.Tensor,
                     mask: torch.Tensor, loss_mask: torch.Tensor, c: LossConfig,
                     sequence_sums: Optional[SequenceSums]):
    """(per-token loss [B, L], importance weight exp(log w), fipo's tensors or None): the
    loss of `c.loss_type` before the entropy mask, KL term and rollout IS weights."""
    epsilon_high = c.epsilon if c.epsilon_high is None else c.epsilon_high
    log_w = log_importance_weights(logps, old, mask, c.importance_sampling_level,
                                   sequence_sums)                              # [B, L] | [B, 1]
    coef1 = torch.exp(log_w)
    per_token = LOSS_TYPES[c.loss_type](coef1, adv, logps, c.epsilon, epsilon_high, c.delta,
                                        c.loss_params).expand_as(logps)
    fipo = None
    if c.loss_type == "fipo":
        fipo = fipo_influence(logps - old, coef1, adv, loss_mask, c.delta, c.loss_params)
        per_token = per_token * fipo["influence_weight"]
    if c.loss_type == "real":
        # Scores and advantages over the final loss mask (an emptied row: score 0, A 0), as ms-swift.
        scores = masked_sequence_mean(logps - old, loss_mask, sequence_sums)          # [B]
        seq_adv = masked_sequence_mean(adv, loss_mask, sequence_sums)                 # [B]
        n = loss_mask.sum(dim=-1).to(logps.dtype)
        n = n if sequence_sums is None else sequence_sums(n.unsqueeze(-1))[:, 0]
        per_token = real_row_losses(scores, seq_adv, n > 0, c.loss_params.num_generations,
                                    c.loss_params.real_tau).unsqueeze(-1).expand_as(logps)
    return per_token, coef1, fipo


def _entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, loss_mask: torch.Tensor,
                  quantile: float, threshold_value):
    """(bool mask [B, L], 0-d threshold): the tokens whose entropy reaches the threshold,
    `threshold_value` when given (the global one in distributed use), else this call's
    `quantile` over its loss tokens."""
    ent = _zero_outside(entropy.detach(), mask)
    if threshold_value is None:
        threshold = entropy_threshold(ent, quantile, loss_mask)
    else:
        threshold = torch.as_tensor(threshold_value, dtype=ent.dtype, device=ent.device)
    return ent >= threshold, threshold  # NaN threshold (no tokens anywhere) masks everything
