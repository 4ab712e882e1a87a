"""Device/backend choice, torch.distributed and Megatron parallel-state set-up.

    dims = ParallelDims(tp=2, pp=1, cp=1, world_size=world)   # validates, derives dp
    init_parallel(dims, seed=1234)                              # after torchrun started us

On a machine without CUDA the backend is gloo, tensors live on the CPU and the
CPU layer (`platform.cpu`) is installed before Megatron runs. With CUDA it is NCCL
and nothing is patched.
"""
from __future__ import annotations

import datetime
import os
import torch
import torch.distributed as dist

from ..config.parallel import ParallelDims
from .compat import megatron as megatron_compat


def has_cuda() -> bool:
    return torch.cuda.is_available()


def device() -> torch.device:
    """The device this rank computes on."""
    if has_cuda():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def backend() -> str:
    return "nccl" if has_cuda() else "gloo"


def init_process_group(timeout_s: float = 600.0) -> None:
    """Initialise torch.distributed from torchrun's environment (idempotent).

    Without RANK/WORLD_SIZE in the environment it starts a world of one.
    """
    if dist.is_initialized():
        return
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    if has_cuda():
        local, count = int(os.environ["LOCAL_RANK"]), torch.cuda.device_count()
        if local >= count:     # two ranks on one GPU: NCCL's "duplicate GPU", or out of memory
            raise ValueError(
                f"worker LOCAL_RANK {local} has no GPU of its own: this node sees {count} "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}) for "
                f"{os.environ.get('LOCAL_WORLD_SIZE', local + 1)} workers. Fix: "
                f"NPROC_PER_NODE={count}, or make more GPUs visible")
        torch.cuda.set_device(local)
    dist.init_process_group(backend(), timeout=datetime.timedelta(seconds=timeout_s))


def init_parallel(dims: ParallelDims, seed: int = 1234) -> ParallelDims:
    """Start torch.distributed (if needed), install the CPU layer, set Megatron's groups and RNG."""
    init_process_group()
    if dist.get_world_size() != dims.world_size:
        raise ValueError(f"ParallelDims was built for world size {dims.world_size} but "
                         f"{dist.get_world_size()} processes are running")
    if not has_cuda():
        from . import cpu

        cpu.install()
    from megatron.core import parallel_state, tensor_parallel

    if parallel_state.model_parallel_is_initialized():
        megatron_compat.destroy_model_parallel()    # and its process groups (compat/megatron.py)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=dims.tp,
        pipeline_model_parallel_size=dims.pp,
        virtual_pipeline_model_parallel_size=dims.vpp,
        context_parallel_size=dims.cp,
        expert_model_parallel_size=dims.ep,
        expert_tensor_parallel_size=dims.etp,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return dims


def destroy_parallel() -> None:
    megatron_compat.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
