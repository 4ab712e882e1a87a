"""Context parallelism in the GRPO step and the trainer.

One GRPO step with CP=2 must give the gradients (and the loss and metrics) of the same
step at CP=1, at fp32 tolerance: every CP rank holds its load-balanced chunks of each
micro-batch, the per-sequence sums (sequence-level importance ratio, per-completion token
counts of grpo, sequence rollout-IS ratio, per-completion metrics) are all-reduced over
CP, and Megatron's x cp / (1 / (dp * cp)) scalings cancel. The CP=1 reference is the
engine itself, held to float64 math and split invariance by tests/test_train_engine.py.

Each world runs the CP=1 phase first (same TP/PP, the CP ranks as data-parallel ranks,
which test_train_engine shows give the same gradient), then the CP phase, on the same
weights (same seed; checked) and the same micro-batches. Micro-batches are 13 tokens long (rows of 5..12 tokens), so every
CP rank's chunks include padding (13 -> 16 = a multiple of 2*cp).
"""
import math

import pytest
import torch

from tests.harness import run_distributed
from tests.mcore_utils import TINY_QWEN2
from tests.test_train_engine import make_samples
from tests.test_trainer_e2e import tiny  # noqa: F401  (the tiny Qwen2 fixture of the e2e test)

VOCAB, SEQ, SEED = TINY_QWEN2["vocab_size"], 13, 1234

# (name, LossOptions kwargs): grpo and dapo with the engine test's options (KL in the loss,
# overlong filter, rollout IS), then the sequence-level variants of importance sampling and
# of the rollout IS ratio, the top-entropy mask (a quantile, gathered over CP) and entropy
# metrics.
BASE = dict(beta=0.04, epsilon_high=0.28, overlong_filter=True,
            rollout_importance_sampling_mode="token_truncate")
CASES = [
    ("grpo", dict(BASE, loss_type="grpo")),
    ("dapo", dict(BASE, loss_type="dapo")),
    ("grpo-sequence", dict(BASE, loss_type="grpo", importance_sampling_level="sequence",
                           rollout_importance_sampling_mode="sequence_truncate",
                           rollout_importance_sampling_threshold=1.05)),
    ("dapo-sequence_token-entropy", dict(BASE, loss_type="dapo",
                                         importance_sampling_level="sequence_token",
                                         rollout_importance_sampling_mode="sequence_mask",
                                         rollout_importance_sampling_threshold=1.2,
                                         top_entropy_quantile=0.5, log_entropy=True)),
]


