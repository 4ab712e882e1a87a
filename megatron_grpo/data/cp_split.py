"""Split per-token tensors across context-parallel (CP) ranks, and put them back.

Megatron's layout (the one Transformer Engine's CP attention, Megatron's rotary
embedding and our local `ContextParallelDotProductAttention` all expect): pad the
sequence to a multiple of 2*cp (2*cp*tp under sequence parallelism), cut it into
2*cp equal chunks, and give CP rank r chunks r and 2*cp-1-r. Under a causal mask an
early chunk is cheap and a late one expensive, so every rank gets one of each and
the same amount of work.

    cp=2, s=6 -> padded 8, chunks of 2:   [t0 t1 | t2 t3 | t4 t5 | p p]
    rank 0: chunks 0 and 3 -> [t0 t1 p p]   rank 1: chunks 1 and 2 -> [t2 t3 t4 t5]

    shard = shard_batch({"input_ids": ids, "position_ids": pos, "labels": labels,
                         "loss_mask": mask, "old_logps": old}, cp_size, cp_rank)
    out = model(shard["input_ids"], shard["position_ids"], None)   # [b, S/cp, V/tp]
    full = gather_from_cp(local_values, seq_len=shard.seq_len)   # metrics and tests only

Shift labels (and anything aligned to "the next token") BEFORE splitting: the
split moves whole positions, so position t keeps its own label wherever it lands.
Tensors are padded on the right with `pad_value` (0 by default; position ids get
their own global positions), and `CPShard.valid` marks the padding as invalid:
every per-token loss must multiply by it (or by a loss mask that is 0 there).

Packed sequences (THD, `--padding_free true`): several sequences one after the other in
one row of T tokens, sequence i at [cu[i], cu[i+1]) of the padded offsets `cu`. Under CP
Megatron's convention (Transformer Engine's, and our local attention's) pads EACH
sequence to a multiple of 2*cp and splits each one as above: rank r holds chunks r and
2*cp-1-r of every sequence, sequence after sequence (`packed_local_positions`).

    cu = [0, 4, 12], cp=2:  seq 0 [a0..a3], seq 1 [b0..b7]
    rank 0: a0 a3 | b0 b1 b6 b7        rank 1: a1 a2 | b2 b3 b4 b5
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Mapping, Optional, Sequence

import torch
import torch.distributed as dist


def _check_cp(cp_size: int, cp_rank: int | None = None) -> None:
    if not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"--context_parallel_size must be a positive integer, got {cp_size!r}")
    if cp_rank is not None and not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} is out of range for --context_parallel_size "
                         f"{cp_size}; valid ranks: 0..{cp_size - 1}")


def padded_length(seq_len: int, cp_size: int, sp_size: int = 1) -> int:
    """The sequence length after padding to a multiple of 2*cp*sp (unchanged for cp=sp=1).

    sp_size: the tensor-parallel size when sequence parallelism is on (each CP rank's
    tokens are split again across the TP ranks), else 1.
    """
    _check_cp(cp_size)
    if not isinstance(sp_size, int) or sp_size < 1:
        raise ValueError(f"sp_size must be a positive integer, got {sp_size!r}")
    if seq_len < 1:
        raise ValueError(f"sequence length must be >= 1, got {seq_len}")
    multiple = (2 * cp_size if cp_size > 1 else 1) * sp_size
    return -(-seq_len // multiple) * multiple


@lru_cache(maxsize=64)
def _positions(padded_len: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    chunk = padded_len // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    second_chunk = 2 * cp_size - 1 - cp_rank
    second = torch.arange(second_chunk * chunk, (second_chunk + 1) * chunk)
    return torch.cat([first, second])


def local_positions(padded_len: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Global positions [padded_len // cp] of the tokens CP rank `cp_rank` holds, in its order."""
    _check_cp(cp_size, cp_rank)
    if cp_size == 1:
        return torch.arange(padded_len)
    if padded_len % (2 * cp_size) != 0:
        raise ValueError(f"sequence length {padded_len} is not a multiple of 2 * "
                         f"--context_parallel_size = {2 * cp_size}; pad it first "
                         "(padded_length / shard_batch do)")
    return _positions(padded_len, cp_size, cp_rank).clone()   # the cached one stays intact


