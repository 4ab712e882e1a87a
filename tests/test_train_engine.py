"""The GRPO step through Megatron: gradients independent of how the step is split.

Holds megatron_grpo.train.engine to the normalisation contract (docs/architecture.md, "Loss normalisation"): the
gradient of one optimizer step is the gradient of the global loss `loss_type` defines,
for DP=1 x 4 micro-batches, DP=2 x 2 micro-batches and one micro-batch alike; and a
TP=2 model's gradients equal TP=1's.
"""
import pytest
import torch

from tests.harness import run_distributed
from tests.mcore_utils import TINY_QWEN2, setup

LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "fipo", "real"]
N_SAMPLES, VOCAB = 8, TINY_QWEN2["vocab_size"]
REAL_GROUP = 2      # real: groups of 2 consecutive samples, kept whole on each DP rank


def make_samples(seed=0):
    """8 completions (2 prompts x 4) of different lengths with off-policy log-probs."""
    from megatron_grpo.train import Sample

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(N_SAMPLES):
        p = int(torch.randint(3, 7, (1,), generator=g))
        c = int(torch.randint(2, 9, (1,), generator=g))
        out.append(Sample(
            prompt_ids=torch.randint(0, VOCAB, (p,), generator=g).tolist(),
            completion_ids=torch.randint(0, VOCAB, (c,), generator=g).tolist(),
            advantage=float(torch.randn((), generator=g)),
            truncated=bool(i % 5 == 0),
            # old/ref/rollout log-probs around the model's (about -log V = -6.9):
            # far enough that clipping, KL and IS weights all act.
            old_logps=(-6.9 + 0.3 * torch.randn(c, generator=g)),
            ref_logps=(-6.9 + 0.3 * torch.randn(c, generator=g)),
            rollout_logps=(-6.9 + 0.3 * torch.randn(c, generator=g)).tolist()))
    return out