def _phase(world, tp, pp, cp, sequence_parallel, cases):
    """Build the tiny Qwen2 under (tp, pp, cp), run one GRPO step per case.

    Returns per case (this rank's main grads, finalised metrics and step loss, None off
    the last stage) and the forward-only log-probs of the first micro-batch.
    """
    from megatron.core import parallel_state as ps

    from megatron_grpo.algorithms import count_partials, finalize_metrics, loss_normalizer
    from megatron_grpo.model import build_model, build_transformer_config, wrap_ddp
    from megatron_grpo.platform import ParallelDims, init_parallel
    from megatron_grpo.train import (LossOptions, forward_logprobs, micro_batches,
                                     reduce_partials, step_entropy_threshold,
                                     train_micro_batches)
    from megatron_grpo.train.batch import collate
    from megatron_grpo.train.engine import is_last_stage

    init_parallel(ParallelDims(world_size=world, tp=tp, pp=pp, cp=cp), seed=SEED)
    config, args = build_transformer_config(TINY_QWEN2, tp=tp, pp=pp, cp=cp,
                                            sequence_parallel=sequence_parallel)
    torch.manual_seed(SEED)
    chunks = wrap_ddp(config, build_model(config, args))
    params = {n: p.detach().clone() for n, p in chunks[0].module.named_parameters()}
    samples = make_samples()
    gen = collate(samples)
    gen_counts = count_partials(gen["completion_mask"], gen["completion_mask"])
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    # The CP=1 references run DP=2 (rank d: samples d::2), the CP runs DP=1: both
    # take contiguous shares of this order, so every run sees the same micro-batches
    # (not needed for the step's result, which is split-invariant).
    order = samples[0::2] + samples[1::2]
    share = len(order) // dp
    mine = order[dp_rank * share:(dp_rank + 1) * share]
    batches = micro_batches(mine, 2, pad_to_length=SEQ)        # 2 completions each
    assert all(b["input_ids"].shape[1] == SEQ for b in batches)
    step = collate(samples)
    step_counts = count_partials(step["completion_mask"] & ~step["truncated"][:, None],
                                 step["completion_mask"])
    results = []
    for _, kwargs in cases:
        opts = LossOptions(**kwargs)
        norm = loss_normalizer(opts.loss_type, step_counts, generation_counts=gen_counts,
                               max_completion_length=8)
        for c in chunks:
            c.zero_grad_buffer()
        # As the trainer: top_entropy_quantile's threshold over the whole step (entropies
        # gathered over CP, and over DP in the references).
        threshold = step_entropy_threshold(chunks, batches, opts, vocab_size=VOCAB) \
            if opts.top_entropy_quantile < 1.0 else None
        parts = train_micro_batches(chunks, batches, opts, normalizer=norm, vocab_size=VOCAB,
                                    entropy_threshold_value=threshold)
        metrics = loss = None
        if is_last_stage():
            reduced = reduce_partials(parts)
            metrics = {k: float(v) for k, v in finalize_metrics(reduced).items()}
            loss = float(reduced["sum"]["loss"])
        grads = {n: p.main_grad.detach().clone() for n, p in chunks[0].module.named_parameters()}
        results.append((grads, metrics, loss))
    logps = forward_logprobs(chunks, batches, temperature=1.0, vocab_size=VOCAB,
                             compute_entropy=True)
    first = None if logps is None else (logps[0]["logps"], logps[0]["entropy"],
                                        batches[0]["completion_mask"])
    return {"params": params, "cases": results, "logps": first,
            "names": [name for name, _ in cases], "dp_rank": dp_rank,
            "tp_rank": ps.get_tensor_model_parallel_rank(),
            "pp_rank": ps.get_pipeline_model_parallel_rank()}


def _phases(rank, world, runs, cases):
    """runs: [(tp, pp, cp, sequence_parallel)], one after the other on the same ranks."""
    return [_phase(world, *run, cases) for run in runs]


def _close(a, b, rtol, atol=0.0):
    return (a.double() - b.double()).abs().max().item() <= atol + rtol * b.double().abs().max().item()


def _check(results, ref_idx, run_idx, where):
    """Compare run `run_idx` with the reference on every rank of the same PP stage."""
    for rank, phases in enumerate(results):
        ref, run = phases[ref_idx], phases[run_idx]
        here = f"{where}, rank {rank}"
        # Megatron's rank order (tp fastest, pp slowest) keeps each rank's TP shard and
        # PP stage when cp replaces dp, so grads compare rank by rank.
        assert (ref["tp_rank"], ref["pp_rank"]) == (run["tp_rank"], run["pp_rank"]), here
        assert ref["params"].keys() == run["params"].keys()
        assert all(torch.equal(ref["params"][n], run["params"][n]) for n in ref["params"]), \
            f"{here}: the CP model's weights differ from the reference's"
        for name, (g_ref, m_ref, l_ref), (g, m, loss) in zip(run["names"], ref["cases"],
                                                              run["cases"]):
            for k in g_ref:
                assert g_ref[k].abs().max() > 0, f"{here} {name}: {k} has no gradient"
                diff = (g[k].double() - g_ref[k].double()).abs().max().item()
                scale = g_ref[k].abs().max().item()
                assert diff <= 1e-6 + 1e-4 * scale, (
                    f"{here} {name}: grad of {k} differs by {diff:.3e} (max |grad| {scale:.3e})")
            if m_ref is None:
                assert m is None
                continue
            assert loss == pytest.approx(l_ref, rel=1e-5, abs=1e-7), f"{here} {name}: loss"
            assert m.keys() == m_ref.keys(), f"{here} {name}: metric keys differ"
            for k, v in m_ref.items():
                if math.isnan(v):
                    assert math.isnan(m[k]), f"{here} {name}: {k}={m[k]}, reference NaN"
                else:
                    assert m[k] == pytest.approx(v, rel=1e-4, abs=1e-6), \
                        f"{here} {name}: metric {k} = {m[k]}, reference {v}"
        if run["logps"] is not None:
            # Every CP rank's first micro-batch is DP rank 0's first one in the reference.
            first = next(p[ref_idx] for p in results if p[ref_idx]["dp_rank"] == 0 and (
                p[ref_idx]["tp_rank"], p[ref_idx]["pp_rank"]) == (run["tp_rank"], run["pp_rank"]))
            lp_ref, ent_ref, mask = first["logps"]
            lp, ent, _ = run["logps"]
            assert lp.shape == lp_ref.shape == mask.shape, f"{here}: gathered log-prob shape"
            assert _close(lp[mask], lp_ref[mask], 1e-5), f"{here}: forward log-probs differ"
            assert _close(ent[mask], ent_ref[mask], 1e-5), f"{here}: forward entropies differ"


