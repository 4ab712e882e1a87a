"""Fused log-prob/entropy kernel, one process (TP=1): values, gradients, memory behaviour.

The reference is written independently of the kernel: full float64 logits, log_softmax, gather,
entropy -sum p log p, gradients by float64 autograd.
"""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_grpo.kernels import vocab_parallel_logprobs
from megatron_grpo.kernels.logprob import _resolve_backend
from megatron_grpo.kernels.torch_chunk import TorchChunkOps

TOL = 1e-5


def reference(hidden, weight, targets, temperature, c_lp, c_ent):
    """float64 logp, entropy and d(sum(c_lp*logp + c_ent*entropy))/d(hidden, weight)."""
    h = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    logits = h @ w.t() / temperature                                    # [T, V]
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(1, targets.long().unsqueeze(1)).squeeze(1)
    ent = -(logp_all.exp() * logp_all).sum(dim=-1)
    loss = (c_lp.double() * logp).sum() + (c_ent.double() * ent).sum()
    loss.backward()
    return logp.detach(), ent.detach(), h.grad, w.grad


def rel(x, ref):
    return ((x.double() - ref).norm() / ref.norm()).item()


def make_inputs(T, H, V, seed=0, dtype=torch.float32, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(T, H, generator=g) * scale).to(dtype)
    weight = (torch.randn(V, H, generator=g) * 0.5).to(dtype)
    targets = torch.randint(0, V, (T,), generator=g)
    c_lp = torch.randn(T, generator=g)
    c_ent = torch.randn(T, generator=g)
    return hidden, weight, targets, c_lp, c_ent


def run_kernel(hidden, weight, targets, c_lp, c_ent, **kw):
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    logp, ent = vocab_parallel_logprobs(h, w, targets, **kw)
    loss = (c_lp * logp).sum() + (c_ent * ent).sum()
    loss.backward()
    return logp.detach(), ent.detach(), h.grad, w.grad


@pytest.mark.parametrize("T,H,V,ct,cv", [
    (37, 16, 1003, 8, 64),       # chunks divide neither T nor V
    (37, 16, 1003, 5, 1000),     # one ragged last vocab chunk of 3 columns
    (37, 16, 1003, 4096, 8192),  # a single tile
    (1, 8, 7, 1, 1),             # one token, one-column tiles
])
def test_matches_float64_reference(T, H, V, ct, cv):
    hidden, weight, targets, c_lp, c_ent = make_inputs(T, H, V)
    out = run_kernel(hidden, weight, targets, c_lp, c_ent, temperature=0.7,
                     chunk_size_tokens=ct, chunk_size_vocab=cv)
    ref = reference(hidden, weight, targets, 0.7, c_lp, c_ent)
    for name, x, r in zip(("logp", "entropy", "grad_hidden", "grad_weight"), out, ref):
        assert x.dtype == (torch.float32), name
        assert rel(x, r) <= TOL, (name, rel(x, r))


def test_each_output_alone_and_without_entropy():
    hidden, weight, targets, c_lp, c_ent = make_inputs(29, 12, 301, seed=1)
    kw = dict(temperature=0.7, chunk_size_tokens=6, chunk_size_vocab=50)
    zero = torch.zeros_like(c_lp)
    # entropy alone: logp's gradient never reaches backward (None, not zeros)
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    _, ent = vocab_parallel_logprobs(h, w, targets, **kw)
    (c_ent * ent).sum().backward()
    ref = reference(hidden, weight, targets, 0.7, zero, c_ent)
    assert rel(h.grad, ref[2]) <= TOL and rel(w.grad, ref[3]) <= TOL
    # logp alone, entropy not computed
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    logp, none = vocab_parallel_logprobs(h, w, targets, compute_entropy=False, **kw)
    assert none is None
    (c_lp * logp).sum().backward()
    ref = reference(hidden, weight, targets, 0.7, c_lp, zero)
    assert rel(logp, ref[0]) <= TOL
    assert rel(h.grad, ref[2]) <= TOL and rel(w.grad, ref[3]) <= TOL


def test_frozen_weight_and_frozen_hidden():
    hidden, weight, targets, c_lp, c_ent = make_inputs(13, 8, 97, seed=2)
    ref = reference(hidden, weight, targets, 1.3, c_lp, c_ent)
    kw = dict(temperature=1.3, chunk_size_tokens=4, chunk_size_vocab=10)
    h = hidden.clone().requires_grad_()
    logp, ent = vocab_parallel_logprobs(h, weight, targets, **kw)
    ((c_lp * logp).sum() + (c_ent * ent).sum()).backward()
    assert rel(h.grad, ref[2]) <= TOL
    w = weight.clone().requires_grad_()
    logp, ent = vocab_parallel_logprobs(hidden, w, targets, **kw)
    ((c_lp * logp).sum() + (c_ent * ent).sum()).backward()
    assert rel(w.grad, ref[3]) <= TOL


