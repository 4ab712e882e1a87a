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
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


def has_cuda() -> bool:
    return torch.cuda.is_available()


def device() -> torch.device:
    """The device this rank computes on."""
    if has_cuda():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def backend() -> str:
    return "nccl" if has_cuda() else "gloo"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass
class ParallelDims:
    """Owns the parallel degrees; checks them against the world size.

    tp: tensor parallel; pp: pipeline stages; vpp: virtual stages per pipeline
    rank (None = no interleaving); cp: context parallel; ep: expert parallel;
    etp: expert tensor parallel (None = tp); dp is derived: world_size / (tp * pp * cp).

    Experts have their own mesh (Megatron-Core's): each pipeline stage's tp*cp*dp ranks
    are regrouped as etp x ep x edp, so etp * ep * pp must divide the world size; the
    expert data-parallel size edp = world_size / (etp * ep * pp).
    """

    world_size: int
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    cp: int = 1
    ep: int = 1
    etp: int | None = None
    dp: int = field(init=False)

    def __post_init__(self):
        for name, flag, value in (("tp", "--tensor_model_parallel_size", self.tp),
                                  ("pp", "--pipeline_model_parallel_size", self.pp),
                                  ("cp", "--context_parallel_size", self.cp),
                                  ("ep", "--expert_model_parallel_size", self.ep)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{flag} must be a positive integer, got {value!r}")
        if self.vpp is not None:
            if not isinstance(self.vpp, int) or self.vpp < 1:
                raise ValueError("--virtual_pipeline_model_parallel_size must be a positive "
                                 f"integer or unset, got {self.vpp!r}")
            if self.vpp > 1 and self.pp == 1:
                raise ValueError(f"--virtual_pipeline_model_parallel_size {self.vpp} needs "
                                 "--pipeline_model_parallel_size > 1 (interleaving splits each "
                                 "pipeline rank's layers into virtual stages)")
            if self.vpp == 1:
                self.vpp = None
        model_parallel = self.tp * self.pp * self.cp
        if self.world_size % model_parallel != 0:
            valid_tp = [t for t in _divisors(self.world_size)
                        if self.world_size % (t * self.pp * self.cp) == 0]
            raise ValueError(
                f"--tensor_model_parallel_size {self.tp} x --pipeline_model_parallel_size "
                f"{self.pp} x --context_parallel_size {self.cp} = {model_parallel} does not "
                f"divide the world size {self.world_size} (number of processes). With these "
                f"pp and cp, valid --tensor_model_parallel_size values are {valid_tp or 'none'}; "
                f"launch {model_parallel}*k processes (NPROC_PER_NODE) or lower the degrees.")
        self.dp = self.world_size // model_parallel
        if self.etp is not None and (not isinstance(self.etp, int) or self.etp < 1):
            raise ValueError("--expert_tensor_parallel_size must be a positive integer or "
                             f"unset, got {self.etp!r}")
        expert_mp = (self.etp or self.tp) * self.ep * self.pp
        if self.world_size % expert_mp != 0:
            raise ValueError(
                f"--expert_tensor_parallel_size {self.etp or self.tp} x "
                f"--expert_model_parallel_size {self.ep} x --pipeline_model_parallel_size "
                f"{self.pp} = {expert_mp} does not divide the world size {self.world_size}; "
                "lower --expert_model_parallel_size or launch more processes")

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1


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
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
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
        parallel_state.destroy_model_parallel()
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
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