def test_cp2_step_equals_cp1():
    """CP=2 (2 ranks): grads, loss, metrics and forward log-probs equal CP=1 (DP=2)."""
    results = run_distributed(_phases, 2, args=([(1, 1, 1, False), (1, 1, 2, False)], CASES),
                              timeout=300)
    # The cases exercise what they claim: KL on, rollout IS weights that clip (sequence
    # mode too), the entropy threshold in use.
    metrics = dict(zip(results[0][0]["names"], (c[1] for c in results[0][0]["cases"])))
    assert metrics["grpo"]["kl"] > 0
    assert metrics["grpo-sequence"]["rollout_correction/clipped_frac"] > 0
    assert "entropy/entropy_threshold" in metrics["dapo-sequence_token-entropy"]
    _check(results, 0, 1, "cp=2")


@pytest.mark.slow
def test_tp2_cp2_sp_and_pp2_cp2_step_equal_cp1():
    """4 ranks: TP=2 x CP=2 with sequence parallelism (13 -> 16 = 2*cp*tp) against
    TP=2 x DP=2, and PP=2 x CP=2 against PP=2 x DP=2 (same layouts, same weights)."""
    runs = [(2, 1, 1, False), (2, 1, 2, True), (1, 2, 1, False), (1, 2, 2, False)]
    results = run_distributed(_phases, 4, args=(runs, CASES[2:4]), timeout=600)
    _check(results, 0, 1, "tp=2 x cp=2 (SP)")
    _check(results, 2, 3, "pp=2 x cp=2")


@pytest.mark.slow
@pytest.mark.vllm
def test_e2e_rlhf_cp2(tiny, tmp_path):
    """`megatron rlhf --context_parallel_size 2` on 2 CPU ranks (DP=1): a reference model
    (beta > 0) and two optimizer steps per generation (old log-probs) take the CP
    forward-only path, the steps the CP loss; every logged metric is finite, and the
    trainer's CP log-probs of the sampled tokens equal vLLM's (rollout_correction)."""
    from tests.test_trainer_e2e import METRIC_KEYS, _argv, _metrics, _run

    out = str(tmp_path / "run")
    r = _run(_argv(tiny, out, context_parallel_size=2, beta=0.04, generation_batch_size=16,
                   global_batch_size=8, train_iters=2, log_entropy="true",
                   log_rollout_offpolicy_metrics="true"))
    assert r.returncode == 0, r.stderr[-4000:]
    rows = _metrics(out)
    assert [row["step"] for row in rows] == [1, 2]
    # One generation batch for both steps: timing/generate and timing/score come with
    # step 1, timing/sync (weights to vLLM) with step 2.
    once = {"timing/generate": 0, "timing/score": 0, "timing/sync": 1}
    keys = [k for k in METRIC_KEYS if k not in once] + [
        "kl", "entropy/entropy_mean", "rollout_correction/log_ppl_abs_diff"]
    for k, step in once.items():
        assert k in rows[step], f"step {step + 1}: metrics.jsonl lacks {k}"
    for row in rows:
        for k in keys:
            assert k in row, f"step {row['step']}: metrics.jsonl lacks {k}"
        for k, v in row.items():
            assert v is not None and math.isfinite(v), f"step {row['step']}: {k}={v}"
    # Both steps use the old log-probs of the policy vLLM sampled with (synced after
    # step 2 only): gathered over CP, they match vLLM's own per token.
    for row in rows:
        assert row["rollout_correction/log_ppl_abs_diff"] < 1e-4, row
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-6)     # policy == reference at step 1
    assert rows[1]["kl"] > 0
