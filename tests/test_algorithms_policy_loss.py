"""Every loss variant against a float64 reference written from the formulas: python loops
over completions and tokens building the loss from scalars (autograd gives the reference
gradient), never calling the implementation."""
import math

import numpy as np
import pytest
import torch

from megatron_grpo.algorithms import (LOSS_TYPES, compute_policy_loss, count_partials, entropy_threshold,
                                      local_loss, loss_normalizer, policy_metric_partials, finalize_metrics)
from megatron_grpo.algorithms.aggregation import real_kl_loss
from megatron_grpo.algorithms.policy_loss import LossConfig, LossTypeParams, discounted_suffix_sum, quantile

B, L, LMAX = 6, 7, 9
D = torch.float64
# Per-token loss types; real (a group loss) has its own reference below.
TOKEN_LOSS_TYPES = [t for t in LOSS_TYPES if t != "real"]


def make_batch(seed, b=B, l=L, empty_row=True):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, l + 1, (b,), generator=g)
    if empty_row:
        lengths[2] = 0  # a completion with no token (e.g. packed padding row)
    mask = torch.arange(l).unsqueeze(0) < lengths.unsqueeze(1)
    old = -torch.rand(b, l, generator=g, dtype=D) * 3
    batch = dict(
        mask=mask,
        old=old,
        logps=old + 0.4 * torch.randn(b, l, generator=g, dtype=D),
        ref=old + 0.3 * torch.randn(b, l, generator=g, dtype=D),
        rollout=old + 0.3 * torch.randn(b, l, generator=g, dtype=D),
        adv=torch.randn(b, generator=g, dtype=D),
        entropy=torch.rand(b, l, generator=g, dtype=D) * 3,
        truncated=torch.rand(b, generator=g) < 0.4,
    )
    # Padding holds garbage in real batches; the loss must not see it.
    for key in ("old", "ref", "rollout", "entropy"):
        batch[key] = batch[key].masked_fill(~mask, float("nan"))
    return batch


# ---------------------------------------------------------------- reference (loops)

def _clamp(x, lo=None, hi=None):
    return torch.clamp(x, min=lo, max=hi)


