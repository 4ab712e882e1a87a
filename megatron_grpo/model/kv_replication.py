"""Replicated kv heads (fewer kv heads than TP ranks): identical in training, HF-shaped on disk.

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

The gradient norm (clipping, the logged grad_norm) must count each HF kv head once, but
`linear_qkv` is TP-sharded to Megatron, so every replica's rows enter its sum of squares:

    ||g||^2 = sum over ranks of (q rows + k/v rows)    # Megatron: kv counted `replicas` times
    ||g||^2 = sum over ranks of q rows + sum over kv heads of its k/v rows    # TP=1's norm

`count_kv_once_in_grad_norm` (called by train/setup.py's build_policy after the optimizer
is built) leaves the k/v rows out of the norm on every replica but the first.

On disk the replicas do not exist. `install_grouped_qkv_checkpointing` (called by
`build_model`) gives each `linear_qkv` a sharded state dict in the layout a model without
replication has: per HF kv head h a group of rows `[q heads of h, k_h, v_h]`, global shape
`[kv_heads * (heads / kv_heads + 2) * head_dim, ...]`, the same at every TP. A rank saves its
q heads as its own head-sized blocks of that tensor and its k/v heads as blocks marked as
replicas (TP replica id `tp_rank % replicas`), so a checkpoint written at TP=4 with 2 kv heads
loads at TP=1, 2 or 8, and one written at TP=1 loads at TP=4 with the replicas filled in.
The distributed optimizer's states follow the parameter's factory, so Adam moments reshard
the same way (the replicas' moments are equal: their gradients are, see above).
"""
from __future__ import annotations

import functools
import os

import torch
import torch.distributed as dist

from bridge.params import unwrap

from ..platform.compat.megatron import restrict_grad_norm

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