def _grads(rank, world, cases, tp=1):
    """Gradients of one step per case (loss_type, micro-batches per rank, sample indices,
    beta), on one model: spawning a world costs more than the steps, so a world runs
    every case of a test."""
    from megatron_grpo.algorithms import count_partials, loss_normalizer
    from megatron_grpo.model import wrap_ddp
    from megatron_grpo.train import (LossOptions, micro_batches, step_entropy_threshold,
                                     train_micro_batches)
    from megatron_grpo.algorithms import LossTypeParams
    from megatron_grpo.train.batch import collate, dp_shard
    from megatron.core import parallel_state as ps

    config, args, chunks = setup(world, tp=tp)
    chunks = wrap_ddp(config, chunks)
    samples = make_samples()
    gen = collate(samples)
    gen_counts = count_partials(gen["completion_mask"], gen["completion_mask"])
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    results = []
    for case in cases:
        loss_type, num_mb_per_rank, parts, beta = case[:4]
        # Optional: top_entropy_quantile, and whether its threshold is the step's
        # (step_entropy_threshold, as the trainer does) or each micro-batch's own.
        q = case[4] if len(case) > 4 else 1.0
        step_threshold = case[5] if len(case) > 5 else True
        step = [samples[i] for i in parts]
        if loss_type == "real":     # a group loss: no per-token options, whole groups per rank
            mine = dp_shard(step, len(step), dp, dp_rank, REAL_GROUP)[0]
            opts = LossOptions(loss_type="real", beta=beta, overlong_filter=True,
                               loss_params=LossTypeParams(num_generations=REAL_GROUP))
        else:
            mine = step[dp_rank::dp]
            opts = LossOptions(loss_type=loss_type, beta=beta, epsilon_high=0.28,
                               overlong_filter=True, top_entropy_quantile=q,
                               rollout_importance_sampling_mode="token_truncate")
        # Global counts: of the step, and (dapo/cispo) of the whole generation batch.
        full = collate(step)
        step_counts = count_partials(full["completion_mask"] & ~full["truncated"][:, None],
                                     full["completion_mask"])
        norm = loss_normalizer(loss_type, step_counts, generation_counts=gen_counts,
                               max_completion_length=8)
        for c in chunks:
            c.zero_grad_buffer()
        batches = micro_batches(mine, len(mine) // num_mb_per_rank, pad_to_length=16)
        threshold = step_entropy_threshold(chunks, batches, opts, vocab_size=VOCAB) \
            if q < 1.0 and step_threshold else None
        parts_out = train_micro_batches(chunks, batches, opts, normalizer=norm,
                                        vocab_size=VOCAB, entropy_threshold_value=threshold,
                                        step_counts=step_counts)
        grads = {}
        for name, p in chunks[0].module.named_parameters():
            g = p.main_grad.detach().clone()
            if tp > 1 and getattr(p, "tensor_model_parallel", False):
                pieces = [torch.empty_like(g) for _ in range(tp)]
                torch.distributed.all_gather(pieces, g,
                                             group=ps.get_tensor_model_parallel_group())
                if name.endswith("linear_fc1.weight"):  # [gate_r; up_r] per rank -> [gate; up]
                    halves = [x.chunk(2, dim=0) for x in pieces]
                    g = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
                else:
                    g = torch.cat(pieces, dim=p.partition_dim)
            grads[name] = g
        results.append((grads, parts_out["sum"].get("loss")))
    return results


def _compare(a, b, rtol=2e-5):
    assert a.keys() == b.keys()
    for k in a:
        ref = b[k].double()
        diff = (a[k].double() - ref).norm() / ref.norm().clamp(min=1e-12)
        assert diff < rtol, f"{k}: relative difference {diff:.2e}"


ALL = list(range(N_SAMPLES))


def test_step_gradient_independent_of_split():
    """For every loss_type: 1 micro-batch == 4 micro-batches == DP=2 x 2 micro-batches."""
    one_rank = run_distributed(_grads, 1, args=(
        [(lt, 1, ALL, 0.04) for lt in LOSS_TYPES] + [(lt, 4, ALL, 0.04) for lt in LOSS_TYPES],))
    dp2 = run_distributed(_grads, 2, args=([(lt, 2, ALL, 0.04) for lt in LOSS_TYPES],),
                          timeout=300)
    for i, lt in enumerate(LOSS_TYPES):
        ref = one_rank[0][i][0]
        assert any(g.abs().sum() > 0 for g in ref.values()), lt
        _compare(one_rank[0][len(LOSS_TYPES) + i][0], ref)
        _compare(dp2[0][i][0], ref)
        _compare(dp2[1][i][0], ref)


def test_top_entropy_quantile_threshold_is_the_steps():
    """top_entropy_quantile=0.5: the step's threshold makes 1 micro-batch == 4 micro-batches
    == DP=2 x 2; per-micro-batch thresholds (what the loss does alone) would not."""
    one_rank = run_distributed(_grads, 1, args=([
        ("dapo", 1, ALL, 0.0, 0.5), ("dapo", 4, ALL, 0.0, 0.5),
        ("dapo", 4, ALL, 0.0, 0.5, False), ("dapo", 1, ALL, 0.0, 1.0)],))[0]
    dp2 = run_distributed(_grads, 2, args=([("dapo", 2, ALL, 0.0, 0.5)],), timeout=300)
    ref = one_rank[0][0]
    _compare(one_rank[1][0], ref)
    _compare(dp2[0][0][0], ref)
    _compare(dp2[1][0][0], ref)
    for other in (one_rank[2][0], one_rank[3][0]):   # per micro-batch; no entropy mask
        with pytest.raises(AssertionError):
            _compare(other, ref)


def test_steps_per_generation():
    """Two optimizer steps of half a generation batch each, against one step over all.

    dapo normalises by the generation batch's tokens, so the two half-step gradients
    add up to the full-batch gradient; grpo averages over each step's own completions
    (4 instead of 8), so the two half-step gradients add up to twice the full one.
    """
    cases = []
    for lt in ("dapo", "grpo"):
        cases += [(lt, 1, ALL, 0.0), (lt, 2, ALL[:4], 0.0), (lt, 2, ALL[4:], 0.0)]
    out = run_distributed(_grads, 1, args=(cases,))[0]
    for j, lt in enumerate(("dapo", "grpo")):
        (full, _), (h1, _), (h2, _) = out[3 * j:3 * j + 3]
        factor = 1.0 if lt == "dapo" else 2.0
        _compare({k: h1[k] + h2[k] for k in h1}, {k: factor * v for k, v in full.items()})


def test_tp2_gradients_equal_tp1():
    ref, ref_loss = run_distributed(_grads, 1, args=([("dapo", 2, ALL, 0.04)],))[0][0]
    tp2 = run_distributed(_grads, 2, args=([("dapo", 2, ALL, 0.04)], 2), timeout=300)
    _compare(tp2[0][0][0], ref, rtol=1e-4)
    assert tp2[0][0][1].item() == pytest.approx(ref_loss.item(), rel=1e-5)


def _reduce(rank, world):
    import torch.distributed as dist

    from megatron_grpo.train import reduce_partials

    r = float(rank)
    parts = {"sum": {"loss": torch.tensor(1.5 + r, dtype=torch.float64),
                     "n": torch.tensor(2.0 * r, dtype=torch.float64)},
             "min": {"a": torch.tensor(r - 1.25, dtype=torch.float64),
                     "b": torch.tensor(float("inf") if rank else 3.0, dtype=torch.float64)},
             "max": {"c": torch.tensor(-r, dtype=torch.float64)}}
    out = reduce_partials(parts, group=dist.group.WORLD)
    return {op: {k: float(v) for k, v in d.items()} for op, d in out.items()}


@pytest.mark.parametrize("world", [2, 3])
def test_reduce_partials_sum_min_max_over_ranks(world):
    """sum, min and max travel in one all-gather (min = -max(-x)), reduced on each rank:
    the same numbers as three reductions, on every rank."""
    out = run_distributed(_reduce, world)
    want = {"sum": {"loss": sum(1.5 + r for r in range(world)),
                    "n": sum(2.0 * r for r in range(world))},
            "min": {"a": -1.25, "b": 3.0}, "max": {"c": 0.0}}
    assert out == [want] * world
