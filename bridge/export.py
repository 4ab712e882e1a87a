"""Sharded Megatron parameters -> a stream of buckets of full HF tensors, on every rank.

    for bucket in export_hf_weights(chunks, config, args, bucket_size_bytes=256 << 20):
        engine.load_weights(bucket)       # [(hf_name, tensor), ...]; done with it before the next

The contract (docs/architecture.md, "Bridge stream"):
- every rank of the world receives the whole stream: the pipeline stage that holds a
  tensor gathers its TP shards (that one tensor, never a whole layer or model) and
  broadcasts it over its pipeline group;
- HF names and layouts (q/k/v and gate/up split, kv replicas de-duplicated), vocab
  padding trimmed, tied embeddings once as `model.embed_tokens.weight`, each key of the
  HF checkpoint exactly once (checked against `manifest(config, args)`), in `dtype`;
- a bucket's tensors are views into ONE reused buffer of max(bucket_size_bytes, largest
  tensor) bytes: on the parameters' device, or with offload_bridge=True in CPU memory
  (pinned when CUDA is present). The consumer must be done with a bucket (copy what it
  keeps) before it asks for the next one;
- memory: that buffer plus a reused transfer buffer of min(bucket_size_bytes, L)
  (L: the largest HF tensor), i.e. bucket_size_bytes + L in all, allocated once per
  export; nothing is allocated per tensor, and the communication library only ever
  holds references to these two buffers and to the parameters. (The transfer buffer is
  at least 4 KiB. With offload_bridge on CUDA, each tensor is also assembled in a device
  temporary of its size before its copy to the host.)

How a bucket is made: every stage assembles the tensors it owns into their slots of the
buffer (TP all-gathers straight into the slot when each rank holds one equal block,
broadcasts of blocks otherwise, row-parallel blocks through the transfer buffer), the
stages working at the same time; then each run of slots with one owner is broadcast over
the pipeline group in a single collective.

LOCKSTEP: the generator runs collectives (TP gathers, PP broadcasts). Every rank of the
world must create it with the same arguments and iterate it to the end in the same
order; a rank that stops early, or skips it, hangs the others.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from .mappings import ModelDims, Unit, export_pieces, get_mapping
from .groups import Groups, megatron_groups
from .params import global_params
from .transfer import TransferBuffer, _all_gather_single

Bucket = list[tuple[str, torch.Tensor]]
_ALIGN = 64  # byte alignment of tensors inside the staging buffer


def _aligned(nbytes: int) -> int:
    return (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN


def _nbytes(shape, dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * dtype.itemsize


class BucketBuffer:
    """The reused buffer a bucket's tensors live in: on `device`, or pinned host memory.

    Pass one as `staging=` to `export_hf_weights` to keep it across exports (a GRPO run
    exports after every step; re-allocating pinned memory each time is slow).
    """

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self._buffer: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return 0 if self._buffer is None else self._buffer.numel()

    def reserve(self, nbytes: int) -> None:
        if self._buffer is None or self._buffer.numel() < nbytes:
            self._buffer = None  # free the old one first
            pin = self.device.type == "cpu" and torch.cuda.is_available()
            self._buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device,
                                       pin_memory=pin)

    def region(self, start: int, stop: int) -> torch.Tensor:
        return self._buffer[start:stop]

    def view(self, offset: int, shape, dtype: torch.dtype) -> torch.Tensor:
        return self._buffer[offset:offset + _nbytes(shape, dtype)].view(dtype).view(shape)


@dataclass(frozen=True)
class _Item:
    """One HF tensor of the stream."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    unit: Unit
    index: int                 # which of the unit's HF tensors
    owner: int                 # pipeline stage that holds the parameter
    param: torch.Tensor | None  # this rank's shard, when this rank's stage is the owner
    ep_owner: int | None = None  # routed experts: the EP rank that holds it (bridge/moe.py)


