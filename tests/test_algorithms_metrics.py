"""Metric partials reduced over simulated ranks equal the metrics of the concatenated batch,
and both equal a loop reference written from ms-swift's definitions."""
import math

import numpy as np
import pytest
import torch

from megatron_grpo.algorithms import (compute_policy_loss, entropy_threshold, finalize_metrics, merge_partials,
                                      policy_metric_partials, rollout_metric_partials, stack_partials,
                                      unstack_partials)
from tests.test_algorithms_policy_loss import make_batch

S, L = 8, 9
RANKS = [[[0, 5], [2]], [[1, 4, 7]], [[3, 6]]]  # three "DP ranks", micro-batches of uneven size


def _mean(xs):
    return sum(xs) / len(xs) if xs else float("nan")


def reference_policy_metrics(bt, o):
    eps, eps_hi = o["epsilon"], o["epsilon_high"]
    mask = bt["mask"].tolist()
    filtered = [bool(t) and o["overlong_filter"] for t in bt["truncated"].tolist()]
    lp, old, ref, ent, adv = (bt[k].tolist() for k in ("logps", "old", "ref", "entropy", "adv"))
    kls, low, high, region, cispo, seq_ent, all_ent = [], [], [], [], [], [], []
    fipo = {"future_kl": [], "weight": [], "keep": []}
    gamma = 2.0 ** (-1 / 32.0)  # fipo's defaults: decay 32, clip [1, 1.2], safety threshold 4
    for i in range(len(mask)):
        toks = [t for t in range(len(mask[i])) if mask[i][t]]
        if filtered[i] or not toks:
            continue
        seq_lr = _mean([lp[i][t] - old[i][t] for t in toks])
        n_low = n_high = n_region = n_cispo = 0
        for t in toks:
            d = max(-20.0, min(20.0, ref[i][t] - lp[i][t]))
            kls.append(max(-10.0, min(10.0, math.exp(d) - d - 1)))
            r = math.exp(lp[i][t] - old[i][t] if o["importance_sampling_level"] == "token" else seq_lr)
            lo, hi = r < 1 - eps and adv[i] < 0, r > 1 + eps_hi and adv[i] > 0
            n_low += lo
            n_high += hi
            n_region += lo or hi
            n_cispo += r > eps_hi and adv[i] > 0
            all_ent.append(ent[i][t])
            f = sum(gamma ** (s - t) * (lp[i][s] - old[i][s]) for s in toks if s >= t)
            keep = not (adv[i] < 0 and r > 4.0)
            w = min(max(math.exp(f), 1.0), 1.2)
            fipo["future_kl"].append(f)
            fipo["weight"].append(w if keep else min(max(w, 0.8), 1.0))
            fipo["keep"].append(float(keep))
        low.append(n_low / len(toks))
        high.append(n_high / len(toks))
        region.append(n_region / len(toks))
        cispo.append(n_cispo / len(toks))
        seq_ent.append(_mean([ent[i][t] for t in toks]))
    out = {
        "kl": _mean(kls),
        "entropy/entropy_mean": _mean(seq_ent), "entropy/entropy_max": max(seq_ent),
        "entropy/entropy_min": min(seq_ent),
        "entropy/entropy_threshold": float(np.quantile(all_ent, 1 - o["top_entropy_quantile"])),
    }
    if o["loss_type"] == "cispo":
        out["cispo_clip_ratio"] = _mean(cispo)
    elif o["loss_type"] != "sapo":  # sapo has no hard clip
        out.update({"clip_ratio/low_mean": _mean(low), "clip_ratio/low_min": min(low),
                    "clip_ratio/high_mean": _mean(high), "clip_ratio/high_max": max(high),
                    "clip_ratio/region_mean": _mean(region)})
    if o["loss_type"] == "fipo":
        out.update({"fipo/future_kl_mean": _mean(fipo["future_kl"]),
                    "fipo/influence_weight_mean": _mean(fipo["weight"]),
                    "fipo/safety_keep_ratio": _mean(fipo["keep"])})
    return out


