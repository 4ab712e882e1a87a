"""Fused vocab-parallel log-prob and entropy from hidden states, without full logits.

    logp, ent = vocab_parallel_logprobs(hidden, weight_shard, targets, temperature=0.7,
                                        tp_group=tp_group, sequence_parallel=False)

Inputs are what Megatron's output layer sees: `hidden` `[T, H]` after the final norm
(`[s, b, H]` flattened s-major, so that a sequence-parallel shard is a block of rows), the
local vocab shard of the output (or tied embedding) weight `[V/tp, H]` (rank r holds rows
`[r*V/tp, (r+1)*V/tp)` of the padded vocab), and global target ids `[T]`. Outputs are fp32
`[T]`, the same on every TP rank:

    z = hidden @ W^T / temperature                          (over the whole padded vocab)
    logp = z[target] - logsumexp(z),   entropy = -sum_j p_j log p_j,   p = softmax(z)

How. Logits are made one `[chunk_tokens, chunk_vocab]` fp32 tile at a time (outer loop over
vocab chunks so each weight chunk is cast once, inner loop over token chunks) and folded into
per-token running statistics (max m, sum of exp s, sum of p*(z-m) a; see `torch_chunk.py`).
Backward recomputes the tiles from the global log-sum-exp instead of saving them, so memory is
O(T*H + chunk_tokens*chunk_vocab), never O(T*V); the price is one extra matmul over the vocab.

Tensor parallelism. Each rank reduces its own vocab shard; the per-rank statistics are then
combined with ONE all-gather of a `[4, T]` block (m, s, a, target logit) rather than an
all-reduce MAX followed by an all-reduce SUM (and a third for the target logit): a single
collective of 4*T floats is latency-bound, so one call beats two or three, and every rank
combines the same gathered numbers in the same order, so logp and entropy are bitwise equal on
all ranks (the loss and its upstream gradient then agree across TP without further care).
The hidden gradient is the sum over vocab shards, so backward all-reduces it over TP exactly
as Megatron's column-parallel layer does for a replicated input (the "copy to TP region"
adjoint); with `sequence_parallel=True` the input is the sequence shard `[T/tp, H]`, forward
all-gathers it and backward reduce-scatters the gradient (and re-gathers the input instead of
saving the gathered copy, as Megatron does). These collectives are called by hand inside
forward/backward; autograd never sees them. Pass the raw final-norm output: do NOT also route
it through Megatron's copy/gather-to-TP-region mappings, or the gradient is reduced twice.

Precision: fp32 throughout (tiles, statistics, hidden-gradient accumulation and its TP
reduction); the returned hidden gradient has the hidden's dtype, the weight gradient the
weight's dtype. Targets must be valid ids of the padded vocab (not checked: that would need a
device sync); padded vocab rows take part in the softmax, as in Megatron's cross entropy,
unless `vocab_size` says where the real vocab ends (then they are left out).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from . import _comm
from .torch_chunk import TorchChunkOps

# Tile sizes tuned with tools/bench_loss.py on CPU (see docs/benchmarks.md): a 1024 x 4096 fp32
# tile is 16 MiB, big enough for near-peak matmul speed, small next to [T, V] logits.
DEFAULT_CHUNK_TOKENS = 1024
DEFAULT_CHUNK_VOCAB = 4096

BACKENDS = ("auto", "torch", "triton")


def _resolve_backend(backend: str, device: torch.device):
    """Pick the per-tile implementation: Triton on CUDA when importable, torch otherwise."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    if backend == "auto":
        if device.type == "cuda":
            from . import triton_logprob  # imports triton, which a CPU run never needs

            if triton_logprob.triton_available():
                return triton_logprob.TritonChunkOps
        return TorchChunkOps
    if backend == "torch":
        return TorchChunkOps
    from . import triton_logprob  # imports triton, which a CPU run never needs

    if not triton_logprob.triton_available():
        raise ValueError("backend='triton' needs the `triton` package; it is not importable. "
                         "Use backend='torch' or 'auto'.")
    return triton_logprob.TritonChunkOps


def _tile_targets(tgt_local: torch.Tensor, v0: int, v1: int) -> torch.Tensor:
    """Column of each target inside vocab tile [v0, v1) of this rank, or -1 if elsewhere."""
    col = tgt_local - v0                                                   # [ct]
    return torch.where((col >= 0) & (col < v1 - v0), col, torch.full_like(col, -1))


