"""Tensor-parallel collectives used by the fused log-prob kernel.

They are plain (non-differentiable) calls made from inside the autograd Function's forward and
backward: each collective's gradient is written out by hand in `logprob.py`, never left to
autograd, so that a TP gradient is never silently summed twice or not at all.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def group_rank(group: Optional[dist.ProcessGroup]) -> int:
    if group is None and not dist.is_initialized():
        return 0
    return dist.get_rank(group)


def all_gather_rows(x: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    """Concatenate every rank's `x` along dim 0, in rank order: [n, ...] -> [size * n, ...]."""
    x = x.contiguous()
    out = torch.empty((size * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, x, group=group)
    return out


def reduce_scatter_rows(x: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    """Sum `x` over the ranks and keep this rank's block of rows: [size * n, ...] -> [n, ...].
    The adjoint of `all_gather_rows`."""
    x = x.contiguous()
    out = torch.empty((x.shape[0] // size,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.reduce_scatter_tensor(out, x, op=dist.ReduceOp.SUM, group=group)
    return out


def all_reduce_sum_(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x