def reference_rollout_metrics(bt, mode, cap):
    mask = bt["mask"].tolist()
    old, roll = bt["old"].tolist(), bt["rollout"].tolist()
    clip = lambda x: max(-20.0, min(20.0, x))  # noqa: E731
    tok = {k: [] for k in ("kl", "k3", "rho2", "w", "w_ess", "clipped")}
    seq = {k: [] for k in ("tp", "tlp", "rp", "rlp", "diff", "ratio", "chi2", "clipped")}
    for i in range(len(mask)):
        toks = [t for t in range(len(mask[i])) if mask[i][t]]
        if not toks:
            continue
        lrs = [clip(old[i][t] - roll[i][t]) for t in toks]
        rho_seq = math.exp(clip(_mean([old[i][t] - roll[i][t] for t in toks])))
        for t, lr in zip(toks, lrs):
            raw = old[i][t] - roll[i][t]
            tok["kl"].append(-raw)
            tok["k3"].append(max(-10.0, min(10.0, math.exp(lr) - lr - 1)))
            tok["rho2"].append(math.exp(lr) ** 2)
            rho = math.exp(lr)
            w = {"token_truncate": min(rho, cap), "token_mask": rho if rho <= cap else 0.0,
                 "sequence_truncate": min(math.exp(_mean(lrs)), cap),
                 "sequence_mask": rho if math.exp(_mean(lrs)) <= cap else 0.0}[mode]
            tok["w"].append(w)
            tok["w_ess"].append(max(1 / cap, min(cap, w)))
            tok["clipped"].append(rho > cap)
        m_old, m_roll = _mean([old[i][t] for t in toks]), _mean([roll[i][t] for t in toks])
        seq["tp"].append(math.exp(-m_old))
        seq["tlp"].append(-m_old)
        seq["rp"].append(math.exp(-m_roll))
        seq["rlp"].append(-m_roll)
        seq["diff"].append(m_roll - m_old)
        seq["ratio"].append(math.exp(m_roll - m_old))
        seq["chi2"].append(rho_seq ** 2)
        seq["clipped"].append(math.exp(_mean(lrs)) > cap)
    mean_w = _mean(tok["w_ess"])
    ess = 1.0 / max(_mean([(w / (mean_w + 1e-8)) ** 2 for w in tok["w_ess"]]), 1e-10)
    p = "rollout_correction/"
    return {
        p + "kl": _mean(tok["kl"]), p + "k3_kl": _mean(tok["k3"]), p + "chi2_token": _mean(tok["rho2"]) - 1,
        p + "training_ppl": _mean(seq["tp"]), p + "training_log_ppl": _mean(seq["tlp"]),
        p + "rollout_ppl": _mean(seq["rp"]), p + "rollout_log_ppl": _mean(seq["rlp"]),
        p + "log_ppl_diff": _mean(seq["diff"]), p + "log_ppl_abs_diff": _mean([abs(d) for d in seq["diff"]]),
        p + "log_ppl_diff_max": max(seq["diff"]), p + "log_ppl_diff_min": min(seq["diff"]),
        p + "ppl_ratio": _mean(seq["ratio"]), p + "chi2_seq": _mean(seq["chi2"]) - 1,
        p + "is_weight_mean": _mean(tok["w"]), p + "ess": ess,
        p + "clipped_frac": _mean(tok["clipped"]) if mode.startswith("token") else _mean(seq["clipped"]),
    }


def all_reduce_simulated(per_rank):
    """What SUM / MIN / MAX all-reduces of the stacked partials produce."""
    stacked = [stack_partials(p) for p in per_rank]
    reduced = {
        "sum": torch.stack([s["sum"] for s in stacked]).sum(0),
        "min": torch.stack([s["min"] for s in stacked]).amin(0),
        "max": torch.stack([s["max"] for s in stacked]).amax(0),
    }
    return finalize_metrics(unstack_partials(reduced, per_rank[0]))


def _assert_metrics(got, want):
    assert set(got) == set(want), set(got) ^ set(want)
    for key, value in want.items():
        assert float(got[key]) == pytest.approx(value, rel=1e-10, abs=1e-12), key


def _options(loss_type, level):
    # epsilon_high well above epsilon, so that swapping them changes the high-clip counts
    return dict(loss_type=loss_type, epsilon=0.2, epsilon_high=1.1 if loss_type == "cispo" else 0.5,
                importance_sampling_level=level, beta=0.05, overlong_filter=True, top_entropy_quantile=0.6)