def _tile(ws: dict, name: str, rows: int, cols: int, device) -> torch.Tensor:
    """A contiguous fp32 [rows, cols] view of a flat buffer kept in `ws` for the whole call.
    Reusing one buffer per role (the first tile is the largest) keeps the footprint at a few
    tiles and spares the allocator a malloc/free of a tile-sized block per tile."""
    buf = ws.get(name)
    if buf is None or buf.numel() < rows * cols:
        buf = ws[name] = torch.empty(rows * cols, dtype=torch.float32, device=device)
    return buf[:rows * cols].view(rows, cols)


def _weight_f32(weight: torch.Tensor, v0: int, v1: int, ws: dict) -> torch.Tensor:
    """Rows [v0, v1) of the weight in fp32: a view when fp32, else a copy into a buffer."""
    if weight.dtype == torch.float32:
        return weight[v0:v1]
    return _tile(ws, "w", v1 - v0, weight.shape[1], weight.device).copy_(weight[v0:v1])


def _forward_stats(h32, weight, inv_temp, tgt_local, ct, cv, ops, compute_entropy):
    """Per-token running (m, s, a, target logit) over this rank's vocab shard.
    h32: [T, H] fp32; weight: [Vl, H]."""
    T, Vl = h32.shape[0], weight.shape[0]
    m = torch.full((T,), float("-inf"), dtype=torch.float32, device=h32.device)
    s = torch.zeros(T, dtype=torch.float32, device=h32.device)
    a = torch.zeros_like(s)
    zt = torch.zeros_like(s)
    ws: dict = {}
    for v0 in range(0, Vl, cv):
        v1 = min(v0 + cv, Vl)
        w = _weight_f32(weight, v0, v1, ws)                                # [cv, H]
        for t0 in range(0, T, ct):
            t1 = min(t0 + ct, T)
            z = _tile(ws, "z", t1 - t0, v1 - v0, h32.device)               # [ct, cv]
            # z = h @ w^T / temperature; beta=0: the buffer's old contents are not read.
            torch.addmm(z, h32[t0:t1], w.t(), beta=0, alpha=inv_temp, out=z)
            ops.forward_update(z, _tile_targets(tgt_local[t0:t1], v0, v1),
                               m[t0:t1], s[t0:t1], a[t0:t1], zt[t0:t1], compute_entropy,
                               _tile(ws, "scratch", t1 - t0, v1 - v0, h32.device))
    return m, s, a, zt


def _valid_rows(vocab_size: Optional[int], rank: int, shard_rows: int) -> int:
    """How many rows of this rank's shard are real vocab entries (the rest is padding)."""
    if vocab_size is None:
        return shard_rows
    return max(0, min(shard_rows, vocab_size - rank * shard_rows))


def _combine_stats(m, s, a, zt, group, tp):
    """Merge the per-rank statistics over the TP group -> global (lse, logp, entropy), [T]."""
    if tp > 1:
        local = torch.stack([m, s, a, zt])                                 # [4, T]
        ms, ss, as_, zts = _comm.all_gather_rows(local.unsqueeze(0), group, tp).unbind(1)
        m = ms.amax(dim=0)                                                 # [T]
        w = torch.exp(ms - m)                                              # [tp, T]
        s = (w * ss).sum(dim=0)
        # Shift each rank's a to the global max; a rank whose shard is all padding has
        # m = -inf and s = 0, and (-inf) * 0 would be NaN, so it contributes 0 explicitly.
        shift = torch.where(ss > 0, (ms - m) * ss, torch.zeros_like(ss))
        a = (w * (as_ + shift)).sum(dim=0)
        zt = zts.sum(dim=0)                          # only the owning rank's entry is non-zero
    log_s = torch.log(s)
    lse = m + log_s
    logp = zt - lse
    ent = log_s - a / s                              # H = lse - E[z] = log s - E[z - m]
    return lse, logp, ent


