"""The parallel layout of a run: the one place the degrees are checked against the world size.

    dims = ParallelDims.from_options(cfg.parallel, world_size)   # validates, derives dp

Built once per process from the options (the launcher before torchrun starts, to fail
early; each rank again from the same options) by `config.validate_world` (the trainer),
`convert.check_args` (`megatron export`) and `platform.init_parallel`'s callers. Kept free
of heavy imports: options are checked before anything starts.
"""
from __future__ import annotations

from dataclasses import dataclass, field


def divisors(n: int) -> list[int]:
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

    @classmethod
    def from_options(cls, options, world_size: int) -> "ParallelDims":
        """From anything holding the option names (`cfg.parallel`, `megatron export`'s)."""
        return cls(world_size=world_size, tp=options.tensor_model_parallel_size,
                   pp=options.pipeline_model_parallel_size,
                   vpp=options.virtual_pipeline_model_parallel_size,
                   cp=options.context_parallel_size, ep=options.expert_model_parallel_size,
                   etp=options.expert_tensor_parallel_size)

    def __post_init__(self):
        for flag, value in (("--tensor_model_parallel_size", self.tp),
                            ("--pipeline_model_parallel_size", self.pp),
                            ("--context_parallel_size", self.cp),
                            ("--expert_model_parallel_size", self.ep)):
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
        w, mp = self.world_size, self.tp * self.pp * self.cp
        if w < 1 or w % mp:
            valid_tp = [t for t in divisors(max(w, 1)) if w % (t * self.pp * self.cp) == 0]
            raise ValueError(
                f"world size {w} (number of processes) is not divisible by "
                f"--tensor_model_parallel_size {self.tp} x --pipeline_model_parallel_size "
                f"{self.pp} x --context_parallel_size {self.cp} = {mp}. Valid world sizes: "
                f"multiples of {mp} ({[mp * k for k in range(1, 5)]}...); valid "
                f"--tensor_model_parallel_size values for {w} processes with these pipeline and "
                f"context sizes: {valid_tp or 'none'}. Fix: change NPROC_PER_NODE/NNODES or "
                "the parallel sizes")
        self.dp = w // mp
        if self.etp is not None and (not isinstance(self.etp, int) or self.etp < 1):
            raise ValueError("--expert_tensor_parallel_size must be a positive integer or "
                             f"unset, got {self.etp!r}")
        expert_mp = (self.etp or self.tp) * self.ep * self.pp
        if w % expert_mp:
            raise ValueError(
                f"world size {w} is not divisible by --expert_tensor_parallel_size "
                f"{self.etp or self.tp} x --expert_model_parallel_size {self.ep} x "
                f"--pipeline_model_parallel_size {self.pp} = {expert_mp}. Fix: lower "
                "--expert_model_parallel_size or change NPROC_PER_NODE/NNODES")

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

