"""Core attention of the project's own for Megatron's local (non-Transformer-Engine) layer
spec: context parallelism and packed sequences.

Megatron-Core's `DotProductAttention` refuses context parallelism and packed sequences
(`packed_seq_params`), and Transformer Engine (whose attention does both) exists only on
GPUs. This module takes the local attention's place when --context_parallel_size > 1
or --padding_free true without TE.

Layout (see `data/cp_split.py`): the sequence, padded to a multiple of 2*cp, is cut
into 2*cp chunks and CP rank r holds chunks r and 2*cp-1-r, in that order. Megatron's
rotary embedding already rotates each rank's queries and keys with those global
positions (`RotaryEmbedding.forward` -> `get_pos_emb_on_this_cp_rank`).

Algorithm (all-gather, not ring): every rank all-gathers K and V of the whole
sequence across the CP group, scores its own queries against all keys and masks
causally by GLOBAL position: query at position p sees keys at positions <= p. The
gathered keys are left in rank-major order instead of being reordered into
sequence order: softmax and the weighted sum over keys do not depend on the key
order, only the mask needs each key's global position. Memory is O(s) for K/V and
O(s/cp * s) for the scores per head.

Packed sequences (THD: `packed_seq_params.qkv_format == "thd"`, query [t, np, hn]): the
t tokens are sequences one after the other, boundaries at cu_seqlens (the padded ones
when given: that is the layout). The mask is block-diagonal causal: a token sees the
earlier tokens of its own sequence only. Rather than one [t, t] score matrix mostly
masked ((sum_i n_i)^2), the n sequences are attended as a batch of rows (`_packed_plan`:
n * max_i n_i^2, one product) or, when their lengths are far apart, one by one
(sum_i n_i^2, a Python loop per layer); the choice changes only speed.
Under CP every sequence is split in 2*cp chunks (`cp_split.packed_local_positions`):
rank q holds sequence i at local offsets [cu_i / cp, cu_(i+1) / cp), so after the
all-gather sequence i's keys are those slices of every rank's block, rank-major, the
same arrangement as one unpacked sequence of length cu_(i+1) - cu_i. RoPE restarts at 0
in every sequence: Megatron's `apply_rotary_pos_emb` does that from the same cu_seqlens
(`_apply_rotary_pos_emb_thd`), on the local spec as on TE's.

Backward: the all-gather's adjoint is a reduce-scatter (every rank's queries
contribute to the gradient of every rank's keys; rank r keeps the sum for its own
rows). The rest is autograd through plain tensor math, so the gradient is exact.

Supported: causal self-attention, GQA, attention_dropout 0 (these families), no
attention mask argument (right padding needs none under a causal mask; padded
positions are dropped by the loss mask).
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import divide
from torch import Tensor

from ..data.cp_split import local_positions
from ..platform.compat import megatron as compat

# torch 2.13 renamed the tensor collectives (the old names warn); older torch has only those.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_HINT = "the local layer spec's context-parallel attention (CP without Transformer Engine)"


class _GatherSequence(torch.autograd.Function):
    """[s, ...] on each rank -> [cp * s, ...] in rank order; backward reduce-scatters."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        size = dist.get_world_size(group)
        x = x.contiguous()
        out = x.new_empty((size * x.shape[0],) + tuple(x.shape[1:]))
        _all_gather(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        # d loss / d x_r = sum over ranks q of (d loss_q / d gathered)[rows of r]:
        # sum across the group and keep this rank's rows.
        size = dist.get_world_size(ctx.group)
        grad = grad.contiguous()
        out = grad.new_empty((grad.shape[0] // size,) + tuple(grad.shape[1:]))
        _reduce_scatter(out, grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return out, None


@lru_cache(maxsize=64)
def _causal_mask(local_len: int, cp_size: int, cp_rank: int, device: str) -> Tensor:
    """[local_len, cp * local_len] bool, True where a local query must NOT see a gathered key.

    Queries are this rank's tokens; keys are every rank's tokens in rank order (the
    all-gather's order). Both are mapped to global positions.
    """
    total = local_len * cp_size
    q_pos = local_positions(total, cp_size, cp_rank)                          # [sq]
    k_pos = torch.cat([local_positions(total, cp_size, r) for r in range(cp_size)])  # [sk]
    return (k_pos.unsqueeze(0) > q_pos.unsqueeze(1)).to(device)


@lru_cache(maxsize=64)
def _packed_plan(cu: tuple, cp_size: int, cp_rank: int, device: str):
    """Index plan that attends n packed sequences as one batch of n rows.

    cu: padded boundaries of the whole packed row (every rank's tokens). Returns
    q_idx [n, lq] (this rank's tokens of sequence i, into its [t] tokens), k_idx [n, lk]
    (sequence i's keys; under CP into the rank-major gathered [cp * t]), mask [n, lq, lk]
    (True: hidden: a later position, or a slot past the sequence) and q_valid [n, lq].
    Attention cost n * lq * lk (lq = max length / cp, lk = max length): one batched
    product instead of a Python loop over the sequences of every layer. Slots past a
    sequence's end read token 0 and see every key (no all -inf row); they are dropped.
    """
    t = cu[-1] // cp_size
    spans = [(a, b - a) for a, b in zip(cu[:-1], cu[1:]) if b > a]
    longest = max(m for _, m in spans)
    n, lq = len(spans), longest // cp_size
    q_idx = torch.zeros((n, lq), dtype=torch.long)
    q_pos = torch.zeros((n, lq), dtype=torch.long)
    q_valid = torch.zeros((n, lq), dtype=torch.bool)
    k_idx = torch.zeros((n, longest), dtype=torch.long)
    k_pos = torch.full((n, longest), longest, dtype=torch.long)       # past every query
    for i, (start, m) in enumerate(spans):
        k, lo = m // cp_size, start // cp_size
        q_idx[i, :k] = lo + torch.arange(k)
        q_pos[i, :k] = local_positions(m, cp_size, cp_rank)
        q_valid[i, :k] = True
        k_idx[i, :m] = torch.cat([r * t + lo + torch.arange(k) for r in range(cp_size)])
        k_pos[i, :m] = torch.cat([local_positions(m, cp_size, r) for r in range(cp_size)])
    mask = (k_pos.unsqueeze(1) > q_pos.unsqueeze(2)) & q_valid.unsqueeze(2)
    return q_idx.to(device), k_idx.to(device), mask.to(device), q_valid.to(device)


def _rope_positions_on_cpu() -> None:
    """Make Megatron's rotary CP slicing run without CUDA (idempotent).

    `get_pos_emb_on_this_cp_rank` builds its index with `pin_memory=True`, which a
    CPU-only torch refuses. The replacement selects the same chunks (r, 2*cp-1-r).
    Megatron modules imported the function by name, so each reference is replaced
    (platform/compat/megatron.py).
    """
    if getattr(compat.rope_cp_slicing(), "_cpu_safe", False):
        return

    def pos_emb_on_this_cp_rank(pos_emb: Tensor, seq_dim: int, cp_group) -> Tensor:
        if cp_group is None:
            raise ValueError("cp_group must be provided to get positional embedding per CP rank")
        size, rank = cp_group.size(), cp_group.rank()
        idx = local_positions(pos_emb.shape[seq_dim], size, rank).to(pos_emb.device)
        return pos_emb.index_select(seq_dim, idx)

    pos_emb_on_this_cp_rank._cpu_safe = True
    compat.set_rope_cp_slicing(pos_emb_on_this_cp_rank)


class ContextParallelDotProductAttention(MegatronModule):
    """Drop-in for Megatron's `DotProductAttention` (same constructor and forward) under CP
    and/or with packed sequences.

    forward: query [sq, b, np, hn], key/value [sq, b, ng, hn] (this rank's chunks)
    -> context [sq, b, np * hn]; with packed_seq_params (THD) query [t, np, hn] -> [t, np * hn].
    Also correct for cp = 1 (plain causal attention).
    """

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, cp_comm_type: Optional[str] = None,
                 pg_collection=None):
        super().__init__(config=config)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(f"attention_dropout {dropout} is not supported by {_HINT}; "
                             "valid: 0.0 (the value of the supported families)")
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"attention mask type {attn_mask_type.name} is not supported by "
                             f"{_HINT}; valid: causal")
        if attention_type != "self":
            raise ValueError(f"attention_type {attention_type!r} is not supported by {_HINT}; "
                             "valid: 'self'")
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError(f"softmax_type {config.softmax_type!r} is not supported by {_HINT};"
                             " valid: 'vanilla'")
        if getattr(config, "window_size", None) is not None:
            raise ValueError(f"sliding-window attention (window_size {config.window_size}) is "
                             f"not supported by {_HINT}")
        if pg_collection is not None and getattr(pg_collection, "tp", None) is not None:
            tp_size = pg_collection.tp.size()
        else:
            tp_size = parallel_state.get_tensor_model_parallel_world_size()
        self.cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        if self.cp_group is None:
            self.cp_group = parallel_state.get_context_parallel_group()
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.num_heads = divide(config.num_attention_heads, tp_size)     # np
        self.num_groups = divide(config.num_query_groups, tp_size)       # ng
        # apply_query_key_layer_scaling only moves a factor between the product and the
        # fp32 softmax in Megatron; the scores here are scaled once, so it needs nothing.
        head_dim = config.kv_channels
        self.softmax_scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
        if not torch.cuda.is_available():
            _rope_positions_on_cpu()

    def forward(self, query: Tensor, key: Tensor, value: Tensor,
                attention_mask: Optional[Tensor], attn_mask_type: Optional[AttnMaskType] = None,
                attention_bias: Optional[Tensor] = None, packed_seq_params=None) -> Tensor:
        if attention_bias is not None:
            raise ValueError(f"attention_bias is not supported by {_HINT}")
        if attention_mask is not None:
            raise ValueError(f"an explicit attention_mask is not supported by {_HINT}: pass "
                             "None (the causal mask is built from global positions; right "
                             "padding is dropped by the loss mask)")
        if attn_mask_type is not None and attn_mask_type not in (AttnMaskType.causal,
                                                                 AttnMaskType.padding_causal):
            raise ValueError(f"attention mask type {attn_mask_type.name} is not supported by "
                             f"{_HINT}; valid: causal")
        cp_size = dist.get_world_size(self.cp_group) if self.cp_group is not None else 1
        cp_rank = dist.get_rank(self.cp_group) if cp_size > 1 else 0
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params, cp_size, cp_rank)
        sq = query.shape[0]
        if cp_size > 1 and sq % 2 != 0:
            raise ValueError(f"local sequence length {sq} is odd: under context parallelism "
                             "each rank holds two equal chunks; split the batch with "
                             "data.cp_split.shard_batch (it pads to a multiple of 2*cp)")
        if cp_size > 1:
            key, value = self._gather_kv(key, value)
        mask = _causal_mask(sq, cp_size, cp_rank, str(query.device))
        return self._attend(query, key, value, mask)

    def _gather_kv(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """K and V of every CP rank, rank-major along dim 0: one collective for both."""
        hn = key.shape[-1]
        kv = _GatherSequence.apply(torch.cat([key, value], dim=-1), self.cp_group)
        return kv.split([hn, value.shape[-1]], dim=-1)

    def _packed(self, query: Tensor, key: Tensor, value: Tensor, params, cp_size: int,
                cp_rank: int) -> Tensor:
        """THD: query [t, np, hn], key/value [t, ng, h*] (this rank's tokens of every packed
        sequence) -> [t, np * hv], each sequence attending causally to itself only."""
        if getattr(params, "qkv_format", "thd") != "thd":
            raise ValueError(f"packed_seq_params.qkv_format {params.qkv_format!r} is not "
                             f"supported by {_HINT}; valid: 'thd'")
        cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None \
            else params.cu_seqlens_q
        if cu is None:
            raise ValueError(f"packed sequences without boundaries: packed_seq_params needs "
                             f"cu_seqlens_q (or cu_seqlens_q_padded) for {_HINT}")
        t = query.shape[0]
        cu = tuple(int(c) for c in cu.tolist())
        if cu[-1] != t * cp_size:
            raise ValueError(f"packed sequences end at {cu[-1]} (cu_seqlens) but this rank "
                             f"holds {t} tokens x cp {cp_size}; pack with "
                             "train.packing.pack_micro_batch")
        if cp_size > 1:
            key, value = self._gather_kv(key, value)             # [cp * t, ng, h*]
        lengths = [b - a for a, b in zip(cu[:-1], cu[1:]) if b > a]
        if len(lengths) * max(lengths) ** 2 > 2 * sum(m * m for m in lengths):
            # Lengths far apart: a batch would mostly score padding; sequence by sequence
            # costs sum_i m_i^2 (plus Python per sequence, small next to long sequences).
            return self._packed_loop(query, key, value, cu, cp_size, cp_rank)
        q_idx, k_idx, mask, q_valid = _packed_plan(cu, cp_size, cp_rank, str(query.device))
        # [n, lq | lk, heads, h*] -> the [s, b, ...] layout of _attend, b = the sequences
        out = self._attend(query[q_idx].transpose(0, 1), key[k_idx].transpose(0, 1),
                           value[k_idx].transpose(0, 1), mask.unsqueeze(1))
        return out.transpose(0, 1)[q_valid]                     # [t, np * hv], local order

    def _packed_loop(self, query: Tensor, key: Tensor, value: Tensor, cu: tuple, cp_size: int,
                     cp_rank: int) -> Tensor:
        """`_packed` one sequence at a time: sequence i's queries are this rank's tokens
        [cu_i / cp, cu_(i+1) / cp), its keys that slice of every rank's block, rank-major."""
        t = query.shape[0]
        outs = []
        for start, end in zip(cu[:-1], cu[1:]):
            lo, hi = start // cp_size, end // cp_size
            if hi == lo:
                continue
            k = torch.cat([key[r * t + lo:r * t + hi] for r in range(cp_size)])
            v = torch.cat([value[r * t + lo:r * t + hi] for r in range(cp_size)])
            mask = _causal_mask(hi - lo, cp_size, cp_rank, str(query.device))
            outs.append(self._attend(query[lo:hi, None], k[:, None], v[:, None], mask)[:, 0])
        return torch.cat(outs)                                   # [t, np * hv]

    def _attend(self, query: Tensor, key: Tensor, value: Tensor, mask: Tensor) -> Tensor:
        """query [sq, b, np, hn], key/value [sk, b, ng, h*], mask broadcastable to
        [b, np, sq, sk] (True: hidden) -> context [sq, b, np * hv]."""
        sq, b, np_, hn = query.shape
        hv = value.shape[-1]
        q = query.permute(1, 2, 0, 3)                   # [b, np, sq, hn]
        k = key.permute(1, 2, 0, 3)                     # [b, ng, sk, hn]
        v = value.permute(1, 2, 0, 3)                   # [b, ng, sk, hv]
        # softmax(q k^T * scale, masked) v as one fused kernel (torch's flash attention on
        # CPU: no [sq, sk] scores kept for backward, fp32 accumulation for fp16/bf16): about
        # a third less CPU time for forward + backward than matmul, masked_fill, softmax,
        # matmul on the small shape of docs/benchmarks.md (16 packed sequences of ~150
        # tokens, 8 heads, 2 kv groups). GQA: query head i reads kv group i // (np / ng), as
        # Megatron's repeat_interleave. Every query sees at least itself: no row is fully
        # masked.
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=~mask,
                                                 scale=self.softmax_scale,
                                                 enable_gqa=np_ != key.shape[2])
        return context.permute(2, 0, 1, 3).reshape(sq, b, np_ * hv)   # [sq, b, np * hv]
