"""gym_reward: a trajectory's environment reward (multi-turn, --use_gym_env).

The gym scheduler sums the rewards its environment returns over a trajectory into
rollout_infos["total_reward"]; with --use_gym_env that sum is one more reward column,
next to the completion-level reward functions (as ms-swift appends it). A sample
without one (its scheduler reported none) gets None: the function does not apply.
"""
from __future__ import annotations

from .registry import register_reward


@register_reward("gym_reward")
def gym_reward(completions, rollout_infos=None, **kwargs):
    infos = rollout_infos or [None] * len(completions)
    return [None if not info or info.get("total_reward") is None else float(info["total_reward"])
            for info in infos]
