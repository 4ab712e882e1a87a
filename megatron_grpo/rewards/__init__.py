"""Reward functions (outcome rewards) and the plugin registry.

Built in: accuracy, format, cosine, repetition, soft_overlong, countdown. See
registry.py for the calling contract and how a plugin registers more.

    funcs = build_reward_funcs(["accuracy", "format"], config)
    rewards = score(funcs, completions, {"solution": [...], "completion_lengths": [...]})  # [N, 2]
"""
from . import accuracy, countdown, format_reward, length  # noqa: F401  (register the built-ins)
from .registry import (ORM, REWARDS, RewardFunc, build_reward_funcs, load_plugins, orms,
                       register_reward, registered_names)
from .scoring import RewardFunctionError, score

__all__ = ["ORM", "REWARDS", "RewardFunc", "RewardFunctionError", "build_reward_funcs",
           "load_plugins", "orms", "register_reward", "registered_names", "score"]
