"""Advantages and reward metrics against float64 references written from the formulas
(python loops over groups with the `statistics` module, not the implementation)."""
import math
import statistics

import pytest
import torch

from megatron_grpo.algorithms import advantages as adv_mod
from megatron_grpo.algorithms.advantages import compute_advantages, sequence_kl_for_reward

K = 4          # num_generations
G = 5          # prompts
F = 3          # reward functions


def _rewards(seed, nan=False, ties=False):
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(G * K, F, generator=g, dtype=torch.float64)
    if ties:  # a group where every completion scores the same
        r[:K] = 1.0
    if nan:   # reward functions that abstain on some completions
        r[1, 0] = float("nan")
        r[6, 2] = float("nan")
        r[K * 2:K * 2 + K - 1, 1] = float("nan")  # only one value left in that group
    return r


def _std(xs):
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def _ref_advantages(rpf, weights, estimator, scale, k, beta=0.0, kl=None):
    rows = rpf.tolist()
    n = len(rows)
    total = []
    for i, row in enumerate(rows):
        s = sum(w * x for w, x in zip(weights, row) if not math.isnan(x))
        if kl is not None:
            s -= beta * kl[i]
        total.append(s)
    if scale == "gdpo":
        summed = [0.0] * n
        for f in range(len(weights)):
            for g0 in range(0, n, k):
                vals = [rows[i][f] for i in range(g0, g0 + k)]
                ok = [v for v in vals if not math.isnan(v)]
                mu = sum(ok) / len(ok) if ok else float("nan")
                sd = statistics.stdev(ok) if len(ok) > 1 else float("nan")
                for j, v in enumerate(vals):
                    z = (v - mu) / (sd + 1e-8)
                    summed[g0 + j] += weights[f] * (0.0 if math.isnan(z) else z)
        mu = sum(summed) / n
        sd = _std(summed)
        return [(x - mu) / (sd + 1e-8) for x in summed], total
    adv, centred = [], []
    for g0 in range(0, n, k):
        grp = total[g0:g0 + k]
        mu = sum(grp) / k
        for x in grp:
            c = x - mu
            centred.append(c)
            adv.append(c * k / (k - 1) if estimator == "rloo" and k > 1 else c)
    source = centred if estimator == "reinforce_plus_plus" else total
    if scale == "group":
        adv = [a / (_std(source[(i // k) * k:(i // k) * k + k]) + 1e-4) for i, a in enumerate(adv)]
    elif scale == "batch":
        sd = _std(source)
        adv = [a / (sd + 1e-4) for a in adv]
    return adv, total


def _ref_metrics(total, rpf, k, scale, names):
    n = len(total)
    groups = [total[g0:g0 + k] for g0 in range(0, n, k)]
    out = {"reward": sum(total) / n}
    if scale == "batch":
        out["reward_std"] = _std(total)
    else:
        out["reward_std"] = sum(_std(g) for g in groups) / len(groups)
    out["frac_reward_zero_std"] = sum(1 for g in groups if k == 1 or abs(_std(g)) <= 1e-8) / len(groups)
    for f, name in enumerate(names):
        ok = [r[f] for r in rpf.tolist() if not math.isnan(r[f])]
        out[f"rewards/{name}/mean"] = sum(ok) / len(ok)
        out[f"rewards/{name}/std"] = _std(ok)
    return out


CASES = [(e, s) for e in ("grpo", "rloo", "reinforce_plus_plus") for s in ("group", "batch", "none")]
CASES += [("grpo", "gdpo"), ("rloo", "gdpo")]


@pytest.mark.parametrize("estimator,scale", CASES)
@pytest.mark.parametrize("nan", [False, True])
def test_advantages_match_reference(estimator, scale, nan):
    rpf = _rewards(1 + nan, nan=nan, ties=True)
    weights = [1.0, 0.5, -2.0]
    names = ["acc", "fmt", "len"]
    out = compute_advantages(rpf, K, reward_weights=weights, advantage_estimator=estimator,
                             scale_rewards=scale, kl_in_reward=False, reward_func_names=names)
    ref_adv, ref_total = _ref_advantages(rpf, weights, estimator, scale, K)
    torch.testing.assert_close(out.advantages, torch.tensor(ref_adv, dtype=torch.float64), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out.rewards, torch.tensor(ref_total, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    ref_m = _ref_metrics(ref_total, rpf, K, scale, names)
    assert set(out.metrics) == set(ref_m)
    for key, value in ref_m.items():
        assert float(out.metrics[key]) == pytest.approx(value, rel=1e-10, abs=1e-12), key


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_plus_plus"])
def test_kl_in_reward_subtracts_beta_kl_before_advantages(estimator):
    rpf = _rewards(3)
    g = torch.Generator().manual_seed(7)
    old = -torch.rand(G * K, 6, generator=g, dtype=torch.float64)
    ref = -torch.rand(G * K, 6, generator=g, dtype=torch.float64)
    mask = torch.rand(G * K, 6, generator=g) > 0.3
    kl = sequence_kl_for_reward(old, ref, mask)
    ref_kl = [sum(o - r for o, r, m in zip(orow, rrow, mrow) if m)
              for orow, rrow, mrow in zip(old.tolist(), ref.tolist(), mask.tolist())]
    torch.testing.assert_close(kl, torch.tensor(ref_kl, dtype=torch.float64))
    beta = 0.3
    out = compute_advantages(rpf, K, advantage_estimator=estimator, beta=beta, kl_values=kl, kl_in_reward=True)
    scale = adv_mod.default_scale_rewards(estimator)
    ref_adv, _ = _ref_advantages(rpf, [1.0] * F, estimator, scale, K, beta=beta, kl=ref_kl)
    torch.testing.assert_close(out.advantages, torch.tensor(ref_adv, dtype=torch.float64), rtol=1e-10, atol=1e-10)
    assert float(out.metrics["kl"]) == pytest.approx(sum(ref_kl) / len(ref_kl))
    # kl_in_reward=None takes the estimator's default: on for rloo / reinforce_plus_plus, off for grpo.
    default = compute_advantages(rpf, K, advantage_estimator=estimator, beta=beta, kl_values=kl)
    if estimator == "grpo":
        without = compute_advantages(rpf, K, advantage_estimator=estimator, kl_in_reward=False)
        torch.testing.assert_close(default.advantages, without.advantages)
    else:
        torch.testing.assert_close(default.advantages, out.advantages)


def test_defaults_follow_ms_swift():
    assert [adv_mod.default_scale_rewards(e) for e in ("grpo", "rloo", "reinforce_plus_plus")] == \
        ["group", "none", "batch"]
    assert [adv_mod.default_kl_in_reward(e) for e in ("grpo", "rloo", "reinforce_plus_plus")] == \
        [False, True, True]


def test_single_generation_and_gdpo_kl_warning():
    rpf = _rewards(4)[:, :2]
    out = compute_advantages(rpf, 1, scale_rewards="group")
    assert torch.all(out.advantages == 0) and float(out.metrics["frac_reward_zero_std"]) == 1.0
    with pytest.warns(UserWarning, match="gdpo"):
        g = compute_advantages(rpf, K, advantage_estimator="rloo", scale_rewards="gdpo", beta=0.1,
                               kl_values=torch.ones(G * K, dtype=torch.float64))
    assert torch.isfinite(g.advantages).all()


@pytest.mark.parametrize("kwargs,option,valid", [
    (dict(advantage_estimator="ppo"), "advantage_estimator", ["grpo", "rloo", "reinforce_plus_plus"]),
    (dict(scale_rewards="std"), "scale_rewards", ["group", "batch", "none", "gdpo"]),
    (dict(advantage_estimator="reinforce_plus_plus", scale_rewards="gdpo"), "advantage_estimator", ["grpo", "rloo"]),
])
def test_unknown_options_raise_with_valid_list(kwargs, option, valid):
    with pytest.raises(ValueError) as err:
        compute_advantages(_rewards(0), K, **kwargs)
    msg = str(err.value)
    assert option in msg and all(repr(v) in msg for v in valid)


def test_shape_errors():
    with pytest.raises(ValueError, match="num_generations"):
        compute_advantages(_rewards(0), 3)
    with pytest.raises(ValueError, match="reward_weights"):
        compute_advantages(_rewards(0), K, reward_weights=[1.0])
    with pytest.raises(ValueError, match="kl_values"):
        compute_advantages(_rewards(0), K, kl_in_reward=True, beta=0.1)