def packed_local_positions(cu_seqlens_padded: Sequence[int], cp_size: int,
                           cp_rank: int) -> torch.Tensor:
    """Indices into the packed row [T] of the tokens CP rank `cp_rank` holds, in its order
    ([T / cp]): for every sequence i, its own load-balanced chunks (`local_positions`)
    shifted by its offset cu_seqlens_padded[i]. Every sequence length must be a multiple
    of 2*cp (cp > 1)."""
    _check_cp(cp_size, cp_rank)
    cu = [int(c) for c in cu_seqlens_padded]
    parts = []
    for start, end in zip(cu[:-1], cu[1:]):
        if cp_size > 1 and (end - start) % (2 * cp_size):
            raise ValueError(f"packed sequence [{start}, {end}) has length {end - start}, not a "
                             f"multiple of 2 * --context_parallel_size = {2 * cp_size}")
        parts.append(start + local_positions(end - start, cp_size, cp_rank))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def pad_sequence(x: torch.Tensor, padded_len: int, dim: int = 1, value=0) -> torch.Tensor:
    """Pad `x` on the right along `dim` to `padded_len` with `value`."""
    extra = padded_len - x.shape[dim]
    if extra < 0:
        raise ValueError(f"cannot pad length {x.shape[dim]} down to {padded_len}")
    if extra == 0:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x, x.new_full(shape, value)], dim=dim)


def split_for_cp(x: torch.Tensor, cp_size: int, cp_rank: int, dim: int = 1,
                 pad_value=0, sp_size: int = 1) -> torch.Tensor:
    """This CP rank's chunks of `x` along `dim` ([b, s] -> [b, S/cp] for dim=1).

    Pads to a multiple of 2*cp*sp first (`padded_length`). Differentiable (an index_select).
    """
    padded = pad_sequence(x, padded_length(x.shape[dim], cp_size, sp_size), dim, pad_value)
    idx = local_positions(padded.shape[dim], cp_size, cp_rank).to(x.device)
    return padded.index_select(dim, idx)


def unsplit(shards: Sequence[torch.Tensor], seq_len: Optional[int] = None,
            dim: int = 1) -> torch.Tensor:
    """Inverse of `split_for_cp`: every CP rank's chunks, listed by rank, -> [b, seq_len].

    `seq_len` trims the padding (default: keep the padded length).
    """
    cp_size = len(shards)
    _check_cp(cp_size)
    padded_len = shards[0].shape[dim] * cp_size
    stacked = torch.cat(list(shards), dim=dim)             # rank-major order
    positions = torch.cat([local_positions(padded_len, cp_size, r) for r in range(cp_size)])
    # stacked[..., j] holds global position positions[j]; argsort inverts that map.
    out = stacked.index_select(dim, torch.argsort(positions).to(stacked.device))
    if seq_len is not None:
        out = out.narrow(dim, 0, seq_len)
    return out