def reference_loss(bt, logps, o):
    """Global loss of the batch under options `o`, built token by token."""
    loss_type = o.get("loss_type", "grpo")
    eps = o.get("epsilon", 0.2)
    eps_hi = o.get("epsilon_high") or eps
    delta = o.get("delta")
    level = o.get("importance_sampling_level", "token")
    beta = o.get("beta", 0.0)
    kl_name = o.get("kl_estimator", "k3")
    use_kl = beta != 0.0 and not o.get("kl_in_reward", False)
    q = o.get("top_entropy_quantile", 1.0)
    mode = o.get("rollout_importance_sampling_mode")
    cap = o.get("rollout_importance_sampling_threshold", 2.0)
    on_policy = o.get("on_policy", False)
    prm = LossTypeParams(**{k: o[k] for k in PARAM_KEYS if k in o})
    gamma = 2.0 ** (-1.0 / prm.fipo_decay_rate)
    mask = bt["mask"].tolist()
    filtered = [bool(t) and o.get("overlong_filter", False) for t in bt["truncated"].tolist()]
    adv = bt["adv"].tolist() if bt["adv"].dim() == 1 else None

    loss_tokens = [(i, t) for i in range(len(mask)) for t in range(len(mask[i]))
                   if mask[i][t] and not filtered[i]]
    thr = None
    if q < 1.0:
        ents = [bt["entropy"][i, t].item() for i, t in loss_tokens]
        thr = float(np.quantile(ents, 1.0 - q)) if ents else float("nan")

    total = torch.zeros((), dtype=D)
    seq_terms = []
    for i in range(len(mask)):
        toks = [t for t in range(len(mask[i])) if mask[i][t]]
        old = {t: (logps[i, t].detach() if on_policy else bt["old"][i, t]) for t in toks}
        # rollout IS weights
        w = {t: 1.0 for t in toks}
        if mode is not None:
            lr = {t: max(-20.0, min(20.0, float(old[t] - bt["rollout"][i, t]))) for t in toks}
            rho = {t: math.exp(lr[t]) for t in toks}
            rho_seq = math.exp(sum(lr.values()) / len(toks)) if toks else 1.0
            for t in toks:
                if mode == "token_truncate":
                    w[t] = min(rho[t], cap)
                elif mode == "token_mask":
                    w[t] = rho[t] if rho[t] <= cap else 0.0
                elif mode == "sequence_truncate":
                    w[t] = min(rho_seq, cap)
                else:
                    w[t] = rho[t] if rho_seq <= cap else 0.0
        seq_mean_lr = (sum(logps[i, t] - old[t] for t in toks) / len(toks)) if toks else None

        def coef1_at(t):
            if level == "token":
                logw = logps[i, t] - old[t]
            elif level == "sequence":
                logw = seq_mean_lr
            else:
                logw = logps[i, t] - logps[i, t].detach() + seq_mean_lr.detach()
            return torch.exp(logw)

        def advantage_at(t):
            return adv[i] if adv is not None else bt["adv"][i, t].item()

        # fipo: d_s = log ratio of loss tokens (0 where the ratio exceeds delta); F_t its
        # gamma-discounted sum over s >= t; I_t = exp(F_t), clipped, safety-capped.
        influence = {}
        if loss_type == "fipo" and not filtered[i]:
            d = {s: (0.0 if delta is not None and coef1_at(s).item() > delta
                     else float(logps[i, s].detach() - old[s])) for s in toks}
            for t in toks:
                f = sum(gamma ** (s - t) * d[s] for s in toks if s >= t)
                w_t = math.exp(f)
                if prm.fipo_clip_range:
                    lo = 1.0 if prm.fipo_clip_high_only else 1.0 - prm.fipo_clip_range
                    w_t = min(max(w_t, lo), 1.0 + prm.fipo_clip_range)
                if (prm.fipo_safety_threshold is not None and advantage_at(t) < 0
                        and coef1_at(t).item() > prm.fipo_safety_threshold):
                    w_t = min(max(w_t, 0.8), 1.0)
                influence[t] = w_t
        seq_sum = torch.zeros((), dtype=D)
        for t in toks:
            a = advantage_at(t)
            c1 = coef1_at(t)
            if loss_type == "cispo":
                term = -_clamp(c1, hi=eps_hi).detach() * a * logps[i, t]
            elif loss_type == "sapo":
                tau = prm.tau_pos if a > 0 else prm.tau_neg
                term = -torch.sigmoid(tau * (c1 - 1.0)) * (4.0 / tau) * a
            else:
                c2 = _clamp(c1, 1 - eps, 1 + eps_hi)
                if delta is not None:
                    c1 = _clamp(c1, hi=delta)
                term = -torch.minimum(c1 * a, c2 * a)
                if loss_type == "fipo":
                    term = term * influence.get(t, 1.0)
            if thr is not None and not bt["entropy"][i, t].item() >= thr:
                term = term * 0.0
            if use_kl:
                r = bt["ref"][i, t]
                if kl_name == "k1":
                    kl = logps[i, t] - r
                elif kl_name == "k2":
                    kl = 0.5 * (logps[i, t] - r) ** 2
                else:
                    d = _clamp(r - logps[i, t], -20.0, 20.0)
                    kl = _clamp(torch.exp(d) - d - 1.0, -10.0, 10.0)
                term = term + beta * kl
            term = term * w[t]
            if not filtered[i]:
                seq_sum = seq_sum + term
        n_i = 0 if filtered[i] else len(toks)
        seq_terms.append((seq_sum, n_i))
        total = total + seq_sum

    n_seq = len(mask)
    if loss_type in ("grpo", "sapo"):
        return sum(s / max(n, 1) for s, n in seq_terms) / n_seq
    if loss_type == "bnpo":
        return total / max(len(loss_tokens), 1)
    if loss_type == "dr_grpo":
        return total / (n_seq * LMAX)
    gen_tokens = o.get("generation_tokens", sum(sum(r) for r in mask))
    return total / max(gen_tokens, 1)


# ---------------------------------------------------------------- implementation under test

IMPL_KEYS = ("loss_type", "epsilon", "epsilon_high", "delta", "importance_sampling_level", "beta", "kl_estimator",
             "kl_in_reward", "top_entropy_quantile", "overlong_filter", "rollout_importance_sampling_mode",
             "rollout_importance_sampling_threshold")
PARAM_KEYS = ("tau_pos", "tau_neg", "fipo_decay_rate", "fipo_clip_range", "fipo_clip_high_only",
              "fipo_safety_threshold")


def implementation_loss(bt, logps, o):
    kwargs = {k: o[k] for k in IMPL_KEYS if k in o}
    kwargs["loss_params"] = LossTypeParams(**{k: o[k] for k in PARAM_KEYS if k in o})
    out = compute_policy_loss(
        logps, bt["adv"], bt["mask"],
        old_logps=None if o.get("on_policy") else bt["old"],
        ref_logps=bt["ref"], entropy=bt["entropy"], truncated=bt["truncated"],
        rollout_logps=bt["rollout"], **kwargs)
    counts = count_partials(out.loss_mask, bt["mask"])
    loss_type = o.get("loss_type", "grpo")
    norm = loss_normalizer(loss_type, counts, generation_counts=counts, max_completion_length=LMAX)
    return local_loss(out.per_token_loss, out.loss_mask, loss_type, norm), out


def check_against_reference(seed, o, bt=None):
    bt = make_batch(seed) if bt is None else bt
    lp_impl = bt["logps"].clone().requires_grad_()
    lp_ref = bt["logps"].clone().requires_grad_()
    got, _ = implementation_loss(bt, lp_impl, o)
    want = reference_loss(bt, lp_ref, o)
    got.backward()
    want.backward()
    torch.testing.assert_close(got, want.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lp_impl.grad, lp_ref.grad, rtol=1e-9, atol=1e-12)
    assert lp_impl.grad.abs().sum() > 0
    return got


