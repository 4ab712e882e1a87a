"""--padding_free: packed (THD) micro-batches give what padded ones give.

The reference is the padded path through Megatron's own local attention
(`DotProductAttention`, bshd RoPE); the packed path runs our core attention on
PackedSeqParams and Megatron's THD RoPE, on a copy of the same weights. Per-token
log-probs and entropies (forward only), the step loss, its metrics and every parameter's
gradient must agree at fp32 tolerance, at TP=1, TP=2 (with sequence parallelism), PP=2
and CP=2, on micro-batches of mixed lengths (rows of 5 to 13 tokens padded to 16).
The end-to-end run with --padding_free is test_multi_turn_e2e.py's gym run [cp2_packed].
"""
import pytest
import torch

from tests.harness import run_distributed
from tests.mcore_utils import TINY_QWEN2
from tests.test_train_engine import make_samples

VOCAB, SEED, PAD = TINY_QWEN2["vocab_size"], 1234, 16

# grpo with sequence-level importance sampling (per-sequence sums: under CP all-reduced
# over the packed rows' chunks), dapo with the top-entropy mask (a quantile) and entropy
# metrics, both with KL, the overlong filter and rollout IS.
BASE = dict(beta=0.04, epsilon_high=0.28, overlong_filter=True,
            rollout_importance_sampling_mode="token_truncate")
CASES = [dict(BASE, loss_type="grpo", importance_sampling_level="sequence"),
         dict(BASE, loss_type="dapo", top_entropy_quantile=0.5, log_entropy=True)]


# ---- the layout, single process ------------------------------------------------------

def _batch():
    from megatron_grpo.train import Sample
    from megatron_grpo.train.batch import collate

    samples = [Sample([1, 2], [3, 4]), Sample([5, 6, 7], [8, 9, 10, 11])]   # n = 3, 6
    return collate(samples, pad_to_length=8)


