"""The local context-parallel core attention (padded and packed THD sequences) against a
float64 causal attention written here."""
import torch

from tests.harness import run_distributed

S, B, NP, NG, HN = 12, 2, 4, 2, 8         # 12 tokens = 2*cp chunks of 3 for cp=2


def _reference(q, k, v):
    """softmax(q k^T / sqrt(d) + causal) v per head, kv head h // (np/ng); [s, b, n, d] in."""
    s, rep = q.shape[0], q.shape[2] // k.shape[2]
    out = torch.empty(s, q.shape[1], q.shape[2], v.shape[3], dtype=q.dtype)
    for h in range(q.shape[2]):
        g = h // rep
        for bi in range(q.shape[1]):
            scores = q[:, bi, h] @ k[:, bi, g].T / q.shape[3] ** 0.5          # [s, s]
            scores = scores.masked_fill(torch.ones(s, s).triu(1).bool(), float("-inf"))
            out[:, bi, h] = torch.softmax(scores, -1) @ v[:, bi, g]
    return out.reshape(s, q.shape[1], -1)


def _config(cp, **kw):
    from megatron.core.transformer import TransformerConfig

    kw.setdefault("attention_dropout", 0.0)        # Megatron's default is 0.1
    return TransformerConfig(num_layers=1, hidden_size=NP * HN, num_attention_heads=NP,
                             num_query_groups=NG, kv_channels=HN, context_parallel_size=cp,
                             use_cpu_initialization=True, **kw)


def _body(rank, world):
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_grpo.data.cp_split import gather_from_cp, split_for_cp
    from megatron_grpo.model.cp_attention import ContextParallelDotProductAttention
    from megatron_grpo.platform import ParallelDims, init_parallel

    init_parallel(ParallelDims(world_size=world, cp=world))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(S, B, n, HN, generator=g) for n in (NP, NG, NG))
    w = torch.randn(S, B, NP * HN, generator=g)             # weights of a linear test loss
    attn = ContextParallelDotProductAttention(_config(world), 1, AttnMaskType.causal, "self")
    local = [split_for_cp(t, world, rank, dim=0).requires_grad_() for t in (q, k, v)]
    out = attn(*local, None)
    (out * split_for_cp(w, world, rank, dim=0)).sum().backward()
    result = {"out": gather_from_cp(out, dim=0)}
    for name, t in zip("qkv", local):
        result["d" + name] = gather_from_cp(t.grad, dim=0)

    for i, lengths in enumerate(PACKED):
        result.update(_packed(attn, rank, world, lengths, f"packed{i}"))
    errors = {}
    for name, call in {
        "packed": lambda: attn(*local, None, packed_seq_params=PackedSeqParams(qkv_format="thd")),
        "mask": lambda: attn(*local, torch.ones(1, 1, S // world, S, dtype=torch.bool)),
        "odd": lambda: attn(*(t[:-1] for t in local), None),
        "dropout": lambda: ContextParallelDotProductAttention(
            _config(world, attention_dropout=0.1), 1, AttnMaskType.causal, "self"),
    }.items():
        try:
            call()
            errors[name] = None
        except ValueError as e:
            errors[name] = str(e)
    return result, errors


def _packed(attn, rank, world, lengths, tag):
    """Packed sequences (THD) of `lengths`, each split in 2*cp chunks: this rank's
    output and q/k/v gradients, gathered back into the packed order."""
    import torch.distributed as dist
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_grpo.data.cp_split import packed_local_positions

    g = torch.Generator().manual_seed(1)
    t = sum(lengths)
    q, k, v = (torch.randn(t, n, HN, generator=g) for n in (NP, NG, NG))
    w = torch.randn(t, NP * HN, generator=g)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
    every = [packed_local_positions(cu.tolist(), world, r) for r in range(world)]
    local = [x[every[rank]].clone().requires_grad_() for x in (q, k, v)]
    out = attn(*local, None, packed_seq_params=params)                 # [t / cp, np * hn]
    (out * w[every[rank]]).sum().backward()

    def gather(x):
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.detach().contiguous())
        full = x.new_empty((t,) + tuple(x.shape[1:]))
        for idx, part in zip(every, parts):
            full[idx] = part
        return full
    return {f"{tag}_out": gather(out), **{f"{tag}_d{n}": gather(x.grad)
                                          for n, x in zip("qkv", local)}}


# Sequence lengths (multiples of 2*cp): close ones are attended as one batch of rows,
# far-apart ones one by one (model/cp_attention.py `_packed`); both paths are checked.
PACKED = [[8, 4, 12], [4, 4, 4, 24]]


def test_cp2_matches_float64_reference():
    results = run_distributed(_body, 2, timeout=120)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(S, B, n, HN, generator=g).double().requires_grad_()
               for n in (NP, NG, NG))
    w = torch.randn(S, B, NP * HN, generator=g).double()
    ref = _reference(q, k, v)
    (ref * w).sum().backward()
    want = {"out": ref.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    for rank, (got, _) in enumerate(results):
        for name, tensor in want.items():
            torch.testing.assert_close(got[name].double(), tensor, atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"rank {rank} {name}: {m}")
    # Packed: every sequence attends causally to itself only (float64, one by one).
    for i, lengths in enumerate(PACKED):
        g = torch.Generator().manual_seed(1)
        t = sum(lengths)
        q, k, v = (torch.randn(t, n, HN, generator=g).double().requires_grad_()
                   for n in (NP, NG, NG))
        w = torch.randn(t, NP * HN, generator=g).double()
        bounds = [0] + torch.tensor(lengths).cumsum(0).tolist()
        ref = torch.cat([_reference(q[a:b, None], k[a:b, None], v[a:b, None])[:, 0]
                         for a, b in zip(bounds[:-1], bounds[1:])])
        (ref * w).sum().backward()
        want = {"out": ref.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
        for rank, (got, _) in enumerate(results):
            for name, tensor in want.items():
                torch.testing.assert_close(got[f"packed{i}_{name}"].double(), tensor,
                                           atol=1e-5, rtol=1e-5,
                                           msg=lambda m: f"rank {rank} packed{i} {name}: {m}")
    errors = results[0][1]
    assert "cu_seqlens" in errors["packed"]
    assert "attention_mask" in errors["mask"]
    assert "odd" in errors["odd"]
    assert "attention_dropout 0.1" in errors["dropout"]