def _base(loss_type):
    # cispo's epsilon_high is an absolute cap on the ratio; pick one inside the ratio range.
    return dict(loss_type=loss_type, epsilon=0.2, epsilon_high=1.1 if loss_type == "cispo" else 0.28)


@pytest.mark.parametrize("loss_type", TOKEN_LOSS_TYPES)
@pytest.mark.parametrize("level", ["token", "sequence", "sequence_token"])
@pytest.mark.parametrize("delta", [None, 1.3])
def test_loss_types_and_levels(loss_type, level, delta):
    o = dict(_base(loss_type), importance_sampling_level=level, delta=delta, beta=0.04)
    check_against_reference(11, o)


VARIANTS = {
    "k1": dict(beta=0.1, kl_estimator="k1"),
    "k2": dict(beta=0.1, kl_estimator="k2"),
    "k3": dict(beta=0.1, kl_estimator="k3"),
    "kl_in_reward": dict(beta=0.1, kl_in_reward=True),
    "entropy": dict(top_entropy_quantile=0.6),
    "overlong": dict(overlong_filter=True),
    "on_policy": dict(on_policy=True, beta=0.04),
    "eps_high_default": dict(epsilon_high=None),
    "token_truncate": dict(rollout_importance_sampling_mode="token_truncate",
                           rollout_importance_sampling_threshold=1.2),
    "token_mask": dict(rollout_importance_sampling_mode="token_mask", rollout_importance_sampling_threshold=1.2),
    "sequence_truncate": dict(rollout_importance_sampling_mode="sequence_truncate",
                              rollout_importance_sampling_threshold=1.05),
    "sequence_mask": dict(rollout_importance_sampling_mode="sequence_mask",
                          rollout_importance_sampling_threshold=1.05),
    "everything": dict(beta=0.05, delta=1.5, top_entropy_quantile=0.5, overlong_filter=True,
                       importance_sampling_level="sequence_token",
                       rollout_importance_sampling_mode="token_truncate", rollout_importance_sampling_threshold=1.3),
}


@pytest.mark.parametrize("loss_type", TOKEN_LOSS_TYPES)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_option_variants(loss_type, variant):
    o = dict(_base(loss_type), **VARIANTS[variant])
    if variant == "eps_high_default" and loss_type == "cispo":
        o["epsilon"] = 1.1
    check_against_reference(23, o)


def test_per_token_advantages_and_extreme_kl():
    bt = make_batch(5)
    g = torch.Generator().manual_seed(9)
    bt["adv"] = torch.randn(B, L, generator=g, dtype=D)
    bt["ref"] = bt["ref"] + 30.0 * torch.randn(B, L, generator=g, dtype=D)  # k3 safety clamps engage
    assert ((bt["ref"] - bt["logps"]).abs() > 20).any()
    check_against_reference(5, dict(_base("grpo"), beta=0.2), bt)
    check_against_reference(5, dict(_base("dapo"), beta=0.2, importance_sampling_level="sequence"), bt)


@pytest.mark.parametrize("loss_type", TOKEN_LOSS_TYPES)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_all_completions_overlong_gives_zero_loss_not_nan(loss_type, level):
    bt = make_batch(3)
    bt["truncated"] = torch.ones(B, dtype=torch.bool)
    o = dict(_base(loss_type), importance_sampling_level=level, overlong_filter=True, beta=0.1,
             top_entropy_quantile=0.5, rollout_importance_sampling_mode="sequence_truncate")
    lp = bt["logps"].clone().requires_grad_()
    loss, out = implementation_loss(bt, lp, o)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(lp.grad, torch.zeros_like(lp))
    assert torch.isnan(out.entropy_threshold)
    metrics = finalize_metrics(policy_metric_partials(out, loss_type=loss_type, epsilon=0.2, entropy=bt["entropy"]))
    assert math.isnan(metrics["kl"]) and math.isnan(metrics["entropy/entropy_max"])
    clip_key = {"cispo": "cispo_clip_ratio", "sapo": None, "fipo": "fipo/influence_weight_mean"}.get(
        loss_type, "clip_ratio/low_min")
    assert clip_key is None or math.isnan(metrics[clip_key])


# sapo's temperatures and fipo's options, each where it changes the loss.
LOSS_PARAM_VARIANTS = {
    "sapo_sharp": dict(loss_type="sapo", tau_pos=8.0, tau_neg=12.0),
    "sapo_soft": dict(loss_type="sapo", tau_pos=0.3, tau_neg=0.5),
    "fipo_two_sided": dict(loss_type="fipo", fipo_clip_high_only=False, fipo_decay_rate=2.0),
    "fipo_no_clip": dict(loss_type="fipo", fipo_clip_range=None, fipo_decay_rate=4.0),
    "fipo_safety": dict(loss_type="fipo", fipo_clip_range=0.5, fipo_clip_high_only=False,
                        fipo_safety_threshold=1.05),
    "fipo_no_safety_delta": dict(loss_type="fipo", fipo_safety_threshold=None, delta=1.2,
                                 fipo_clip_range=0.0),
}