class _VocabParallelLogprob(torch.autograd.Function):
    """(hidden, weight shard, targets) -> (logp [T], entropy [T] or empty); see module doc."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, group, tp, sequence_parallel,
                ct, cv, compute_entropy, ops, vocab_size):
        rank = _comm.group_rank(group) if tp > 1 else 0
        # [T, H]: the full sequence; with SP every rank gathers the shards (rank order).
        h = _comm.all_gather_rows(hidden, group, tp) if sequence_parallel and tp > 1 else hidden
        inv_temp = 1.0 / temperature
        h32 = h.to(torch.float32)                              # [T, H]; no copy when fp32
        tgt_local = targets.to(torch.long) - rank * weight.shape[0]        # [T]
        # Rows of this shard past the real vocab (Megatron's TP padding) are left out of
        # the softmax altogether: they are not tokens of the model.
        valid = _valid_rows(vocab_size, rank, weight.shape[0])
        m, s, a, zt = _forward_stats(h32, weight[:valid], inv_temp, tgt_local, ct, cv, ops,
                                     compute_entropy)
        del h, h32
        lse, logp, ent = _combine_stats(m, s, a, zt, group, tp)
        if not compute_entropy:
            ent = logp.new_empty(0)
            ctx.mark_non_differentiable(ent)
        # Only inputs and [T] vectors are saved: tiles are recomputed in backward.
        ctx.save_for_backward(hidden, weight, tgt_local, lse, ent)
        ctx.group, ctx.tp, ctx.sequence_parallel = group, tp, sequence_parallel
        ctx.inv_temp, ctx.ct, ctx.cv, ctx.ops = inv_temp, ct, cv, ops
        ctx.compute_entropy, ctx.valid = compute_entropy, valid
        ctx.set_materialize_grads(False)   # an unused output arrives as None: skip its terms
        return logp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, tgt_local, lse, ent = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        none_rest = (None,) * 10
        if not ctx.compute_entropy:
            g_ent = None
        if (g_lp is None and g_ent is None) or not (need_h or need_w):
            return (None, None) + none_rest
        g_lp = None if g_lp is None else g_lp.to(torch.float32).contiguous()
        g_ent = None if g_ent is None else g_ent.to(torch.float32).contiguous()
        group, tp, ct, cv, ops = ctx.group, ctx.tp, ctx.ct, ctx.cv, ctx.ops
        sp = ctx.sequence_parallel and tp > 1

        h = _comm.all_gather_rows(hidden, group, tp) if sp else hidden
        h32 = h.to(torch.float32)                              # [T, H]; no copy when fp32
        del h
        T, H = h32.shape
        Vl = ctx.valid                    # padded vocab rows get a zero gradient
        grad_h32 = torch.zeros_like(h32) if need_h else None               # [T, H] fp32
        grad_w = None
        if need_w:                                                         # [V/tp, H]
            grad_w = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
            grad_w[Vl:].zero_()
        inv_temp, ws = ctx.inv_temp, {}
        for v0 in range(0, Vl, cv):
            v1 = min(v0 + cv, Vl)
            w = _weight_f32(weight, v0, v1, ws)                            # [cv, H]
            if need_w:   # fp32 accumulator for this vocab chunk; the output itself when fp32
                gw = grad_w[v0:v1] if grad_w.dtype == torch.float32 else \
                    _tile(ws, "gw", v1 - v0, H, weight.device)
            for t0 in range(0, T, ct):
                t1 = min(t0 + ct, T)
                z = _tile(ws, "z", t1 - t0, v1 - v0, h32.device)           # [ct, cv]
                torch.addmm(z, h32[t0:t1], w.t(), beta=0, alpha=inv_temp, out=z)
                dz = ops.backward_grad(
                    z, _tile_targets(tgt_local[t0:t1], v0, v1), lse[t0:t1],
                    ent[t0:t1] if g_ent is not None else None,
                    None if g_lp is None else g_lp[t0:t1],
                    None if g_ent is None else g_ent[t0:t1],
                    _tile(ws, "scratch", t1 - t0, v1 - v0, h32.device))   # dL/dz [ct, cv]
                # z = h @ W^T / temperature: dz/dh = W / temperature, dz/dW = h / temperature.
                if need_h:
                    grad_h32[t0:t1].addmm_(dz, w, alpha=inv_temp)
                if need_w:
                    torch.addmm(gw, dz.t(), h32[t0:t1], beta=0 if t0 == 0 else 1,
                                alpha=inv_temp, out=gw)
            if need_w and gw.data_ptr() != grad_w[v0:v1].data_ptr():
                grad_w[v0:v1].copy_(gw)
        del h32

        grad_hidden = None
        if need_h:
            if sp:   # adjoint of the forward all-gather: sum over TP, keep this rank's rows
                grad_h32 = _comm.reduce_scatter_rows(grad_h32, group, tp)  # [T/tp, H]
            elif tp > 1:   # replicated input: each rank holds the part from its vocab shard
                _comm.all_reduce_sum_(grad_h32, group)
            grad_hidden = grad_h32.to(hidden.dtype)
        return (grad_hidden, grad_w) + none_rest


def vocab_parallel_logprobs(hidden: torch.Tensor, weight_shard: torch.Tensor,
                            targets: torch.Tensor, *, temperature: float = 1.0,
                            tp_group: Optional[dist.ProcessGroup] = None,
                            chunk_size_tokens: int = DEFAULT_CHUNK_TOKENS,
                            chunk_size_vocab: int = DEFAULT_CHUNK_VOCAB,
                            compute_entropy: bool = True, sequence_parallel: bool = False,
                            backend: str = "auto", vocab_size: Optional[int] = None
                            ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-prob of `targets` and entropy of softmax(hidden @ W^T / temperature), fused.

    Args:
        hidden: `[T, H]` final-norm output, any float dtype; with `sequence_parallel` the
            rank's sequence shard `[T/tp, H]` (rows `[rank*T/tp, (rank+1)*T/tp)`).
        weight_shard: `[V/tp, H]` this rank's rows of the (padded) output weight.
        targets: `[T]` global token ids (all T tokens, also under sequence parallelism).
        temperature: logits are divided by it; must be > 0.
        tp_group: the tensor-parallel group; None means no tensor parallelism.
        chunk_size_tokens, chunk_size_vocab: tile shape; memory is O(their product).
        compute_entropy: also return the entropy (and accept its gradient).
        sequence_parallel: `hidden` is the sequence-parallel shard (Megatron's SP layout).
        backend: "auto" (Triton on CUDA when importable, else torch), "torch" or "triton".
        vocab_size: the real vocab size when the weight's rows are padded for TP (Megatron
            pads to a multiple of 128 * tp): rows >= vocab_size are excluded from the
            softmax and get zero gradient, so log-probs match the unpadded HF model.
            None: every row is a token.

    Returns:
        (logp, entropy): fp32 `[T]` each, identical on every TP rank; entropy is None when
        `compute_entropy` is False. Both are differentiable w.r.t. hidden and weight_shard.
    """
    if not (isinstance(temperature, (int, float)) and temperature > 0):
        raise ValueError(f"temperature={temperature!r} must be a number > 0")
    for name, val in (("chunk_size_tokens", chunk_size_tokens),
                      ("chunk_size_vocab", chunk_size_vocab)):
        if not (isinstance(val, int) and val >= 1):
            raise ValueError(f"{name}={val!r} must be an integer >= 1")
    if hidden.dim() != 2 or weight_shard.dim() != 2:
        raise ValueError(f"hidden must be [T, H] and weight_shard [V/tp, H] (flatten [s, b, H] "
                         f"s-major first); got {tuple(hidden.shape)} and "
                         f"{tuple(weight_shard.shape)}")
    if hidden.shape[1] != weight_shard.shape[1]:
        raise ValueError(f"hidden size mismatch: hidden {tuple(hidden.shape)} vs weight_shard "
                         f"{tuple(weight_shard.shape)}")
    if not hidden.is_floating_point() or not weight_shard.is_floating_point():
        raise ValueError(f"hidden and weight_shard must be floating point; got {hidden.dtype} "
                         f"and {weight_shard.dtype}")
    tp = 1 if tp_group is None else dist.get_world_size(tp_group)
    t_full = hidden.shape[0] * (tp if sequence_parallel else 1)
    if targets.dim() != 1 or targets.shape[0] != t_full or targets.is_floating_point():
        raise ValueError(f"targets must be an integer tensor [T] with T={t_full} "
                         f"(hidden rows{' x tp' if sequence_parallel else ''}); got "
                         f"{targets.dtype} {tuple(targets.shape)}")
    ops = _resolve_backend(backend, hidden.device)
    logp, ent = _VocabParallelLogprob.apply(
        hidden, weight_shard, targets, float(temperature), tp_group, tp, bool(sequence_parallel),
        chunk_size_tokens, chunk_size_vocab, bool(compute_entropy), ops, vocab_size)
    return logp, (ent if compute_entropy else None)
