"""GRPO run configuration: nested option groups, flat ms-swift flags, YAML, validation.

    cfg = parse_rlhf_args(["--model", "tiny", "--dataset", "d.jsonl", "--reward_funcs", "format"])
    cfg.parallel.tensor_model_parallel_size, cfg.grpo.loss_type, cfg.reward.reward_funcs
    plan = validate_world(cfg, world_size=2)     # once the number of ranks is known

Constructing a GRPOConfig resolves dependent defaults and checks everything the
options alone decide (model folder, dataset files, choices, batch divisibility,
reward names); `validate_world` adds the checks that need the world size. Both
raise a ConfigError (a ValueError) naming, for every problem at once, the option,
the value, what is valid and the fix; `parse_rlhf_args(argv, world_size=N)` reports
the parser's, the options' and the world size's problems in that one message.
"""
from __future__ import annotations

import sys
from dataclasses import InitVar, asdict, dataclass, field, fields
from typing import Any, Dict, Optional, Sequence, Tuple

from .errors import ConfigError, Problems
from .groups import (ALIASES, GROUPS, DataOptions, EvalOptions, GRPOOptions, LoggingOptions,
                     ModelOptions, ParallelOptions, RewardOptions, RolloutOptions, TrainingOptions)
from .parse import collect_values, field_table, format_help, values_from_mapping
from .rollout_server import RolloutServerConfig, parse_rollout_args
from .validate import WORLD_OPTIONS, WorldPlan, finalize, valid_num_generations, validate_world

__all__ = ["GRPOConfig", "parse_rlhf_args", "build_config", "validate_world", "WorldPlan",
           "rlhf_help", "ConfigError", "Problems", "RolloutServerConfig", "parse_rollout_args",
           "valid_num_generations", "GROUPS", "ALIASES"]


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
    evaluation: EvalOptions = field(default_factory=EvalOptions)
    logging: LoggingOptions = field(default_factory=LoggingOptions)
    # Where finalize records its problems; None: raise them (one ConfigError) at once.
    problems: InitVar[Optional[Problems]] = None

    def __post_init__(self, problems: Optional[Problems]) -> None:
        finalize(self, problems)

    @classmethod
    def from_flat(cls, values: Dict[str, Any], problems: Optional[Problems] = None
                  ) -> "GRPOConfig":
        """Build from {option name: raw value}, names as on the command line (aliases
        allowed). Every problem goes to `problems`; without it, they are raised together."""
        p = Problems() if problems is None else problems
        values = values_from_mapping(values, field_table(GROUPS), p, "the config")
        if problems is None:
            p.raise_if_any()
        return cls._of(values, problems)

    @classmethod
    def _of(cls, values: Dict[str, Any], problems: Optional[Problems]) -> "GRPOConfig":
        """Build from {canonical option name: converted value} (from_flat, the parser)."""
        table = field_table(GROUPS)
        per_group: Dict[str, Dict[str, Any]] = {g: {} for g in GROUPS}
        for name, value in values.items():
            per_group[table[name].group][name] = value
        return cls(**{g: GROUPS[g](**kw) for g, kw in per_group.items()}, problems=problems)

    def to_flat(self) -> Dict[str, Any]:
        """{option name: value}, e.g. to save next to a checkpoint; from_flat reads it back.

        Resolved defaults are kept, except steps_per_generation: it follows from
        generation_batch_size / global_batch_size.
        """
        flat: Dict[str, Any] = {}
        for f in fields(self):
            flat.update(asdict(getattr(self, f.name)))
        flat.pop("steps_per_generation")
        return flat


def rlhf_help() -> str:
    return format_help(GROUPS)


def build_config(argv: Sequence[str], world_size: Optional[int] = None
                 ) -> Tuple[GRPOConfig, Problems]:
    """A GRPOConfig from ms-swift style flags and every problem found on the way: unknown
    flags, malformed values, then the option checks and, given `world_size`, the world-size
    checks. An option whose value could not be used keeps its default here, so the config
    is only to be used when there is no problem."""
    p = Problems()
    cfg = GRPOConfig._of(collect_values(argv, GROUPS, p), p)   # converted by the parser
    if world_size is not None and not p.names_any(WORLD_OPTIONS):
        validate_world(cfg, world_size, p)
    return cfg, p


def parse_rlhf_args(argv: Optional[Sequence[str]] = None,
                    world_size: Optional[int] = None) -> GRPOConfig:
    """A validated GRPOConfig from ms-swift style flags (`--config file.yaml` read first);
    a ConfigError listing every problem otherwise (see build_config). `--help` prints the
    options and exits."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cfg, problems = build_config(argv, world_size)
    problems.raise_if_any()
    return cfg