def _policy_out(bt, idx, o, threshold):
    return compute_policy_loss(bt["logps"][idx], bt["adv"][idx], bt["mask"][idx], old_logps=bt["old"][idx],
                               ref_logps=bt["ref"][idx], entropy=bt["entropy"][idx],
                               truncated=bt["truncated"][idx], entropy_threshold_value=threshold, **o)


@pytest.mark.parametrize("loss_type,level", [("grpo", "token"), ("dapo", "sequence"), ("cispo", "token"),
                                             ("bnpo", "sequence_token"), ("sapo", "token"), ("fipo", "token")])
def test_policy_metrics_reduce_over_ranks(loss_type, level):
    bt = make_batch(13, b=S, l=L, empty_row=False)
    bt["truncated"][[3, 6]] = True  # rank 2 has only filtered completions
    o = _options(loss_type, level)
    loss_mask = bt["mask"] & ~bt["truncated"].unsqueeze(-1)
    threshold = entropy_threshold(bt["entropy"], o["top_entropy_quantile"], loss_mask)
    kw = dict(loss_type=loss_type, epsilon=o["epsilon"], epsilon_high=o["epsilon_high"])
    per_rank = [merge_partials(*[policy_metric_partials(_policy_out(bt, idx, o, threshold), entropy=bt["entropy"][idx],
                                                        **kw) for idx in rank]) for rank in RANKS]
    reduced = all_reduce_simulated(per_rank)
    everything = list(range(S))
    one_shot = finalize_metrics(policy_metric_partials(_policy_out(bt, everything, o, threshold),
                                                       entropy=bt["entropy"], **kw))
    want = reference_policy_metrics(bt, o)
    _assert_metrics(one_shot, want)
    _assert_metrics(reduced, want)
    # an empty rank alone finalises to NaN rather than failing
    alone = finalize_metrics(per_rank[2])
    assert math.isnan(alone["kl"]) and math.isnan(alone["entropy/entropy_max"])


@pytest.mark.parametrize("mode,cap", [("token_truncate", 1.2), ("token_mask", 1.2), ("sequence_truncate", 1.05),
                                      ("sequence_mask", 1.05)])
def test_rollout_metrics_reduce_over_ranks(mode, cap):
    bt = make_batch(17, b=S, l=L, empty_row=True)
    kw = dict(rollout_importance_sampling_mode=mode, rollout_importance_sampling_threshold=cap)
    part = lambda idx: rollout_metric_partials(bt["old"][idx], bt["rollout"][idx], bt["mask"][idx], **kw)  # noqa
    per_rank = [merge_partials(*[part(idx) for idx in rank]) for rank in RANKS]
    want = reference_rollout_metrics(bt, mode, cap)
    _assert_metrics(all_reduce_simulated(per_rank), want)
    _assert_metrics(finalize_metrics(part(list(range(S)))), want)


def test_rollout_diagnostics_without_correction_have_no_is_metrics():
    bt = make_batch(2, b=S, l=L)
    got = finalize_metrics(rollout_metric_partials(bt["old"], bt["rollout"], bt["mask"]))
    want = reference_rollout_metrics(bt, "token_truncate", 2.0)
    for key in ("is_weight_mean", "ess", "clipped_frac"):
        want.pop("rollout_correction/" + key)
    _assert_metrics(got, want)


def test_keys_do_not_depend_on_data():
    """Every rank must stack the same keys, or the all-reduce mixes metrics up."""
    bt = make_batch(3, b=S, l=L)
    o = _options("grpo", "token")
    full = _policy_out(bt, list(range(S)), o, 0.5)
    bt["truncated"][:] = True
    empty = _policy_out(bt, list(range(S)), o, 0.5)
    a = policy_metric_partials(full, loss_type="grpo", epsilon=0.2, entropy=bt["entropy"])
    b = policy_metric_partials(empty, loss_type="grpo", epsilon=0.2, entropy=bt["entropy"])
    assert {op: sorted(v) for op, v in a.items()} == {op: sorted(v) for op, v in b.items()}


def test_unknown_mode_raises_with_valid_list():
    bt = make_batch(0)
    with pytest.raises(ValueError) as err:
        rollout_metric_partials(bt["old"], bt["rollout"], bt["mask"], rollout_importance_sampling_mode="truncate")
    assert all(repr(v) in str(err.value) for v in ("token_truncate", "token_mask", "sequence_truncate",
                                                    "sequence_mask"))
