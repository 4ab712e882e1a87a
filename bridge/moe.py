"""Expert parallelism in the bridge: which rank holds which expert, and the groups that
gather and move expert tensors.

Megatron numbers the routed experts of an EP rank locally (`local_experts.0` is the first
expert of every EP rank); the mapping rules use global numbers:

    global expert = ep_rank * (num_experts / ep) + local expert

Each expert lives on exactly one EP rank (per expert-data-parallel replica), split across
its expert tensor parallel (ETP) group. So load reads only the experts of the rank's EP
rank, its ETP slice of each; export assembles an expert on its EP owner (ETP gather) and
broadcasts that one tensor over the EP group: a bucket never holds more than the bucket's
tensors, and no rank gathers every expert of a layer.
"""
from __future__ import annotations

import re
from dataclasses import replace

import torch.distributed as dist

from .groups import Groups

_LOCAL_EXPERT = re.compile(r"(\.mlp\.experts\.local_experts\.)(\d+)(\.)")
_GROUPED_EXPERT = re.compile(r"(\.mlp\.experts\.linear_fc[12]\.weight)(\d+)\Z")


def ep_layout(config) -> tuple[int, int, int]:
    """(ep rank, ep size, experts per EP rank) of this rank."""
    from megatron.core import parallel_state as ps

    ep = ps.get_expert_model_parallel_world_size()
    return ps.get_expert_model_parallel_rank(), ep, config.num_moe_experts // ep


def global_expert_name(name: str, config) -> str:
    """`name` with its local expert number replaced by the global one (others unchanged)."""
    if not getattr(config, "num_moe_experts", None) or ".mlp.experts." not in name:
        return name
    rank, _, local = ep_layout(config)
    for pat in (_LOCAL_EXPERT, _GROUPED_EXPERT):
        m = pat.search(name)
        if m:
            glob = rank * local + int(m.group(2))
            return name[:m.start(2)] + str(glob) + name[m.end(2):]
    return name


def expert_owner(expert: int, config) -> int:
    """EP rank that holds global `expert`."""
    _, ep, local = ep_layout(config)
    return expert // local


def expert_groups(groups: Groups) -> Groups:
    """`groups` with its TP fields replaced by the expert tensor parallel group (what the
    TP gather of a routed expert's shards runs over)."""
    from megatron.core import parallel_state as ps

    group = ps.get_expert_tensor_parallel_group()
    return replace(groups, tp_group=group, tp_ranks=dist.get_process_group_ranks(group),
                   tp_rank=ps.get_expert_tensor_parallel_rank())


def ep_group():
    """(group, global ranks) of this rank's expert model parallel group."""
    from megatron.core import parallel_state as ps

    group = ps.get_expert_model_parallel_group()
    return group, dist.get_process_group_ranks(group)
