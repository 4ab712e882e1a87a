"""GRPO run configuration: nested option groups, flat ms-swift flags, YAML, validation.

    cfg = parse_rlhf_args(["--model", "tiny", "--dataset", "d.jsonl", "--reward_funcs", "format"])
    cfg.parallel.tensor_model_parallel_size, cfg.grpo.loss_type, cfg.reward.reward_funcs
    plan = validate_world(cfg, world_size=2)     # once the number of ranks is known

Constructing a GRPOConfig resolves dependent defaults and checks everything the
options alone decide (model folder, dataset files, choices, batch divisibility,
reward names); `validate_world` adds the checks that need the world size. Both
raise ValueError naming the option, the value, what is valid and the fix.
"""
from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Dict, Optional, Sequence

from .groups import (ALIASES, GROUPS, DataOptions, GRPOOptions, LoggingOptions, ModelOptions,
                     ParallelOptions, RewardOptions, RolloutOptions, TrainingOptions)
from .parse import collect_values, convert, field_table, format_help
from .rollout_server import RolloutServerConfig, parse_rollout_args
from .validate import WorldPlan, finalize, valid_num_generations, validate_world

__all__ = ["GRPOConfig", "parse_rlhf_args", "validate_world", "WorldPlan", "rlhf_help",
           "RolloutServerConfig", "parse_rollout_args", "valid_num_generations", "GROUPS", "ALIASES"]


@dataclass
class GRPOConfig:
    """Every option of a GRPO run, by stage (see groups.py for each option's help)."""
    model: ModelOptions = field(default_factory=ModelOptions)
    data: DataOptions = field(default_factory=DataOptions)
    training: TrainingOptions = field(default_factory=TrainingOptions)
    parallel: ParallelOptions = field(default_factory=ParallelOptions)
    grpo: GRPOOptions = field(default_factory=GRPOOptions)
    reward: RewardOptions = field(default_factory=RewardOptions)
    rollout: RolloutOptions = field(default_factory=RolloutOptions)
    logging: LoggingOptions = field(default_factory=LoggingOptions)

    def __post_init__(self) -> None:
        finalize(self)

    @classmethod
    def from_flat(cls, values: Dict[str, Any]) -> "GRPOConfig":
        """Build from {option name: value}; names as on the command line (aliases allowed)."""
        from .parse import canonical_name

        table = field_table(GROUPS)
        per_group: Dict[str, Dict[str, Any]] = {g: {} for g in GROUPS}
        for key, value in values.items():
            name = canonical_name(key, table)
            info = table[name]
            per_group[info.group][name] = convert(name, value, info.annotation)
        return cls(**{g: GROUPS[g](**kw) for g, kw in per_group.items()})

    def to_flat(self) -> Dict[str, Any]:
        """{option name: value}, e.g. to save next to a checkpoint; from_flat reads it back.

        Resolved defaults are kept, except steps_per_generation: it follows from
        generation_batch_size / global_batch_size, and the two are exclusive as inputs.
        """
        flat: Dict[str, Any] = {}
        for f in fields(self):
            flat.update(asdict(getattr(self, f.name)))
        flat.pop("steps_per_generation")
        return flat


def rlhf_help() -> str:
    return format_help(GROUPS)


def parse_rlhf_args(argv: Optional[Sequence[str]] = None) -> GRPOConfig:
    """A validated GRPOConfig from ms-swift style flags (`--config file.yaml` read first)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(rlhf_help())
        raise SystemExit(0)
    values = collect_values(argv, field_table(GROUPS), GROUPS)
    return GRPOConfig.from_flat(values)
