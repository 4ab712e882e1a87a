"""Reward functions (outcome rewards) and the plugin registry.

Built in (ms-swift's names and meaning): accuracy, format, react_format, cosine,
repetition, soft_overlong, math; and countdown. See registry.py for the calling contract
and how a plugin registers more (an ms-swift plugin: `from megatron_grpo.rewards import
ORM, orms` instead of `from swift.rewards import ORM, orms`).

    funcs = build_reward_funcs(["accuracy", "format"], config)
    rewards = score(funcs, completions, {"solution": [...], "completion_lengths": [...]})  # [N, 2]
"""
from . import accuracy, countdown, format_reward, gym_reward, length, math_reward  # noqa: F401  (register the built-ins)
from .registry import (ORM, REWARDS, AsyncORM, RewardFunc, build_reward_funcs, load_plugins, orms,
                       register_reward, registered_names)
from .reward_model import DefaultRMPlugin, rm_plugins
from .scoring import RewardFunctionError, TrainerState, score

__all__ = ["DefaultRMPlugin", "ORM", "AsyncORM", "REWARDS", "RewardFunc", "RewardFunctionError", "TrainerState",
           "build_reward_funcs", "load_plugins", "orms", "register_reward", "registered_names",
           "rm_plugins", "score"]