def test_pack_layout_cp1():
    from megatron_grpo.train.packing import pack_micro_batch, to_rows

    batch = _batch()
    p = pack_micro_batch(batch)
    assert p["input_ids"].tolist() == [[1, 2, 3, 5, 6, 7, 8, 9, 10]]
    assert p["targets"].tolist() == [[2, 3, 4, 6, 7, 8, 9, 10, 11]]
    assert p["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 4, 5]]
    assert p["cu_seqlens"].tolist() == p["cu_seqlens_padded"].tolist() == [0, 3, 9]
    assert p["max_seqlen"] == 6
    # The row view is the padded layout itself: the loss sees the same [B, S] tensors.
    assert torch.equal(p["completion_mask"], batch["completion_mask"])
    values = torch.arange(9.0).unsqueeze(0)              # one value per packed token
    rows = to_rows(values, p)
    assert rows.tolist() == [[0, 1, 2, 0, 0, 0, 0, 0], [3, 4, 5, 6, 7, 8, 0, 0]]


def test_pack_layout_cp2_filler_and_gather():
    """CP=2: each sequence padded to a multiple of 4 and split in chunks (r, 3 - r); the
    packed length padded to a common total with a filler; every rank's row view scattered
    back gives the padded layout."""
    from megatron_grpo.train.packing import pack_micro_batch, packed_length

    batch = _batch()
    assert packed_length(batch, cp_size=2) == 4 + 8
    ranks = [pack_micro_batch(batch, cp_size=2, cp_rank=r, total_length=16) for r in range(2)]
    assert ranks[0]["cu_seqlens_padded"].tolist() == [0, 4, 12, 16]     # filler of 4
    assert ranks[0]["cu_seqlens"].tolist() == [0, 3, 9, 13]
    # seq 0 = [1 2 3 pad], chunks of 1; seq 1 = [5..10 pad pad], chunks of 2.
    assert ranks[0]["input_ids"].tolist() == [[1, 0, 5, 6, 0, 0, 0, 0]]
    assert ranks[1]["input_ids"].tolist() == [[2, 3, 7, 8, 9, 10, 0, 0]]
    assert ranks[1]["position_ids"].tolist() == [[1, 2, 2, 3, 4, 5, 1, 2]]
    # Gather (what gather_rows_from_cp does after its all-gather): position ids back.
    pos = batch["position_ids"].float()
    out = torch.zeros(2, 9)
    for r, p in enumerate(ranks):
        local = p["position_ids"].float()
        rows = torch.where(p["row_valid"], local[0][p["row_index"]], torch.zeros(()))
        out.scatter_(1, p["row_positions_all"][r], rows)
    valid = torch.arange(8) < batch["lengths"].unsqueeze(1)
    assert torch.equal(out[:, :8][valid], pos[valid])


# ---- real Megatron models ----------------------------------------------------------------

def _phase(world, tp, pp, cp, sp):
    """One world layout: padded and packed models with the same weights, the forward
    log-probs and one GRPO step per case on each. Returns both runs' results."""
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
    models = []
    for packed in (False, True):
        # One TransformerConfig each: wrap_ddp installs its grad hooks on the config.
        config, args = build_transformer_config(TINY_QWEN2, tp=tp, pp=pp, cp=cp,
                                                sequence_parallel=sp)
        torch.manual_seed(SEED)
        chunks = build_model(config, args, padding_free=packed)
        if models:
            for ref, c in zip(models[0], chunks):
                c.load_state_dict(ref.module.state_dict())
        models.append(wrap_ddp(config, chunks))
    samples = make_samples()
    step = collate(samples)
    gen_counts = count_partials(step["completion_mask"], step["completion_mask"])
    step_counts = count_partials(step["completion_mask"] & ~step["truncated"][:, None],
                                 step["completion_mask"])
    batches = micro_batches(samples, 4, pad_to_length=PAD)       # 2 x 4 completions
    out = []
    for chunks in models:
        logps = forward_logprobs(chunks, batches, temperature=1.0, vocab_size=VOCAB,
                                 compute_entropy=True)
        cases = []
        for kwargs in CASES:
            opts = LossOptions(**kwargs)
            norm = loss_normalizer(opts.loss_type, step_counts, generation_counts=gen_counts,
                                   max_completion_length=8)
            for c in chunks:
                c.zero_grad_buffer()
            threshold = step_entropy_threshold(chunks, batches, opts, vocab_size=VOCAB) \
                if opts.top_entropy_quantile < 1.0 else None
            parts = train_micro_batches(chunks, batches, opts, normalizer=norm,
                                        vocab_size=VOCAB, entropy_threshold_value=threshold)
            metrics = None
            if is_last_stage():
                metrics = {k: float(v) for k, v in finalize_metrics(reduce_partials(parts)).items()}
                metrics["loss"] = float(reduce_partials(parts)["sum"]["loss"])
            grads = {n: p.main_grad.detach().clone()
                     for n, p in chunks[0].module.named_parameters()}
            cases.append((grads, metrics))
        out.append({"logps": logps, "cases": cases})
    masks = [b["completion_mask"] for b in batches]
    return {"padded": out[0], "packed": out[1], "masks": masks,
            "where": f"tp={tp} pp={pp} cp={cp} sp={sp}, rank (pp/tp/cp) "
                     f"{ps.get_pipeline_model_parallel_rank()}/"
                     f"{ps.get_tensor_model_parallel_rank()}/{ps.get_context_parallel_rank()}"}


def _phases(rank, world, runs):
    return [_phase(world, *run) for run in runs]


def _check(result):
    where = result["where"]
    ref, run = result["padded"], result["packed"]
    if ref["logps"] is not None:
        for a, b, mask in zip(ref["logps"], run["logps"], result["masks"]):
            assert a["logps"].shape == b["logps"].shape == mask.shape, where
            for key in ("logps", "entropy"):
                diff = (a[key] - b[key])[mask].abs().max().item()
                assert diff <= 1e-5, f"{where}: forward {key} differ by {diff:.2e}"
    for i, ((g_ref, m_ref), (g, m)) in enumerate(zip(ref["cases"], run["cases"])):
        here = f"{where}, case {CASES[i]['loss_type']}"
        assert g_ref.keys() == g.keys()
        for k in g_ref:
            scale = g_ref[k].abs().max().item()
            assert scale > 0, f"{here}: {k} has no gradient"
            diff = (g[k].double() - g_ref[k].double()).abs().max().item()
            assert diff <= 1e-6 + 1e-4 * scale, \
                f"{here}: grad of {k} differs by {diff:.3e} (max |grad| {scale:.3e})"
        if m_ref is None:
            assert m is None
            continue
        assert m.keys() == m_ref.keys()
        assert m["loss"] == pytest.approx(m_ref["loss"], rel=1e-5, abs=1e-7), here
        for k, v in m_ref.items():
            assert m[k] == pytest.approx(v, rel=1e-4, abs=1e-6, nan_ok=True), f"{here}: {k}"


def test_packed_equals_padded_tp1():
    (result,), = run_distributed(_phases, 1, args=([(1, 1, 1, False)],), timeout=300)
    metrics = result["padded"]["cases"][1][1]
    assert "entropy/entropy_threshold" in metrics and "entropy/entropy_mean" in metrics   # the case's mask is on
    _check(result)


def test_packed_equals_padded_tp2_sp_pp2_cp2():
    """2 ranks, one layout after the other: TP=2 with sequence parallelism, PP=2, CP=2."""
    runs = [(2, 1, 1, True), (1, 2, 1, False), (1, 1, 2, False)]
    for phases in run_distributed(_phases, 2, args=(runs,), timeout=400):
        for result in phases:
            _check(result)


@pytest.mark.slow
def test_packed_equals_padded_tp2_cp2_sp_and_pp2_cp2():
    """4 ranks: TP=2 x CP=2 with sequence parallelism (packed length a multiple of
    2*cp*tp) and PP=2 x CP=2 (one packed length for every micro-batch of the schedule)."""
    runs = [(2, 1, 2, True), (1, 2, 2, False)]
    for phases in run_distributed(_phases, 4, args=(runs,), timeout=900):
        for result in phases:
            _check(result)


# ---- end to end: the `--padding_free true` CLI run (CP=2, a reference model, two optimizer
# steps per generation; the trainer's log-probs equal vLLM's) is
# tests/test_multi_turn_e2e.py::test_gym_multi_turn[cp2_packed], which checks all of it
# on multi-turn trajectories (one CLI launch for both).
