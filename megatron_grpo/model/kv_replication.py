"""Keep replicated kv heads identical during training (fewer kv heads than TP ranks).

With `num_key_value_heads < tp`, the model is built with `num_query_groups = tp`
(model/config.py) and every TP rank holds its own replica of one HF kv head (the
bridge loads the same weights into each replica). In backward, replica r of kv head h
only sees the gradient of the query heads on its own rank; the true gradient of the
HF kv head is the SUM over its replicas. Left alone, the replicas would get different
updates and drift apart (and the exported head would be just one of them).

    loss = forward_backward_func(...)                 # grads in .grad or DDP main_grad
    finalize_model_grads(chunks)                      # (inside the schedule) DP reduce
    sync_replicated_kv_grads(chunks, config, args)    # here: before clipping and step
    optimizer.step()

The DP reduction (an average) and this TP-replica sum commute, so the call may come
before or after it, but it must come before gradient clipping computes the norm.
Other gradients are unaffected: Megatron's column-parallel backward already all-reduces
the input gradient over TP, and q/k layer-norm weights are summed over TP by
`finalize_model_grads` (qk_layernorm).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .builder import unwrap

_QKV_SUFFIXES = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias")


def _grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    """Megatron DDP accumulates into `main_grad`; plain modules into `.grad`."""
    main = getattr(param, "main_grad", None)
    return main if main is not None else param.grad


def kv_replicas(config, args) -> int:
    """How many TP ranks hold a copy of each HF kv head (1: no replication)."""
    kv_heads = args.hf_config.get("num_key_value_heads") or config.num_attention_heads
    groups = config.num_query_groups or config.num_attention_heads
    return groups // kv_heads if groups > kv_heads else 1


def sync_replicated_kv_grads(chunks, config, args) -> None:
    """Replace the k/v rows of every `linear_qkv` gradient by their sum over the replicas.

    One all-reduce over the TP group per dtype: rank i writes its kv rows into slot
    `i // replicas` of a zero buffer [kv_heads, n]; the sum leaves in each slot exactly the
    sum over that head's replicas, which each rank copies back.
    """
    replicas = kv_replicas(config, args)
    tp = config.tensor_model_parallel_size
    if replicas == 1 or tp == 1:
        return
    from megatron.core import parallel_state as ps

    heads, groups, d = config.num_attention_heads, config.num_query_groups, config.kv_channels
    q_rows = heads // groups * d                    # q rows of one group; then k (d), v (d)
    local_groups = groups // tp
    kv_heads = groups // replicas
    slot = ps.get_tensor_model_parallel_rank() // replicas

    # Views of the kv rows: grad [local_groups * (q_rows + 2d), ...] -> [local_groups, 2d, ...]
    views: dict[torch.dtype, list[torch.Tensor]] = {}
    for chunk in chunks:
        for name, param in unwrap(chunk).named_parameters():
            if not name.endswith(_QKV_SUFFIXES):
                continue
            grad = _grad(param)
            if grad is None:
                continue
            per_group = grad.view(local_groups, q_rows + 2 * d, *grad.shape[1:])
            views.setdefault(grad.dtype, []).append(per_group[:, q_rows:])
    group = ps.get_tensor_model_parallel_group()
    for dtype, kv_views in views.items():
        sizes = [v.numel() for v in kv_views]
        buf = torch.zeros((kv_heads, sum(sizes)), dtype=dtype, device=kv_views[0].device)
        torch.cat([v.reshape(-1) for v in kv_views], out=buf[slot])
        dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)
        for v, flat in zip(kv_views, buf[slot].split(sizes)):
            v.copy_(flat.view(v.shape))
