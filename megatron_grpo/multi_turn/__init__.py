"""Multi-turn rollouts: schedulers (ms-swift's contract), gym environments, registries.

    scheduler.py  MultiTurnScheduler / RolloutScheduler, Env, the request and response
                  types a scheduler sees, the `multi_turns` and `envs` registries
    builtin.py    calculator (tool calls), gym_scheduler, guess_number (an environment)

The loop that drives a scheduler over vLLM, token-exact, is rollout/trajectory.py.
Nothing here imports torch: the options are checked against these registries before
anything heavy starts. An ms-swift plugin changes its import line only:

    from swift.rollout.multi_turn import MultiTurnScheduler, multi_turns
 -> from megatron_grpo.multi_turn import MultiTurnScheduler, multi_turns
"""
from .scheduler import (ChatCompletionResponseChoice, ChatMessage, Env, Messages,
                        MultiTurnScheduler, RolloutInferRequest, RolloutScheduler, build_scheduler,
                        call_hook, check_scheduler, env_names, envs, multi_turns, register_env,
                        register_scheduler, scheduler_names)
from . import builtin  # noqa: F401,E402  (registers the built-ins; after the registries exist)

__all__ = ["ChatCompletionResponseChoice", "ChatMessage", "Env", "Messages", "MultiTurnScheduler",
           "RolloutInferRequest", "RolloutScheduler", "build_scheduler", "call_hook",
           "check_scheduler", "env_names", "envs", "multi_turns", "register_env",
           "register_scheduler", "scheduler_names"]