def test_large_logits_are_stable():
    # Logits of magnitude ~100: a naive exp overflows; entropy is small, so compare it absolutely.
    hidden, weight, targets, c_lp, c_ent = make_inputs(23, 16, 211, seed=3, scale=30.0)
    out = run_kernel(hidden, weight, targets, c_lp, c_ent, temperature=0.7,
                     chunk_size_tokens=7, chunk_size_vocab=33)
    ref = reference(hidden, weight, targets, 0.7, c_lp, c_ent)
    assert all(torch.isfinite(x).all() for x in out)
    assert rel(out[0], ref[0]) <= TOL
    assert (out[1].double() - ref[1]).abs().max() <= 1e-4
    assert rel(out[2], ref[2]) <= 1e-4 and rel(out[3], ref[3]) <= 1e-4


def test_bfloat16_inputs():
    # The math is fp32 on the bf16 values: logp/entropy match the float64 reference on the
    # same (rounded) inputs; gradients come back in bf16, so they carry bf16 rounding.
    hidden, weight, targets, c_lp, c_ent = make_inputs(31, 16, 257, seed=4, dtype=torch.bfloat16)
    out = run_kernel(hidden, weight, targets, c_lp, c_ent, temperature=0.7,
                     chunk_size_tokens=8, chunk_size_vocab=40)
    ref = reference(hidden, weight, targets, 0.7, c_lp, c_ent)
    assert out[0].dtype == out[1].dtype == torch.float32
    assert out[2].dtype == out[3].dtype == torch.bfloat16
    assert rel(out[0], ref[0]) <= TOL and rel(out[1], ref[1]) <= TOL
    assert rel(out[2], ref[2]) <= 1e-2 and rel(out[3], ref[3]) <= 1e-2


def test_sequence_parallel_without_tp_is_plain():
    hidden, weight, targets, c_lp, c_ent = make_inputs(11, 8, 50, seed=5)
    a = run_kernel(hidden, weight, targets, c_lp, c_ent, chunk_size_vocab=7)
    b = run_kernel(hidden, weight, targets, c_lp, c_ent, chunk_size_vocab=7,
                   sequence_parallel=True)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_saves_no_logits_for_backward():
    T, H, V = 64, 8, 512
    hidden, weight, targets, c_lp, c_ent = make_inputs(T, H, V, seed=6)
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp, ent = vocab_parallel_logprobs(h, w, targets, chunk_size_tokens=16,
                                            chunk_size_vocab=64)
    # What the kernel keeps: its inputs and [T] vectors (target columns, lse, entropy).
    assert sorted(saved) == sorted([(T, H), (V, H), (T,), (T,), (T,)]), saved


class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor any aten op produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_no_intermediate_is_logits_sized():
    # T * V = 65536 elements; a tile is 16 * 64 = 1024; the largest legitimate tensors are the
    # weight gradient (V * H = 4096) and the hidden gradient (T * H = 512).
    T, H, V, ct, cv = 128, 8, 512, 16, 64
    hidden, weight, targets, c_lp, c_ent = make_inputs(T, H, V, seed=7)
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    mode = _LargestTensor()
    with mode:
        logp, ent = vocab_parallel_logprobs(h, w, targets, chunk_size_tokens=ct,
                                            chunk_size_vocab=cv)
        ((c_lp * logp).sum() + (c_ent * ent).sum()).backward()
    assert mode.largest <= max(ct * cv, V * H, T * H), mode.largest
    # The check can fail: the naive path trips it.
    mode = _LargestTensor()
    with mode:
        torch.log_softmax(h @ w.t(), dim=-1)
    assert mode.largest == T * V


def test_cpu_dispatch_picks_torch():
    assert _resolve_backend("auto", torch.device("cpu")) is TorchChunkOps
    assert _resolve_backend("torch", torch.device("cpu")) is TorchChunkOps


@pytest.mark.parametrize("kw,match", [
    (dict(temperature=0.0), "temperature"),
    (dict(temperature=-1.0), "temperature"),
    (dict(chunk_size_tokens=0), "chunk_size_tokens"),
    (dict(chunk_size_vocab=2.5), "chunk_size_vocab"),
    (dict(backend="cuda"), "backend"),
])
def test_bad_options_raise(kw, match):
    hidden, weight, targets, _, _ = make_inputs(5, 4, 9)
    with pytest.raises(ValueError, match=match):
        vocab_parallel_logprobs(hidden, weight, targets, **kw)


def test_bad_shapes_raise():
    hidden, weight, targets, _, _ = make_inputs(5, 4, 9)
    with pytest.raises(ValueError, match="hidden size"):
        vocab_parallel_logprobs(hidden, weight[:, :3], targets)
    with pytest.raises(ValueError, match="targets"):
        vocab_parallel_logprobs(hidden, weight, targets[:4])
    with pytest.raises(ValueError, match=r"\[T, H\]"):
        vocab_parallel_logprobs(hidden.unsqueeze(0), weight, targets)