def count_kv_once_in_grad_norm(optimizer, chunks, config, args) -> None:
    """Make `optimizer`'s gradient norm count each replicated kv head once (module
    docstring): on TP ranks with `tp_rank % replicas != 0` only the q rows of every
    `linear_qkv` weight and bias count. Call once, after the optimizer is built."""
    replicas = kv_replicas(config, args)
    tp = config.tensor_model_parallel_size
    if replicas == 1 or tp == 1:
        return
    from megatron.core import parallel_state as ps

    if ps.get_tensor_model_parallel_rank() % replicas == 0:
        return   # the first replica counts its kv rows
    q_rows = config.num_attention_heads // config.num_query_groups * config.kv_channels
    group_rows = q_rows + 2 * config.kv_channels
    counted = {}
    for chunk in chunks:
        for name, param in unwrap(chunk).named_parameters():
            if name.endswith(_QKV_SUFFIXES):
                width = param.numel() // param.shape[0]       # elements per row
                counted[param] = [(g * group_rows * width, (g * group_rows + q_rows) * width)
                                  for g in range(param.shape[0] // group_rows)]
    restrict_grad_norm(optimizer, counted)


# ---------------------------------------------------------------- checkpoint layout
# Set in a sharded_state_dict's `metadata` to load a checkpoint written by an older version,
# which saved the replicated (TP-dependent) layout, at the TP it was written at.
LEGACY_QKV_METADATA_KEY = "megatron_grpo_replicated_qkv"


def _qkv_blocks(heads: int, kv_heads: int, tp: int, tp_rank: int) -> list[tuple[int, bool]]:
    """(global head-block index, is a kv replica) of each head-sized row block of the local
    replicated `linear_qkv` [q heads of this rank, k, v], in the HF-grouped layout.

    Group h holds blocks h*(n+2) .. h*(n+2)+n+1 with n = heads / kv_heads q heads, then k, v.
    Rank r holds kv head h = r // replicas and the j = r % replicas-th slice of its q heads.
    """
    replicas = tp // kv_heads
    n, q_local = heads // kv_heads, heads // tp
    h, j = divmod(tp_rank, replicas)
    base = h * (n + 2)
    return ([(base + j * q_local + i, False) for i in range(q_local)]
            + [(base + n, True), (base + n + 1, True)])


def grouped_qkv_factory(sh_ten, sharded_offsets, *, heads: int, kv_heads: int, tp: int,
                        tp_rank: int, head_dim: int):
    """A ShardedTensorFactory saving one rank's replicated `linear_qkv` weight or bias in the
    HF-grouped layout (module docstring); merge_fn reassembles the local tensor on load."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    blocks = _qkv_blocks(heads, kv_heads, tp, tp_rank)
    total = kv_heads * (heads // kv_heads + 2)
    axis = len(sharded_offsets)       # prepended axes (the layer axis) come first
    replica_j = tp_rank % (tp // kv_heads)

    def kv_replica(replica_id):
        # Megatron's replica ids are (PP, TP, DP); the TP coordinate of a TP-sharded tensor
        # is 0. A kv block is a copy unless j == 0.
        if isinstance(replica_id, tuple):
            return (replica_id[0], replica_id[1] + replica_j, *replica_id[2:])
        return (replica_id, replica_j)

    @torch.no_grad()
    def build(key, t, replica_id, flattened_range):
        if flattened_range is not None:
            raise NotImplementedError(
                f"{key}: replicated kv heads cannot be saved from a flattened optimizer shard; "
                "use distrib_optim_sharding_type fully_reshardable or dp_reshardable")
        rows = t.split(head_dim, dim=0)
        assert len(rows) == len(blocks), (key, tuple(t.shape), head_dim, blocks)
        return [ShardedTensor.from_rank_offsets(
                    key, row, *sharded_offsets, (axis, index, total),
                    replica_id=kv_replica(replica_id) if is_kv else replica_id,
                    prepend_axis_num=axis)
                for row, (index, is_kv) in zip(rows, blocks)]

    def merge(loaded):
        return torch.cat(loaded, dim=0)

    return ShardedTensorFactory(sh_ten.key, sh_ten.data, build, merge, sh_ten.replica_id)


def _grouped_sharded_state_dict(original, *, heads, kv_heads, tp, head_dim, prefix="",
                                sharded_offsets=(), metadata=None):
    """linear_qkv.sharded_state_dict with weight and bias in the HF-grouped layout."""
    sd = original(prefix=prefix, sharded_offsets=sharded_offsets, metadata=metadata)
    if (metadata or {}).get(LEGACY_QKV_METADATA_KEY):
        return sd
    from megatron.core import parallel_state as ps

    tp_rank = ps.get_tensor_model_parallel_rank()
    for name in ("weight", "bias"):
        key = f"{prefix}{name}"
        if key in sd:
            sd[key] = grouped_qkv_factory(sd[key], sharded_offsets, heads=heads,
                                          kv_heads=kv_heads, tp=tp, tp_rank=tp_rank,
                                          head_dim=head_dim)
    return sd


def install_grouped_qkv_checkpointing(chunks, config, args) -> None:
    """Make every `linear_qkv` of `chunks` save and load in the HF-grouped layout (module
    docstring). Nothing to do without replication: that layout is then Megatron's own."""
    replicas = kv_replicas(config, args)
    if replicas == 1:
        return
    kv_heads = config.num_query_groups // replicas
    for chunk in chunks:
        for layer in unwrap(chunk).decoder.layers:
            qkv = layer.self_attention.linear_qkv
            qkv.sharded_state_dict = functools.partial(
                _grouped_sharded_state_dict, qkv.sharded_state_dict,
                heads=config.num_attention_heads, kv_heads=kv_heads,
                tp=config.tensor_model_parallel_size, head_dim=config.kv_channels)
            qkv.hf_kv_heads = kv_heads  # read by checkpoint_load_metadata


def saved_query_groups(dist_dir: str, heads: int, head_dim: int) -> int | None:
    """Query groups of the `linear_qkv` a distributed checkpoint holds, from its metadata.

    Rows = (heads + 2 * groups) * head_dim, whatever the layer axis in front. None when
    the folder holds no readable torch_dist metadata or no linear_qkv (another model).
    """
    from torch.distributed.checkpoint import FileSystemReader

    if not os.path.isfile(os.path.join(dist_dir, ".metadata")):
        return None
    try:
        meta = FileSystemReader(dist_dir).read_metadata()
    except Exception:  # noqa: BLE001 - not ours to diagnose: the real load will say what
        return None
    for key, item in meta.state_dict_metadata.items():
        if key.endswith("self_attention.linear_qkv.weight") and not key.startswith("optimizer"):
            rows = item.size[-2] // head_dim - heads
            return rows // 2 if rows > 0 and rows % 2 == 0 else None
    return None


def legacy_replicated_layout(saved_groups: int | None, *, heads: int, kv_heads: int, tp: int,
                             where: str) -> bool:
    """Whether a checkpoint with `saved_groups` query groups on disk holds the replicated,
    TP-dependent layout of older versions (then it loads at the TP that wrote it only).

    Raises a ValueError naming that TP when `tp` is another one.
    """
    if saved_groups is None or saved_groups == kv_heads:
        return False
    # The old layout had tp query groups, each holding a kv replica.
    if not (saved_groups > kv_heads and saved_groups % kv_heads == 0
            and heads % saved_groups == 0):
        return False       # another model: the load reports the shape mismatch
    if saved_groups != max(kv_heads, tp):
        raise ValueError(
            f"--tensor_model_parallel_size {tp}: {where} was saved by an older version at "
            f"tensor parallel size {saved_groups} with the model's {kv_heads} kv heads "
            f"replicated to {saved_groups} query groups, a layout that only loads at that "
            f"size; use --tensor_model_parallel_size {saved_groups} (a checkpoint saved by "
            "this version loads at any size)")
    return True


def checkpoint_load_metadata(dist_dir: str, chunks, where: str) -> dict:
    """The sharded_state_dict metadata that loads `dist_dir` into `chunks`: marks the legacy
    replicated layout (loadable at its own TP only; ValueError at another)."""
    model = unwrap(chunks[0])
    config = model.config
    qkv = model.decoder.layers[0].self_attention.linear_qkv
    kv_heads = getattr(qkv, "hf_kv_heads", config.num_query_groups)
    saved = saved_query_groups(dist_dir, config.num_attention_heads, config.kv_channels)
    legacy = legacy_replicated_layout(saved, heads=config.num_attention_heads, kv_heads=kv_heads,
                                      tp=config.tensor_model_parallel_size, where=where)
    return {LEGACY_QKV_METADATA_KEY: True} if legacy else {}
