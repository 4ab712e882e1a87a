"""Training metrics as rank-reducible partials, finalised after the caller's all-reduce.

A mean over tokens or completions of the whole step is not the mean of per-rank means
(ranks hold different numbers of tokens), so every metric is kept as partials:

    partials = {"sum": {key: 0-d}, "min": {key: 0-d}, "max": {key: 0-d}}   (float64)

Accumulate micro-batches with `merge_partials`; then, per op, `stack_partials` gives one
1-D tensor to all-reduce with SUM / MIN / MAX over the data-parallel group;
`unstack_partials` + `finalize_metrics` give the values. The keys depend only on the
options, never on the data, so every rank stacks the same keys in the same order. An
empty reduction finalises to NaN.

Definitions (ms-swift names; "completion mean" = mean over completions that have at least
one token of the mask, of a per-completion quantity):

kl                      token mean of the per-token KL of the loss, over loss tokens
clip_ratio/low_mean     completion mean of the fraction of its loss tokens clipped below
                        (ratio < 1 - epsilon and A < 0); low_min: min over completions
clip_ratio/high_mean    same above (ratio > 1 + epsilon_high and A > 0); high_max: max
clip_ratio/region_mean  completion mean of the fraction clipped either way
    (ms-swift's docs define these per completion ("sentence"); its code takes per-rank token
    ratios, which depend on the split.) Logged for grpo, bnpo, dr_grpo, dapo and fipo.
cispo_clip_ratio        cispo instead of clip_ratio/*: completion mean of the fraction of its
                        loss tokens with ratio > epsilon_high and A > 0 (the only clip cispo has)
    sapo and real have no hard clip and log neither (as ms-swift).
fipo/future_kl_mean, fipo/influence_weight_mean, fipo/safety_keep_ratio
                        fipo: token means over loss tokens of policy_loss.fipo_influence's
                        F_t, I_t and safety mask (ms-swift's names)
teacher_kl              on-policy distillation (--teacher_model): token mean over the loss
                        tokens of exp(d) - d - 1, d = teacher - old log-prob (ms-swift's k3
                        gauge of the distance to the teacher; it should fall)
entropy/entropy_mean|entropy_max|entropy_min
                        completion mean / max / min of the per-completion mean entropy
                        (Megatron-SWIFT's names)
entropy/entropy_threshold  the top_entropy_quantile threshold used (reduced with MAX: equal on
                        every rank when the caller passes the global threshold)
rollout_correction/     off-policy diagnostics of the sampler (rollout) vs trainer (old)
    log-probs over the completion mask before the overlong filter, lr = old - rollout:
    kl            token mean of -lr (direct estimator of KL(rollout || trainer))
    k3_kl         token mean of exp(lr) - lr - 1 (lr clipped to +-20, result to +-10)
    training_ppl  completion mean of exp(-mean_t old);   training_log_ppl: of -mean_t old
    rollout_ppl   completion mean of exp(-mean_t rollout); rollout_log_ppl: of -mean_t rollout
    log_ppl_diff  completion mean of mean_t rollout - mean_t old (abs_diff, _max, _min too)
    ppl_ratio     completion mean of exp(log_ppl_diff)
    chi2_token    token mean of rho_t^2 - 1, rho_t = exp(clip(lr, +-20))
    chi2_seq      completion mean of rho_seq^2 - 1, rho_seq = exp(clip(mean_t lr, +-20))
  with rollout_importance_sampling_mode set, also:
    is_weight_mean  token mean of the IS weights
    ess             1 / mean((w / (mean(w) + 1e-8))^2), w = weights clipped to [1/C, C]
                    (token means over the step, as ms-swift per rank)
    clipped_frac    token modes: token fraction with rho_t > C;
                    sequence modes: completion fraction whose weight ratio
                    exp(mean_t clip(lr, +-20)) exceeds C

Context parallelism: pass `sequence_sums` (policy_loss's hook: per-row partial sums of
this rank -> sums over the CP group). Every quantity is then taken from whole-row sums
(token sums are sums of row sums), so each CP rank returns the SAME partials, those of
whole completions: reduce them over DP only, never over DP x CP (that would count every
completion cp times).
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

from .options import check_option
from .policy_loss import (LOSS_TYPES, ROLLOUT_IS_MODES, PolicyLossOutput, SequenceSums,
                          rollout_is_weights)

Partials = Dict[str, Dict[str, torch.Tensor]]
_OPS = ("sum", "min", "max")
_NUM, _DEN = "::num", "::den"
_LOG_RATIO_BOUND = 20.0
_K3_BOUND = 10.0


def empty_partials() -> Partials:
    return {op: {} for op in _OPS}


def _f64(x) -> torch.Tensor:
    return torch.as_tensor(x).detach().to(torch.float64)


def _add_mean(p: Partials, name: str, num, den) -> None:
    p["sum"][name + _NUM] = _f64(num)
    p["sum"][name + _DEN] = _f64(den)


def _finite_values(values) -> torch.Tensor:
    v = _f64(values).reshape(-1)
    return v[~torch.isnan(v)]


def _add_min(p: Partials, name: str, values) -> None:
    # +inf is MIN's identity: a rank without completions does not change the result.
    v = _finite_values(values)
    p["min"][name] = v.min() if v.numel() else torch.tensor(float("inf"), dtype=torch.float64, device=v.device)


def _add_max(p: Partials, name: str, values) -> None:
    v = _finite_values(values)
    p["max"][name] = v.max() if v.numel() else torch.tensor(float("-inf"), dtype=torch.float64, device=v.device)


def _row_sums(rows: Dict[str, torch.Tensor],
              sequence_sums: Optional[SequenceSums]) -> Dict[str, torch.Tensor]:
    """{name: [B, L]} -> {name: [B] float64 sum of each row}, over the whole rows.

    One stacked `sequence_sums` call (one all-reduce under CP) for every quantity.
    """
    names = list(rows)
    sums = torch.stack([rows[k].detach().to(torch.float64).sum(dim=-1) for k in names],
                       dim=-1)                                           # [B, k]
    if sequence_sums is not None:
        sums = sequence_sums(sums)
    return dict(zip(names, sums.unbind(-1)))


def policy_metric_partials(out: PolicyLossOutput, *, loss_type: str, epsilon: float,
                           epsilon_high: Optional[float] = None,
                           entropy: Optional[torch.Tensor] = None,
                           sequence_sums: Optional[SequenceSums] = None) -> Partials:
    """kl, clip_ratio/* (or cispo_clip_ratio, fipo/*) and (with `entropy` [B, L]) entropy/*
    partials of one micro-batch.

    sequence_sums: under context parallelism (module docstring); None for whole rows.
    """
    check_option("loss_type", loss_type, LOSS_TYPES)
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    p = empty_partials()
    mask = out.loss_mask                                                 # [B, L] bool
    ratio, adv = out.ratio, out.advantages                               # [B, L]
    rows = {"n": mask}
    if loss_type == "cispo":
        rows["cispo"] = (ratio > epsilon_high) & (adv > 0) & mask
    elif loss_type not in ("sapo", "real"):
        low = (ratio < 1.0 - epsilon) & (adv < 0)
        high = (ratio > 1.0 + epsilon_high) & (adv > 0)
        rows.update(low=low & mask, high=high & mask, region=(low | high) & mask)
    fipo_names = {"future_kl": "fipo/future_kl_mean", "influence_weight": "fipo/influence_weight_mean",
                  "safety_keep": "fipo/safety_keep_ratio"}
    for key in fipo_names if out.fipo is not None else ():
        v = out.fipo[key].detach().to(torch.float64)
        rows["fipo_" + key] = torch.where(mask, v, torch.zeros_like(v))
    if out.per_token_kl is not None:
        rows["kl"] = torch.where(mask, out.per_token_kl.detach(), torch.zeros_like(out.per_token_kl))
    if out.teacher_kl is not None:
        rows["teacher_kl"] = torch.where(mask, out.teacher_kl, torch.zeros_like(out.teacher_kl))
    if entropy is not None:
        rows["entropy"] = torch.where(mask, entropy.detach(), torch.zeros_like(entropy))
    sums = _row_sums(rows, sequence_sums)                                # name -> [B]
    n = sums["n"]                                                        # loss tokens per completion
    has = n > 0                                                          # completions counted
    n_seq, per_seq = has.sum(), n.clamp(min=1.0)

    if out.per_token_kl is not None:
        _add_mean(p, "kl", sums["kl"].sum(), n.sum())
    if out.teacher_kl is not None:
        _add_mean(p, "teacher_kl", sums["teacher_kl"].sum(), n.sum())
    if "cispo" in sums:
        _add_mean(p, "cispo_clip_ratio", (sums["cispo"] / per_seq)[has].sum(), n_seq)
    if "region" in sums:
        low_frac, high_frac, region_frac = ((sums[k] / per_seq)[has] for k in ("low", "high", "region"))
        _add_mean(p, "clip_ratio/low_mean", low_frac.sum(), n_seq)
        _add_mean(p, "clip_ratio/high_mean", high_frac.sum(), n_seq)
        _add_mean(p, "clip_ratio/region_mean", region_frac.sum(), n_seq)
        _add_min(p, "clip_ratio/low_min", low_frac)
        _add_max(p, "clip_ratio/high_max", high_frac)
    for key, name in fipo_names.items() if out.fipo is not None else ():
        _add_mean(p, name, sums["fipo_" + key].sum(), n.sum())

    if entropy is not None:
        seq_ent = (sums["entropy"] / per_seq)[has]                       # [C]
        _add_mean(p, "entropy/entropy_mean", seq_ent.sum(), n_seq)
        _add_min(p, "entropy/entropy_min", seq_ent)
        _add_max(p, "entropy/entropy_max", seq_ent)
    if out.entropy_threshold is not None:
        _add_max(p, "entropy/entropy_threshold", out.entropy_threshold)
    return p


def rollout_metric_partials(old_logps: torch.Tensor, rollout_logps: torch.Tensor, completion_mask: torch.Tensor, *,
                            rollout_importance_sampling_mode: Optional[str] = None,
                            rollout_importance_sampling_threshold: float = 2.0,
                            sequence_sums: Optional[SequenceSums] = None) -> Partials:
    """rollout_correction/* partials of one micro-batch; inputs [B, L], mask before the overlong filter.

    sequence_sums: under context parallelism (module docstring); None for whole rows.
    """
    pre = "rollout_correction/"
    p = empty_partials()
    mask = completion_mask.bool()
    zeros = torch.zeros_like(old_logps, dtype=torch.float64)
    old = torch.where(mask, old_logps.detach().to(torch.float64), zeros)
    rollout = torch.where(mask, rollout_logps.detach().to(torch.float64), zeros)

    lr = old - rollout                                                   # [B, L], 0 off-mask
    lr_safe = lr.clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
    k3 = (torch.exp(lr_safe) - lr_safe - 1.0).clamp(-_K3_BOUND, _K3_BOUND)  # 0 off-mask
    rows = {"n": mask, "neg_lr": -lr, "k3": k3, "lr_safe": lr_safe, "old": old, "rollout": rollout,
            "rho2": torch.where(mask, torch.exp(2.0 * lr_safe), zeros)}
    mode = c = None
    if rollout_importance_sampling_mode is not None:
        mode = check_option("rollout_importance_sampling_mode", rollout_importance_sampling_mode, ROLLOUT_IS_MODES)
        c = rollout_importance_sampling_threshold
        w = torch.where(mask, rollout_is_weights(old, rollout, mask, mode, c, sequence_sums), zeros)  # [B, L]
        w_ess = torch.where(mask, w.clamp(1.0 / c, c), zeros)
        rows.update(w=w, w_ess=w_ess, w_ess2=w_ess ** 2, over=(torch.exp(lr_safe) > c) & mask)
    sums = _row_sums(rows, sequence_sums)                                # name -> [B]
    n = sums["n"]
    has = n > 0                                                          # completions counted
    n_tok, n_seq = n.sum(), has.sum()

    _add_mean(p, pre + "kl", sums["neg_lr"].sum(), n_tok)
    _add_mean(p, pre + "k3_kl", sums["k3"].sum(), n_tok)
    _add_mean(p, pre + "chi2_token", sums["rho2"].sum(), n_tok)          # finalised as mean - 1

    counts = n.clamp(min=1.0)
    mean_old = (sums["old"] / counts)[has]                               # [C]
    mean_roll = (sums["rollout"] / counts)[has]
    diff = mean_roll - mean_old
    seq_lr = (mean_old - mean_roll).clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
    _add_mean(p, pre + "training_ppl", torch.exp(-mean_old).sum(), n_seq)
    _add_mean(p, pre + "training_log_ppl", (-mean_old).sum(), n_seq)
    _add_mean(p, pre + "rollout_ppl", torch.exp(-mean_roll).sum(), n_seq)
    _add_mean(p, pre + "rollout_log_ppl", (-mean_roll).sum(), n_seq)
    _add_mean(p, pre + "log_ppl_diff", diff.sum(), n_seq)
    _add_mean(p, pre + "log_ppl_abs_diff", diff.abs().sum(), n_seq)
    _add_max(p, pre + "log_ppl_diff_max", diff)
    _add_min(p, pre + "log_ppl_diff_min", diff)
    _add_mean(p, pre + "ppl_ratio", torch.exp(diff).sum(), n_seq)
    _add_mean(p, pre + "chi2_seq", torch.exp(2.0 * seq_lr).sum(), n_seq)  # finalised as mean - 1

    if mode is not None:
        _add_mean(p, pre + "is_weight_mean", sums["w"].sum(), n_tok)
        p["sum"][pre + "ess::w1"] = sums["w_ess"].sum()
        p["sum"][pre + "ess::w2"] = sums["w_ess2"].sum()
        p["sum"][pre + "ess" + _DEN] = _f64(n_tok)
        if mode.startswith("token"):
            _add_mean(p, pre + "clipped_frac", sums["over"].sum(), n_tok)
        else:
            # the sequence ratio of the weights: mean of the clipped token log-ratios
            seq_ratio = torch.exp((sums["lr_safe"] / counts)[has])
            _add_mean(p, pre + "clipped_frac", (seq_ratio > c).sum(), n_seq)
    return p


def merge_partials(*parts: Partials) -> Partials:
    """Combine partials of several micro-batches (sum / min / max per key)."""
    out = empty_partials()
    combine = {"sum": torch.add, "min": torch.minimum, "max": torch.maximum}
    for part in parts:
        for op in _OPS:
            for key, value in part.get(op, {}).items():
                have = out[op].get(key)
                out[op][key] = value if have is None else combine[op](have, value.to(have.device))
    return out


def stack_partials(p: Partials) -> Dict[str, torch.Tensor]:
    """{op: 1-D float64 tensor} in sorted key order, ready for all_reduce(op)."""
    stacked = {}
    for op in _OPS:
        keys = sorted(p[op])
        # Partials may sit on different devices (counts from host masks, sums from the
        # model's outputs): stack them on the first one's.
        dev = p[op][keys[0]].device if keys else None
        stacked[op] = (torch.stack([p[op][k].to(dev) for k in keys]) if keys
                       else torch.zeros(0, dtype=torch.float64))
    return stacked


def unstack_partials(stacked: Dict[str, torch.Tensor], like: Partials) -> Partials:
    """Inverse of `stack_partials`; `like` supplies the keys (the pre-reduction partials)."""
    return {op: {k: stacked[op][i] for i, k in enumerate(sorted(like[op]))} for op in _OPS}


def finalize_metrics(p: Partials) -> Dict[str, torch.Tensor]:
    """Reduced partials -> {metric name: 0-d float64}; empty reductions give NaN."""
    nan = torch.tensor(float("nan"), dtype=torch.float64)
    sums = p["sum"]
    out: Dict[str, torch.Tensor] = {}
    for key, num in sums.items():
        if not key.endswith(_NUM):
            continue
        name = key[: -len(_NUM)]
        den = sums[name + _DEN]
        out[name] = num / den if den > 0 else nan.to(num.device)
    for name in ("rollout_correction/chi2_token", "rollout_correction/chi2_seq"):
        if name in out:
            out[name] = out[name] - 1.0
    ess = "rollout_correction/ess"
    if ess + "::w1" in sums:
        den = sums[ess + _DEN]
        if den > 0:
            mean_w = sums[ess + "::w1"] / den
            mean_sq = (sums[ess + "::w2"] / den) / (mean_w + 1e-8) ** 2
            out[ess] = 1.0 / mean_sq.clamp(min=1e-10)
        else:
            out[ess] = nan.to(den.device)
    for op in ("min", "max"):
        for name, value in p[op].items():
            out[name] = value if torch.isfinite(value) else nan.to(value.device)
    return dict(sorted(out.items()))