def _layer_stages(config) -> dict[int, int]:
    """Global layer index -> pipeline stage, from Megatron's own split (any PP/VPP layout)."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    pp, vpp = config.pipeline_model_parallel_size, config.virtual_pipeline_model_parallel_size
    stages = {}
    for pp_rank in range(pp):
        for vp_stage in (range(vpp) if vpp else [None]):
            offset = get_transformer_layer_offset(config, vp_stage, pp_rank) if pp > 1 else 0
            count = get_num_layers_to_build(config, vp_stage, pp_rank)
            stages.update({layer: pp_rank for layer in range(offset, offset + count)})
    return stages


def _plan(chunks, config, args, groups: Groups, dtype, source, ep_rank: int = 0,
          include: Callable[[str], bool] | None = None) -> list[_Item]:
    """Every HF tensor in stream order, with the pipeline stage that owns it.

    Ownership is computed, not exchanged: layers where Megatron's split puts them, the
    embedding on the first stage, final norm and output layer on the last. Each rank checks
    that what it holds is exactly what the plan gives its stage, so no collective is needed
    and a mismatch fails on the rank that sees it."""
    mapping = get_mapping(args.family)
    dims = ModelDims.from_config(config, args)
    local: dict[tuple, torch.Tensor] = {}
    for name, param in global_params(chunks):
        unit = mapping.resolve(name, config, args, dims)
        if unit.exported:
            local[unit.order] = source(param)
    dtypes = {t.dtype for t in local.values()}
    if dtype is None and len(dtypes) > 1:
        raise ValueError(f"the exported tensors have several dtypes {sorted(map(str, dtypes))}; "
                         "pass dtype= to export_hf_weights")
    if dtype is None:  # every stage holds the same kind of tensors (one config)
        dtype = dtypes.pop() if dtypes else config.params_dtype
    layer_stage = _layer_stages(config)
    items: list[_Item] = []
    for unit in mapping.units(config, args, dims):
        if not unit.exported:
            continue
        if unit.layer is not None:
            owner = layer_stage[unit.layer]
        else:  # rules before the layers' (embedding): first stage; after them: last stage
            owner = 0 if unit.order < (mapping.first_layer_rule,) else groups.pp - 1
        if (owner == groups.pp_rank) != (unit.order in local) and unit.expert is None:
            raise RuntimeError(f"{unit.rule.megatron[0]} (layer {unit.layer}) should be held by "
                               f"pipeline stage {owner}, but stage {groups.pp_rank} "
                               f"{'holds' if unit.order in local else 'lacks'} it")
        ep_owner = None
        if unit.expert is not None:
            from .moe import expert_owner

            ep_owner = expert_owner(unit.expert, config)
        mine = owner == groups.pp_rank and ep_owner in (None, ep_rank)
        if mine != (unit.order in local):
            raise RuntimeError(f"{unit.rule.megatron[0]} (layer {unit.layer}, expert "
                               f"{unit.expert}) should be held by EP rank {ep_owner}, but EP rank "
                               f"{ep_rank} {'holds' if unit.order in local else 'lacks'} it")
        param = local.get(unit.order) if mine else None
        for j, (name, shape) in enumerate(zip(unit.hf_names, unit.hf_shapes)):
            if include is None or include(name):
                items.append(_Item(name, tuple(shape), dtype, unit, j, owner, param, ep_owner))
    expected = [n for n in mapping.manifest(config, args, dims) if include is None or include(n)]
    names = [it.name for it in items]
    if sorted(names) != sorted(expected) or len(set(names)) != len(names):
        raise RuntimeError(f"export plan does not match the HF manifest: missing "
                           f"{sorted(set(expected) - set(names))}, extra "
                           f"{sorted(set(names) - set(expected))}, duplicated "
                           f"{sorted({n for n in names if names.count(n) > 1})}")
    return items


_export_pieces = functools.lru_cache(maxsize=4096)(export_pieces)


def _as_2d(t: torch.Tensor) -> torch.Tensor:
    """[R, W] view: 1-D tensors as one column; blocks along axis 1 stay [R, w]."""
    return t.view(-1, 1) if t.dim() == 1 else t


def _assemble_tp(out: torch.Tensor, item: _Item, dims: ModelDims, groups: Groups,
                 xfer: TransferBuffer) -> None:
    """Fill `out` (the full HF tensor) from the TP shards of `item`, on the owner stage.

    Every rank holding k equal blocks (column/row-parallel weights, gate/up, q): k
    all-gathers, straight into `out` when the gathered blocks are contiguous there and no
    cast is needed, else through the transfer buffer. Otherwise (kv replicas taken once,
    vocab padding skipped) one broadcast per block straight into `out`.
    """
    pieces = _export_pieces(item.unit.layout, item.index, dims, item.unit.hf_shapes)
    shard = item.param

    def blocks(piece):
        if piece.axis is None:
            return out, shard
        return (_as_2d(out.narrow(piece.axis, piece.hf_start, piece.hf_stop - piece.hf_start)),
                _as_2d(shard.narrow(piece.axis, piece.shard_start,
                                    piece.shard_stop - piece.shard_start)))

    if groups.tp == 1 or not item.unit.layout.tp_split:
        for _, piece in pieces:  # everything is local
            dst, src = blocks(piece)
            dst.copy_(src)
        return
    by_rank = [[p for r, p in pieces if r == rank] for rank in range(groups.tp)]
    sizes = {p.hf_stop - p.hf_start for _, p in pieces}
    if len({len(b) for b in by_rank}) == 1 and len(sizes) == 1:
        for slot in range(len(by_rank[0])):
            slot_pieces = [b[slot] for b in by_rank]
            dsts = [blocks(p)[0] for p in slot_pieces]
            src = blocks(by_rank[groups.tp_rank][slot])[1]
            first, n = slot_pieces[0], sizes.copy().pop()
            direct = (first.axis == 0 and src.dtype == out.dtype and src.is_contiguous()
                      and all(p.hf_start == first.hf_start + r * n for r, p in enumerate(slot_pieces)))
            if direct:  # the ranks' blocks follow each other in `out`: gather in place
                region = out.narrow(0, first.hf_start, n * groups.tp)
                _all_gather_single(region.view(-1), src.reshape(-1), group=groups.tp_group)
            else:
                xfer.all_gather(dsts, src, groups.tp_group)
        return
    for rank, piece in pieces:
        dst, src = blocks(piece)
        if rank == groups.tp_rank:
            dst.copy_(src)
        dist.broadcast(dst, src=groups.tp_ranks[rank], group=groups.tp_group)


def _buckets(items: list[_Item], bucket_size_bytes: int) -> list[list[tuple[_Item, int]]]:
    """Items grouped into buckets, each item with its byte offset in the bucket buffer.
    A bucket is closed before it would exceed the bucket size; a bigger tensor goes alone.
    The same on every rank (it depends only on the plan)."""
    out, current, used = [], [], 0
    for item in items:
        size = _aligned(_nbytes(item.shape, item.dtype))
        if current and used + size > bucket_size_bytes:
            out.append(current)
            current, used = [], 0
        current.append((item, used))
        used += size
    if current:
        out.append(current)
    return out


def _broadcast_runs(bucket: list[tuple[_Item, int]], buf: BucketBuffer, groups: Groups) -> None:
    """Each run of consecutive slots with one owner stage: one broadcast over the pipeline."""
    start = 0
    while start < len(bucket):
        stop = start
        while stop + 1 < len(bucket) and bucket[stop + 1][0].owner == bucket[start][0].owner:
            stop += 1
        last, offset = bucket[stop]
        region = buf.region(bucket[start][1], offset + _nbytes(last.shape, last.dtype))
        dist.broadcast(region, src=groups.pp_ranks[last.owner], group=groups.pp_group)
        start = stop + 1


def _broadcast_expert_runs(bucket: list[tuple[_Item, int]], buf: BucketBuffer, pp_rank: int,
                           ep) -> None:
    """Each run of consecutive routed-expert slots of this stage with one EP owner: one
    broadcast over the EP group (the owner assembled them; the others receive)."""
    group, ranks = ep

    def key(i):  # the EP owner of slot i, if it is a routed expert of this stage
        item = bucket[i][0]
        return item.ep_owner if item.owner == pp_rank else None

    start = 0
    while start < len(bucket):
        stop = start
        while stop + 1 < len(bucket) and key(stop + 1) == key(start):
            stop += 1
        if key(start) is not None:
            last, offset = bucket[stop]
            region = buf.region(bucket[start][1], offset + _nbytes(last.shape, last.dtype))
            dist.broadcast(region, src=ranks[key(start)], group=group)
        start = stop + 1


def export_hf_weights(chunks, config, args, *, bucket_size_bytes: int = 512 << 20,
                      dtype: torch.dtype | None = None, offload_bridge: bool = False,
                      staging: BucketBuffer | None = None,
                      source: Callable[[torch.nn.Parameter], torch.Tensor] | None = None,
                      include: Callable[[str], bool] | None = None) -> Iterator[Bucket]:
    """Yield buckets of (hf_name, full tensor) covering the whole model (see module doc).

    chunks: this rank's GPTModel chunks (DDP-wrapped or not); config, args: from
    `build_transformer_config`. bucket_size_bytes: close a bucket before it would exceed
    this (a tensor larger than it travels alone). dtype: of the yielded tensors (default:
    the parameters'). offload_bridge: the bucket buffer is in CPU memory. staging: a
    `BucketBuffer` to reuse across exports (on the device the mode asks for). source:
    what to export from each parameter (default its data; `lambda p: p.main_grad`
    streams gradients in HF layout). include: which HF names to stream (default all; e.g.
    `bridge.mappings.vision.sync_filter` leaves frozen vision weights out of a sync). It
    must be the same function on every rank (the plan, hence the collectives, follows it).
    """
    if not isinstance(bucket_size_bytes, int) or bucket_size_bytes < 1:
        raise ValueError(f"bucket_size_bytes must be a positive integer, got {bucket_size_bytes!r}")
    source = source or (lambda p: p.detach())
    groups = megatron_groups()
    dims = ModelDims.from_config(config, args)
    ep, ep_rank, expert_dims, egroups = None, 0, dims, groups
    if dims.experts:  # routed experts: ETP gathers, then EP broadcasts (bridge/moe.py)
        from .moe import ep_group, ep_layout, expert_groups

        ep_rank, ep_size, _ = ep_layout(config)
        ep = ep_group() if ep_size > 1 else None
        expert_dims, egroups = dims.for_experts(), expert_groups(groups)

    def assemble(out, item):
        if item.ep_owner is None:
            _assemble_tp(out, item, dims, groups, xfer)
        elif item.ep_owner == ep_rank:
            _assemble_tp(out, item, expert_dims, egroups, xfer)

    items = _plan(chunks, config, args, groups, dtype, source, ep_rank, include)
    device = next(p.device for c in chunks for p in c.parameters())
    host = offload_bridge and device.type != "cpu"  # assemble on the device, stage on the host
    buf = staging or BucketBuffer("cpu" if offload_bridge else device)
    largest = max(_nbytes(it.shape, it.dtype) for it in items)
    buf.reserve(max(bucket_size_bytes, _aligned(largest)))
    # The transfer buffer takes what the bound leaves: bucket buffer + it = bucket + largest.
    xfer = TransferBuffer(bucket_size_bytes + largest - buf.nbytes, device)

    with torch.no_grad():
        for bucket in _buckets(items, bucket_size_bytes):
            if not host:
                for item, offset in bucket:
                    if item.owner == groups.pp_rank:
                        assemble(buf.view(offset, item.shape, item.dtype), item)
                if ep is not None:
                    _broadcast_expert_runs(bucket, buf, groups.pp_rank, ep)
                if groups.pp > 1:
                    _broadcast_runs(bucket, buf, groups)
            else:
                for item, offset in bucket:
                    tmp = torch.empty(item.shape, dtype=item.dtype, device=device)
                    if item.owner == groups.pp_rank:
                        assemble(tmp, item)
                        if ep is not None and item.ep_owner is not None:
                            dist.broadcast(tmp, src=ep[1][item.ep_owner], group=ep[0])
                    if groups.pp > 1:
                        dist.broadcast(tmp, src=groups.pp_ranks[item.owner], group=groups.pp_group)
                    buf.view(offset, item.shape, item.dtype).copy_(tmp, non_blocking=True)
                    del tmp
                torch.cuda.current_stream().synchronize()  # the host copies have landed
            yield [(item.name, buf.view(offset, item.shape, item.dtype)) for item, offset in bucket]
