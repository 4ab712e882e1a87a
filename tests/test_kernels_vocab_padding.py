"""The kernel leaves Megatron's TP vocab padding out of the softmax (`vocab_size`)."""
import pytest
import torch

from megatron_grpo.kernels import vocab_parallel_logprobs
from tests.harness import run_distributed

T, H, V, V_PAD = 13, 16, 37, 48


def _inputs():
    g = torch.Generator().manual_seed(3)
    h = torch.randn(T, H, generator=g, dtype=torch.float64)
    w = torch.randn(V_PAD, H, generator=g, dtype=torch.float64)
    w[V:] = 0.0                      # padding rows as the bridge loads them
    tg = torch.randint(0, V, (T,), generator=g)
    c_lp, c_ent = torch.randn(T, generator=g), torch.randn(T, generator=g)
    return h, w, tg, c_lp.double(), c_ent.double()


def _reference():
    """float64, unpadded: the HF model's view of the vocab."""
    h, w, tg, c_lp, c_ent = _inputs()
    h.requires_grad_(True)
    w = w.clone().requires_grad_(True)
    logp = torch.log_softmax(h @ w[:V].t() / 0.7, dim=-1)
    lp = logp.gather(1, tg[:, None])[:, 0]
    ent = -(logp.exp() * logp).sum(-1)
    ((lp * c_lp).sum() + (ent * c_ent).sum()).backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


def _run(rank, world):
    import torch.distributed as dist

    h, w, tg, c_lp, c_ent = _inputs()
    shard = V_PAD // world
    hs = h.float().requires_grad_(True)
    ws = w[rank * shard:(rank + 1) * shard].float().clone().requires_grad_(True)
    lp, ent = vocab_parallel_logprobs(hs, ws, tg, temperature=0.7,
                                      tp_group=dist.group.WORLD if world > 1 else None,
                                      chunk_size_tokens=5, chunk_size_vocab=7, vocab_size=V)
    ((lp * c_lp.float()).sum() + (ent * c_ent.float()).sum()).backward()
    return lp.detach(), ent.detach(), hs.grad, ws.grad


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("world", [1, 2])
def test_padded_rows_excluded(world):
    # With 2 ranks of 24 rows, rank 1 holds rows 24..47: 13 real rows and 11 of padding;
    # rank 0's shard is full. world=1 holds everything in one shard. (2 ranks, not 4: the
    # same full, mixed and padding-only shards, on the pooled ranks other tests keep warm.)
    lp_ref, ent_ref, gh_ref, gw_ref = _reference()
    results = run_distributed(_run, world)
    shard = V_PAD // world
    for rank, (lp, ent, gh, gw) in enumerate(results):
        assert _rel(lp, lp_ref) < 1e-5 and _rel(ent, ent_ref) < 1e-5
        assert _rel(gh, gh_ref) < 1e-5
        rows = slice(rank * shard, (rank + 1) * shard)
        expect = gw_ref[rows]
        if expect.norm() > 0:
            assert _rel(gw, expect) < 1e-5
        real = max(0, min(shard, V - rank * shard))
        assert torch.all(gw[real:] == 0), "padding rows must get no gradient"


def _all_padding_shard(rank, world):
    # V=10 over a padded 48 in 2 shards: rank 1 holds no real row at all.
    import torch.distributed as dist

    g = torch.Generator().manual_seed(0)
    h = torch.randn(5, H, generator=g)
    w = torch.randn(V_PAD, H, generator=g)
    tg = torch.randint(0, 10, (5,), generator=g)
    shard = V_PAD // world
    lp, ent = vocab_parallel_logprobs(h, w[rank * shard:(rank + 1) * shard], tg,
                                      tp_group=dist.group.WORLD, vocab_size=10)
    ref = torch.log_softmax(h.double() @ w[:10].double().t(), -1)
    return ((lp.double() - ref.gather(1, tg[:, None])[:, 0]).abs().max().item(),
            bool(torch.isfinite(ent).all()))


def test_shard_of_only_padding():
    for err, finite in run_distributed(_all_padding_shard, 2):
        assert err < 1e-5 and finite