@pytest.mark.parametrize("level", ["token", "sequence", "sequence_token"])
@pytest.mark.parametrize("variant", list(LOSS_PARAM_VARIANTS))
def test_loss_type_params(variant, level):
    o = dict(_base("grpo"), importance_sampling_level=level, beta=0.02, **LOSS_PARAM_VARIANTS[variant])
    check_against_reference(31, o)
    if o["loss_type"] == "fipo":
        # the options act: the influence weights are not all 1
        _, out = implementation_loss(make_batch(31), make_batch(31)["logps"], o)
        w = out.fipo["influence_weight"][out.loss_mask]
        assert (w != 1.0).any()
        if variant == "fipo_safety" and level == "token":
            assert not out.fipo["safety_keep"][out.loss_mask].all()


@pytest.mark.parametrize("block", [1, 3, 4, 128])
def test_discounted_suffix_sum_across_blocks(block):
    """fipo's F_t = sum_{s >= t} gamma^(s - t) d_s, blocked, against a double loop."""
    g = torch.Generator().manual_seed(6)
    d = torch.randn(3, 10, generator=g, dtype=D)
    gamma = 0.8
    want = torch.tensor([[sum(gamma ** (s - t) * d[b, s].item() for s in range(t, 10)) for t in range(10)]
                         for b in range(3)], dtype=D)
    torch.testing.assert_close(discounted_suffix_sum(d, gamma, block=block), want, rtol=1e-12, atol=1e-12)


def test_sapo_gate_at_ratio_one_has_unit_slope():
    """On-policy (ratio 1) SAPO's gradient equals the plain policy gradient -A d logp."""
    bt = make_batch(2, empty_row=False)
    lp = bt["logps"].clone().requires_grad_()
    out = compute_policy_loss(lp, bt["adv"], bt["mask"], loss_type="sapo",
                              loss_params=LossTypeParams(tau_pos=0.7, tau_neg=3.0))
    out.per_token_loss.sum().backward()
    want = torch.where(bt["mask"], -bt["adv"].unsqueeze(-1).expand(B, L), torch.zeros(B, L, dtype=D))
    torch.testing.assert_close(lp.grad, want, rtol=1e-12, atol=1e-12)


def test_fipo_rejects_context_parallel_sums():
    bt = make_batch(0)
    with pytest.raises(ValueError, match="fipo.*context parallel"):
        compute_policy_loss(bt["logps"], bt["adv"], bt["mask"], old_logps=bt["old"], loss_type="fipo",
                            sequence_sums=lambda x: x)


@pytest.mark.parametrize("bad", [dict(tau_pos=0.0), dict(tau_neg=-1.0), dict(fipo_decay_rate=0.0),
                                 dict(fipo_clip_range=-0.1)])
