"""Fused log-prob/entropy kernel under tensor parallelism (TP=2, gloo), with and without
sequence parallelism, against the float64 full-vocab reference of test_kernels_logprob."""
from __future__ import annotations

import pytest
import torch

from tests.harness import run_distributed
from tests.test_kernels_logprob import TOL, make_inputs, reference, rel

# V = 1002 splits into 2 shards of 501 (the padded-vocab layout); 501 % 64 != 0 and T % 8 != 0.
H, V, CT, CV, TEMP = 16, 1002, 8, 64, 0.7


def _body(rank, world_size, cases, seed):
    import torch.distributed as dist

    group = dist.new_group(list(range(world_size)))
    return [_one_case(rank, world_size, group, T, sp, seed) for sp, T in cases]


def _one_case(rank, world_size, group, T, sequence_parallel, seed):
    from megatron_grpo.kernels import vocab_parallel_logprobs

    hidden, weight, targets, c_lp, c_ent = make_inputs(T, H, V, seed=seed)
    vl = V // world_size
    w = weight[rank * vl:(rank + 1) * vl].clone().requires_grad_()        # [V/tp, H]
    if sequence_parallel:
        tl = T // world_size
        h = hidden[rank * tl:(rank + 1) * tl].clone().requires_grad_()   # [T/tp, H]
    else:
        h = hidden.clone().requires_grad_()                              # [T, H] replicated
    logp, ent = vocab_parallel_logprobs(h, w, targets, temperature=TEMP, tp_group=group,
                                        chunk_size_tokens=CT, chunk_size_vocab=CV,
                                        sequence_parallel=sequence_parallel)
    ((c_lp * logp).sum() + (c_ent * ent).sum()).backward()
    return logp.detach(), ent.detach(), h.grad, w.grad


CASES = [(False, 37), (True, 38)]   # (sequence_parallel, T); SP needs T % tp == 0


@pytest.fixture(scope="module")
def tp2_results():
    """Both cases in one pair of processes (spawning costs more than the cases)."""
    return run_distributed(_body, world_size=2, args=(CASES, 11), timeout=120)


@pytest.mark.parametrize("case", range(len(CASES)), ids=["replicated", "sequence_parallel"])
def test_tp2_matches_float64_reference(tp2_results, case):
    sequence_parallel, T = CASES[case]
    seed = 11
    results = [r[case] for r in tp2_results]
    hidden, weight, targets, c_lp, c_ent = make_inputs(T, H, V, seed=seed)
    ref_lp, ref_ent, ref_gh, ref_gw = reference(hidden, weight, targets, TEMP, c_lp, c_ent)

    (lp0, ent0, gh0, gw0), (lp1, ent1, gh1, gw1) = results
    # Every TP rank combines the same gathered statistics: bitwise-equal outputs.
    assert torch.equal(lp0, lp1) and torch.equal(ent0, ent1)
    assert rel(lp0, ref_lp) <= TOL and rel(ent0, ref_ent) <= TOL
    assert rel(torch.cat([gw0, gw1]), ref_gw) <= TOL
    if sequence_parallel:   # each rank gets the gradient of its own rows, summed over TP
        assert gh0.shape == (T // 2, H)
        assert rel(torch.cat([gh0, gh1]), ref_gh) <= TOL
    else:                   # replicated input: the full gradient on both ranks
        assert torch.equal(gh0, gh1)
        assert rel(gh0, ref_gh) <= TOL
