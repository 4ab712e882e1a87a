"""The process groups the bridge runs its collectives over: Megatron's TP and PP groups
of this rank, with the global ranks of their members.

A module of its own because both `bridge.params` (which imports `bridge.moe` for the
global expert names) and `bridge.moe` (whose expert groups are a `Groups` with the
expert tensor parallel group in its TP fields) need the type: keeping it in either would
tie the two modules into an import cycle.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class Groups:
    """Megatron's TP and PP groups of this rank, with the global ranks of their members."""

    tp_group: object
    tp_ranks: list[int]       # global rank of TP rank i
    tp_rank: int
    pp_group: object
    pp_ranks: list[int]       # global rank of pipeline stage i (same TP/DP/CP position)
    pp_rank: int

    @property
    def tp(self) -> int:
        return len(self.tp_ranks)

    @property
    def pp(self) -> int:
        return len(self.pp_ranks)


def megatron_groups() -> Groups:
    """This rank's groups as Megatron's parallel state set them up."""
    from megatron.core import parallel_state as ps

    tp_group = ps.get_tensor_model_parallel_group()
    pp_group = ps.get_pipeline_model_parallel_group()
    return Groups(tp_group=tp_group, tp_ranks=dist.get_process_group_ranks(tp_group),
                  tp_rank=ps.get_tensor_model_parallel_rank(), pp_group=pp_group,
                  pp_ranks=dist.get_process_group_ranks(pp_group),
                  pp_rank=ps.get_pipeline_model_parallel_rank())