def gather_from_cp(local: torch.Tensor, seq_len: Optional[int] = None, dim: int = 1,
                   group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """All-gather every CP rank's chunks and restore sequence order (no autograd).

    For metrics and tests; a loss should reduce sums and counts across CP instead.
    `group` defaults to Megatron's context-parallel group.
    """
    if group is None:
        from megatron.core import parallel_state

        group = parallel_state.get_context_parallel_group()
    size = dist.get_world_size(group)
    if size == 1:
        return local if seq_len is None else local.narrow(dim, 0, seq_len)
    local = local.detach().contiguous()
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(parts, local, group=group)
    return unsplit(parts, seq_len, dim)


def gather_rows_from_cp(local: torch.Tensor, positions: torch.Tensor, seq_len: int,
                        group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """Packed CP (train/packing.py): every rank's row view [b, L] -> [b, seq_len] in
    sequence order (no autograd). positions [cp, b, L]: each rank's position of each slot
    in the row (unused slots point past seq_len and are dropped)."""
    if group is None:
        from megatron.core import parallel_state

        group = parallel_state.get_context_parallel_group()
    local = local.detach().contiguous()
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local, group=group)
    positions = positions.to(local.device)
    out = local.new_zeros((local.shape[0], max(int(positions.max()) + 1, seq_len)))
    for part, pos in zip(parts, positions):
        out.scatter_(1, pos, part)
    return out[:, :seq_len]


@dataclass
class CPShard:
    """One CP rank's share of a batch of [b, s] tensors.

    tensors: name -> [b, padded_len / cp_size] (None stays None);
    valid: [b, padded_len / cp_size] bool, False on the padding added here (and past
    `lengths` when they were given); positions: global position of each local token.
    """

    tensors: dict
    valid: torch.Tensor
    positions: torch.Tensor
    seq_len: int
    padded_len: int
    cp_size: int
    cp_rank: int

    def __getitem__(self, name: str):
        return self.tensors[name]


def shard_batch(batch: Mapping[str, Optional[torch.Tensor]], cp_size: int, cp_rank: int, *,
                lengths: Optional[torch.Tensor] = None,
                pad_values: Optional[Mapping[str, float]] = None, sp_size: int = 1) -> CPShard:
    """Split every [b, s] tensor of `batch` (ids, labels, loss masks, advantages, log-probs...)
    into this CP rank's load-balanced chunks.

    All tensors must share b and s. `position_ids` (if present) is padded with the global
    positions of the pad slots; other tensors with `pad_values[name]` (default 0).
    `lengths` [b] (optional): true length of each row, so that `valid` also masks each
    row's own right padding. A [b] tensor (per-sequence, e.g. advantages) is passed as is.
    sp_size: the TP size under sequence parallelism, else 1 (see `padded_length`).
    """
    _check_cp(cp_size, cp_rank)
    pad_values = dict(pad_values or {})
    per_token = {k: v for k, v in batch.items() if v is not None and v.dim() >= 2}
    if not per_token:
        raise ValueError("shard_batch needs at least one [b, s] tensor")
    b, s = next(iter(per_token.values())).shape[:2]
    for name, t in per_token.items():
        if tuple(t.shape[:2]) != (b, s):
            raise ValueError(f"shard_batch: {name!r} has shape {tuple(t.shape)}, expected "
                             f"[{b}, {s}, ...] like the other per-token tensors")
    padded = padded_length(s, cp_size, sp_size)
    positions = local_positions(padded, cp_size, cp_rank)
    out = {}
    for name, t in batch.items():
        if t is None or t.dim() < 2:
            out[name] = t                          # per-sequence values are not split
        elif name == "position_ids":
            # Pad slots get their own global positions, so the ids stay a plain ramp.
            full = pad_sequence(t, padded, 1, 0)
            if padded > s:
                full = full.clone()
                full[:, s:] = torch.arange(s, padded, device=t.device, dtype=t.dtype)
            out[name] = full.index_select(1, positions.to(t.device))
        else:
            out[name] = split_for_cp(t, cp_size, cp_rank, 1, pad_values.get(name, 0), sp_size)
    device = next(iter(per_token.values())).device
    pos = positions.to(device)
    if lengths is not None and (tuple(lengths.shape) != (b,) or int(lengths.max()) > s):
        raise ValueError(f"lengths must be a [b]={b} tensor with values <= s={s}, "
                         f"got shape {tuple(lengths.shape)}")
    limit = torch.full((b,), s, device=device) if lengths is None else lengths.to(device)
    valid = pos.unsqueeze(0) < limit.unsqueeze(1)          # [b, S/cp]
    return CPShard(out, valid, positions, s, padded, cp_size, cp_rank)