def test_loss_type_params_reject_bad_values(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        LossTypeParams(**bad)


# ---------------------------------------------------------------- padding may hold anything

PADDED_INPUTS = ("logps", "old", "ref", "rollout", "adv", "entropy")


def _with_padding(bt, value):
    """The batch with per-token advantages, and `value` in the padding of every [B, L] input."""
    bt = dict(bt)
    g = torch.Generator().manual_seed(77)
    bt["adv"] = torch.randn(B, L, generator=g, dtype=D)
    for key in PADDED_INPUTS:
        bt[key] = bt[key].masked_fill(~bt["mask"], value)
    return bt


@pytest.mark.parametrize("loss_type", TOKEN_LOSS_TYPES)
@pytest.mark.parametrize("level", ["token", "sequence", "sequence_token"])
@pytest.mark.parametrize("garbage", [float("nan"), float("inf"), float("-inf")])
def test_padding_garbage_in_every_input_changes_nothing(loss_type, level, garbage):
    """NaN/inf in the padding of logps, old/ref/rollout log-probs, [B, L] advantages and
    entropy: the loss, its gradient and the metrics equal those with zero padding."""
    base = make_batch(13)
    o = dict(_base(loss_type), importance_sampling_level=level, beta=0.05, top_entropy_quantile=0.7,
             overlong_filter=True, rollout_importance_sampling_mode="sequence_truncate",
             rollout_importance_sampling_threshold=1.1, delta=1.5 if loss_type != "cispo" else None)
    results = []
    for value in (0.0, garbage):
        bt = _with_padding(base, value)
        lp = bt["logps"].clone().requires_grad_()
        loss, out = implementation_loss(bt, lp, o)
        loss.backward()
        metrics = finalize_metrics(policy_metric_partials(out, loss_type=loss_type, epsilon=o["epsilon"],
                                                          epsilon_high=o["epsilon_high"], entropy=bt["entropy"]))
        results.append((loss.detach(), lp.grad, metrics))
    (clean_loss, clean_grad, clean_m), (loss, grad, m) = results
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert torch.equal(loss, clean_loss) and torch.equal(grad, clean_grad)
    assert clean_grad.abs().sum() > 0
    assert m.keys() == clean_m.keys()
    for k in m:
        assert torch.equal(m[k], clean_m[k]) or (math.isnan(m[k]) and math.isnan(clean_m[k])), k


def test_entropy_threshold_and_quantile_match_numpy():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(101, generator=g, dtype=D)
    for q in (0.0, 0.2, 0.5, 0.77, 1.0):
        assert quantile(x, q).item() == pytest.approx(float(np.quantile(x.numpy(), q)), rel=1e-12)
    ent = torch.rand(4, 5, generator=g, dtype=D)
    mask = torch.rand(4, 5, generator=g) > 0.3
    want = float(np.quantile(ent[mask].numpy(), 1 - 0.3))
    assert entropy_threshold(ent, 0.3, mask).item() == pytest.approx(want, rel=1e-12)
    # the gathered form: a flat vector of the loss tokens' entropies (NaN ignored)
    flat = torch.cat([ent[mask], torch.tensor([float("nan")], dtype=D)])
    assert entropy_threshold(flat, 0.3).item() == pytest.approx(want, rel=1e-12)


def test_global_entropy_threshold_overrides_local():
    bt = make_batch(8)
    out = compute_policy_loss(bt["logps"], bt["adv"], bt["mask"], old_logps=bt["old"], entropy=bt["entropy"],
                              top_entropy_quantile=0.5, entropy_threshold_value=10.0)
    assert not out.entropy_mask.any() and torch.all(out.per_token_loss == 0)
    assert out.entropy_threshold.item() == 10.0


@pytest.mark.parametrize("kwargs,option,valid", [
    (dict(loss_type="ppo"), "loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "fipo", "real"]),
    (dict(importance_sampling_level="step"), "importance_sampling_level", ["token", "sequence", "sequence_token"]),
    (dict(kl_estimator="k4", beta=0.1), "kl_estimator", ["k1", "k2", "k3"]),
    (dict(rollout_importance_sampling_mode="clip"), "rollout_importance_sampling_mode",
     ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]),
])
def test_unknown_options_raise_with_valid_list(kwargs, option, valid):
    bt = make_batch(0)
    with pytest.raises(ValueError) as err:
        compute_policy_loss(bt["logps"], bt["adv"], bt["mask"], old_logps=bt["old"], ref_logps=bt["ref"],
                            rollout_logps=bt["rollout"], **kwargs)
    msg = str(err.value)
    assert option in msg and all(repr(v) in msg for v in valid)


def test_missing_inputs_raise():
    bt = make_batch(0)
    with pytest.raises(ValueError, match="ref_logps"):
        compute_policy_loss(bt["logps"], bt["adv"], bt["mask"], beta=0.1)
    with pytest.raises(ValueError, match="truncated"):
        compute_policy_loss(bt["logps"], bt["adv"], bt["mask"], overlong_filter=True)
    with pytest.raises(ValueError, match="rollout_logps"):
        compute_policy_loss(bt["logps"], bt["adv"], bt["mask"], rollout_importance_sampling_mode="token_mask")
    with pytest.raises(ValueError, match="top_entropy_quantile"):
        compute_policy_loss(bt["logps"], bt["adv"], bt["mask"], entropy=bt["entropy"], top_entropy_quantile=0.0)


def test_loss_type_options_reach_the_loss(tmp_path):
    """--tau_pos/--tau_neg/--fipo_* travel from the command line into LossOptions whole;
    a bad value fails with the option's name."""
    import json

    from megatron_grpo.config import parse_rlhf_args
    from megatron_grpo.train.setup import loss_options as _loss_options
    from tests.test_config_parse import COUNTDOWN

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    argv = ["--model", str(tmp_path), "--dataset", COUNTDOWN, "--reward_funcs", "countdown",
            "--loss_type", "sapo", "--tau_pos", "2.5", "--tau_neg", "3", "--fipo_decay_rate", "8",
            "--fipo_clip_range", "none", "--fipo_clip_high_only", "false", "--fipo_safety_threshold", "2"]
    opts = _loss_options(parse_rlhf_args(argv))
    assert opts.loss_type == "sapo"
    assert opts.loss_params == LossTypeParams(tau_pos=2.5, tau_neg=3.0, fipo_decay_rate=8.0, fipo_clip_range=None,
                                              fipo_clip_high_only=False, fipo_safety_threshold=2.0,
                                              num_generations=8)
    with pytest.raises(ValueError, match="tau_neg"):
        _loss_options(parse_rlhf_args(argv[:-12] + ["--tau_neg", "0"]))
    with pytest.raises(ValueError, match="--loss_type fipo.*--context_parallel_size"):
        parse_rlhf_args(argv[:6] + ["--loss_type", "fipo", "--context_parallel_size", "2"])


# ---------------------------------------------------------------- off-policy sequence mask

def reference_keep(bt, logps, o, use_rollout):
    """Rows the off-policy sequence mask keeps, from loops: drop row i when the mean over
    its loss tokens of (behaviour - logp) exceeds delta and its mean advantage is < 0."""
    keep = []
    for i in range(bt["mask"].shape[0]):
        filtered = o.get("overlong_filter", False) and bool(bt["truncated"][i])
        toks = [] if filtered else [t for t in range(bt["mask"].shape[1]) if bt["mask"][i, t]]
        if not toks:
            keep.append(True)
            continue
        behaviour = bt["rollout"] if use_rollout else (logps.detach() if o.get("on_policy") else bt["old"])
        gap = sum(float(behaviour[i, t] - logps[i, t].detach()) for t in toks) / len(toks)
        a = (float(bt["adv"][i]) if bt["adv"].dim() == 1
             else sum(float(bt["adv"][i, t]) for t in toks) / len(toks))
        keep.append(not (gap > o["off_policy_sequence_mask_delta"] and a < 0))
    return torch.tensor(keep)


@pytest.mark.parametrize("loss_type", TOKEN_LOSS_TYPES)
@pytest.mark.parametrize("use_rollout", [True, False])
@pytest.mark.parametrize("variant", ["plain", "overlong_sequence"])
def test_off_policy_sequence_mask(loss_type, use_rollout, variant):
    bt = make_batch(41, b=8)
    o = dict(_base(loss_type), beta=0.03, off_policy_sequence_mask_delta=0.02)
    if variant == "overlong_sequence":
        o.update(overlong_filter=True, importance_sampling_level="sequence")
    lp = bt["logps"].clone().requires_grad_()
    keep = reference_keep(bt, bt["logps"], o, use_rollout)
    assert not keep.all() and keep.sum() >= 3      # the mask acts, and not on everything
    # Reference: the dropped rows lose every token; normalisers as the aggregation counts
    # them (generation tokens before any mask).
    ref_bt = dict(bt, mask=bt["mask"] & keep.unsqueeze(-1))
    ref_o = {k: v for k, v in o.items() if k != "off_policy_sequence_mask_delta"}
    ref_o["generation_tokens"] = int(bt["mask"].sum())
    if not use_rollout:
        ref_bt["rollout"] = None
    lp_ref = bt["logps"].clone().requires_grad_()
    want = reference_loss(ref_bt, lp_ref, ref_o)
    kwargs = {k: o[k] for k in IMPL_KEYS + ("off_policy_sequence_mask_delta",) if k in o}
    out = compute_policy_loss(lp, bt["adv"], bt["mask"], old_logps=bt["old"], ref_logps=bt["ref"],
                              truncated=bt["truncated"], rollout_logps=bt["rollout"] if use_rollout else None,
                              **kwargs)
    counts = count_partials(out.loss_mask, bt["mask"])
    norm = loss_normalizer(loss_type, counts, generation_counts=counts, max_completion_length=LMAX)
    got = local_loss(out.per_token_loss, out.loss_mask, loss_type, norm)
    got.backward()
    want.backward()
    torch.testing.assert_close(got, want.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lp.grad, lp_ref.grad, rtol=1e-9, atol=1e-12)
    assert torch.equal(out.loss_mask.any(-1) | ~bt["mask"].any(-1) | (bt["truncated"] & o.get("overlong_filter", False)),
                       keep | ~bt["mask"].any(-1) | (bt["truncated"] & o.get("overlong_filter", False)))


# ---------------------------------------------------------------- REAL (a group loss)

G = 4


def real_batch(seed):
    """3 groups of G rows: group 0 mixed signs, group 1 all positive (contributes 0),
    group 2 mixed with a zero advantage (non-positive) and a row without tokens."""
    bt = make_batch(seed, b=3 * G, empty_row=False)
    bt["mask"][9] = False
    bt["old"] = bt["old"].masked_fill(~bt["mask"], float("nan"))
    bt["adv"] = torch.tensor([0.7, -0.3, 1.2, -0.9,  0.5, 0.1, 2.0, 0.4,  0.0, -0.6, 0.8, 0.3], dtype=D)
    return bt


def reference_real(bt, logps, o):
    """sum over groups with both signs of log(1 + sum_N e^{S/tau}) + log(1 + sum_P e^{-S/tau})
    / number of groups, + beta * token mean of k3; S_i = mean token log-ratio, A_i its advantage
    (both over the loss tokens; a row without any: S = 0, A = 0)."""
    tau, beta = o.get("real_tau", 0.5), o.get("beta", 0.0)
    keep = reference_keep(bt, logps, o, True) if "off_policy_sequence_mask_delta" in o else None
    scores, advs, kl_sum, n_tok = [], [], torch.zeros((), dtype=D), 0
    for i in range(bt["mask"].shape[0]):
        dropped = (o.get("overlong_filter", False) and bool(bt["truncated"][i])) or \
            (keep is not None and not keep[i])
        toks = [] if dropped else [t for t in range(bt["mask"].shape[1]) if bt["mask"][i, t]]
        old = (lambda t: logps[i, t].detach()) if o.get("on_policy") else (lambda t: bt["old"][i, t])
        scores.append(sum(logps[i, t] - old(t) for t in toks) / len(toks) if toks else torch.zeros((), dtype=D))
        advs.append(float(bt["adv"][i]) if toks else 0.0)
        for t in toks:
            d = bt["ref"][i, t] - logps[i, t]
            kl_sum = kl_sum + torch.exp(d) - d - 1.0
            n_tok += 1
    total = torch.zeros((), dtype=D)
    groups = len(scores) // G
    for g in range(groups):
        rows = range(g * G, (g + 1) * G)
        pos = [i for i in rows if advs[i] > 0]
        neg = [i for i in rows if advs[i] <= 0]
        if pos and neg:
            total = total + torch.log(1 + sum(torch.exp(scores[i] / tau) for i in neg)) \
                + torch.log(1 + sum(torch.exp(-scores[i] / tau) for i in pos))
    return total / groups + beta * kl_sum / max(n_tok, 1)


def implementation_real(bt, logps, o, rows=None):
    """The step loss as the trainer builds it: global counts, then each micro-batch's share
    (`rows`: the micro-batches' row ranges; default one micro-batch)."""
    cfg = LossConfig(loss_type="real", beta=o.get("beta", 0.0), overlong_filter=o.get("overlong_filter", False),
                     off_policy_sequence_mask_delta=o.get("off_policy_sequence_mask_delta"),
                     loss_params=LossTypeParams(real_tau=o.get("real_tau", 0.5), num_generations=G))
    n = bt["mask"].shape[0]
    rows = rows or [range(0, n)]
    outs = []
    for r in rows:
        sl = slice(r.start, r.stop)
        outs.append(compute_policy_loss(
            logps[sl], bt["adv"][sl], bt["mask"][sl], cfg,
            old_logps=None if o.get("on_policy") else bt["old"][sl], ref_logps=bt["ref"][sl],
            truncated=bt["truncated"][sl], rollout_logps=bt["rollout"][sl]))
    counts = sum(count_partials(out.loss_mask, bt["mask"][r.start:r.stop]) for out, r in zip(outs, rows))
    norm = loss_normalizer("real", counts)
    loss = torch.zeros((), dtype=D)
    for out in outs:
        loss = loss + local_loss(out.per_token_loss, out.loss_mask, "real", norm)
        if out.per_token_kl is not None:
            loss = loss + real_kl_loss(out.per_token_kl, out.loss_mask, cfg.beta, counts)
    return loss, outs


REAL_VARIANTS = {
    "plain": dict(),
    "tau_kl": dict(real_tau=1.7, beta=0.05),
    "on_policy": dict(on_policy=True, beta=0.02),
    "overlong": dict(overlong_filter=True),
    "off_policy_mask": dict(off_policy_sequence_mask_delta=0.0, beta=0.02),
}


@pytest.mark.parametrize("variant", list(REAL_VARIANTS))
def test_real_against_reference(variant):
    o = REAL_VARIANTS[variant]
    bt = real_batch(17)
    if variant == "overlong":
        bt["truncated"] = torch.zeros(3 * G, dtype=torch.bool)
        bt["truncated"][[1, 10]] = True       # group 0 keeps both signs; group 2 loses a positive row
    lp, lp_ref = bt["logps"].clone().requires_grad_(), bt["logps"].clone().requires_grad_()
    got, _ = implementation_real(bt, lp, o)
    want = reference_real(bt, lp_ref, o)
    got.backward()
    want.backward()
    torch.testing.assert_close(got, want.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lp.grad, lp_ref.grad, rtol=1e-9, atol=1e-12)
    # group 1 (all positive) gets no gradient from the group loss
    if not o.get("beta"):
        assert torch.equal(lp.grad[G:2 * G], torch.zeros_like(lp.grad[G:2 * G]))
    assert lp.grad[:G].abs().sum() > 0


def test_real_loss_independent_of_the_micro_batch_split():
    bt, o = real_batch(5), dict(beta=0.03)
    whole, _ = implementation_real(bt, bt["logps"], o)
    split, _ = implementation_real(bt, bt["logps"], o, rows=[range(0, G), range(G, 3 * G)])
    torch.testing.assert_close(split, whole, rtol=1e-12, atol=1e-14)


def test_real_option_errors():
    bt = real_batch(1)
    cfg = LossConfig(loss_type="real", loss_params=LossTypeParams(num_generations=5))
    with pytest.raises(ValueError, match="whole groups.*num_generations=5"):
        compute_policy_loss(bt["logps"], bt["adv"], bt["mask"], cfg, old_logps=bt["old"])
    for bad in (dict(top_entropy_quantile=0.5), dict(rollout_importance_sampling_mode="token_mask"),
                dict(importance_sampling_level="sequence")):
        with pytest.raises(ValueError, match=f"loss_type='real' does not use {next(iter(bad))}"):
            LossConfig(loss_type="real", **bad)
    with pytest.raises(ValueError, match="real_tau"):
        LossTypeParams(real_tau=0.0)


def test_real_options_from_the_command_line(tmp_path):
    """--loss_type real --real_tau / --off_policy_sequence_mask_delta reach LossOptions;
    the micro-batch must hold whole groups; scale_rewards becomes none."""
    import json

    from megatron_grpo.config import parse_rlhf_args
    from megatron_grpo.train.setup import loss_options as _loss_options
    from tests.test_config_parse import COUNTDOWN

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    argv = ["--model", str(tmp_path), "--dataset", COUNTDOWN, "--reward_funcs", "countdown",
            "--loss_type", "real", "--num_generations", "4", "--micro_batch_size", "4",
            "--global_batch_size", "8", "--real_tau", "0.7", "--off_policy_sequence_mask_delta", "0.1"]
    cfg = parse_rlhf_args(argv)
    opts = _loss_options(cfg)
    assert opts.loss_type == "real" and opts.off_policy_sequence_mask_delta == 0.1
    assert (opts.loss_params.real_tau, opts.loss_params.num_generations) == (0.7, 4)
    assert cfg.grpo.scale_rewards == "none"
    with pytest.raises(ValueError, match="--loss_type real needs whole groups.*--micro_batch_size 2.*"
                                         "--num_generations 4"):
        parse_rlhf_args(argv[:10] + ["--micro_batch_size", "2"] + argv[12:])
    with pytest.raises(ValueError, match="--loss_type real does not use --top_entropy_quantile"):
        parse_rlhf_args(argv + ["--top_entropy_quantile", "0.5"])


@pytest.mark.parametrize("loss_type", [t for t in TOKEN_LOSS_TYPES if t != "fipo"])
@pytest.mark.parametrize("on_policy", [False, True])
def test_teacher_log_ratio_joins_each_tokens_advantage(loss_type, on_policy):
    """On-policy distillation (--teacher_model): the loss with teacher_logps and one
    advantage per completion equals the reference loss with per-token advantages
    A_i + coef * (teacher_t - old_t) (old: the current log-probs, detached, on-policy);
    teacher_kl is exp(d) - d - 1 of d = teacher - old, 0 outside the mask."""
    bt = make_batch(31)
    g = torch.Generator().manual_seed(4)
    teacher = (bt["old"] + 0.5 * torch.randn(B, L, generator=g, dtype=D)).masked_fill(
        ~bt["mask"], float("nan"))
    o = dict(_base(loss_type), beta=0.04, on_policy=on_policy)
    coef = 0.7
    lp_impl = bt["logps"].clone().requires_grad_()
    out = compute_policy_loss(
        lp_impl, bt["adv"], bt["mask"], old_logps=None if on_policy else bt["old"],
        ref_logps=bt["ref"], truncated=bt["truncated"], teacher_logps=teacher,
        teacher_kl_coef=coef, **{k: o[k] for k in IMPL_KEYS if k in o})
    counts = count_partials(out.loss_mask, bt["mask"])
    norm = loss_normalizer(loss_type, counts, generation_counts=counts, max_completion_length=LMAX)
    got = local_loss(out.per_token_loss, out.loss_mask, loss_type, norm)

    per_token = torch.zeros(B, L, dtype=D)
    kl = torch.zeros(B, L, dtype=D)
    for i in range(B):
        for t in range(L):
            if bt["mask"][i, t]:
                old = bt["logps"][i, t].item() if on_policy else bt["old"][i, t].item()
                d = teacher[i, t].item() - old
                per_token[i, t] = bt["adv"][i].item() + coef * d
                kl[i, t] = math.exp(d) - d - 1
    lp_ref = bt["logps"].clone().requires_grad_()
    want = reference_loss(dict(bt, adv=per_token), lp_ref, o)
    got.backward()
    want.backward()
    torch.testing.assert_close(got, want.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lp_impl.grad, lp_ref.grad, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(out.teacher_kl, kl, rtol=1e-12, atol=1e-12)
    metrics = finalize_metrics(policy_metric_partials(out, loss_type=loss_type, epsilon=0.2))
    loss_tokens = out.loss_mask
    assert metrics["teacher_kl"] == pytest.approx(kl[loss_tokens].mean().item(), rel=1e-12)
    # Without the teacher term the loss differs: the test sees it.
    plain = reference_loss(bt, bt["logps"].clone(), o)
    assert abs(plain.item() - want.item()) > 1e-6


@pytest.mark.parametrize("loss_type", ["real", "fipo"])
def test_teacher_refused_by_the_loss_types_of_one_advantage_per_completion(loss_type):
    bt = make_batch(3)
    with pytest.raises(ValueError, match="needs one advantage per completion"):
        compute_policy_loss(bt["logps"], bt["adv"], bt["mask"], old_logps=bt["old"],
                            teacher_logps=bt["old"], loss_type=loss_type)
