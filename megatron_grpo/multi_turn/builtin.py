"""Built-in multi-turn schedulers and gym environments (registered by name).

    calculator      a tool-calling scheduler: the model writes <tool_call>EXPR</tool_call>,
                    the scheduler evaluates EXPR (+ - * / and parentheses on numbers) and
                    appends the result as a {"role": "tool"} message; a turn without a
                    tool call ends the trajectory.
    gym_scheduler   drives a gym environment (--gym_env NAME, or the row's
                    env_config["name"]): env.reset gives the first messages, env.step
                    after each model turn gives the next observation (a user message),
                    the step's reward and done; rollout_infos["total_reward"] sums the
                    rewards (the `gym_reward` reward function reads it).
    guess_number    a gym environment: guess a secret integer in [low, high] (env_config,
                    default 1..16; the secret from env_config["secret"], else drawn from
                    env_config["seed"]); each reply <guess>N</guess> gets "higher",
                    "lower" or "correct"; reward 1 on the correct guess, then done.
"""
from __future__ import annotations

import ast
import operator
import random
import re
from typing import Any, Dict, List, Optional, Tuple

from .scheduler import (Env, MultiTurnScheduler, call_hook, envs, register_env,
                         register_scheduler)

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv, ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expression: str) -> str:
    """The value of an arithmetic expression as text (integers without '.0'), or an
    'error: ...' line. Only numbers, + - * / and parentheses are evaluated: no names,
    calls or powers (nothing a model could use to run code or exhaust memory)."""
    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) \
                and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError(f"unsupported: {type(node).__name__}")

    text = expression.strip()
    if len(text) > 200:
        return "error: expression too long"
    try:
        result = value(ast.parse(text, mode="eval").body)
    except ZeroDivisionError:
        return "error: division by zero"
    except (SyntaxError, ValueError, TypeError, RecursionError) as e:
        return f"error: {e}" if str(e) else "error: invalid expression"
    if isinstance(result, float) and result.is_integer():
        result = int(result)
    return str(round(result, 6) if isinstance(result, float) else result)


@register_scheduler("calculator")
class CalculatorScheduler(MultiTurnScheduler):
    """Tool calls to a calculator; the tool's answer is a tool message (mask 0)."""

    def check_finished(self, infer_request, response_choice, current_turn) -> bool:
        if not TOOL_CALL.search(response_choice.message.content or ""):
            return True
        return super().check_finished(infer_request, response_choice, current_turn)

    def step(self, infer_request, response_choice, current_turn) -> Dict:
        calls = TOOL_CALL.findall(response_choice.message.content or "")
        results = [calculate(c) for c in calls]
        infer_request.messages.append({"role": "tool", "content": "\n".join(results)})
        return {"infer_request": infer_request, "rollout_infos": {"tool_calls": current_turn}}


@register_scheduler("gym_scheduler")
class GymScheduler(MultiTurnScheduler):
    """One environment per trajectory (keyed by request uuid), driven by the hooks."""

    def __init__(self, infer_engine=None, max_turns=None, *args, **kwargs) -> None:
        super().__init__(infer_engine, max_turns, *args, **kwargs)
        self.gym_env = kwargs.get("gym_env")
        self._envs: Dict[str, Env] = {}
        self._rewards: Dict[str, List[float]] = {}
        self._next: Dict[str, Optional[str]] = {}

    def _make_env(self, data_dict: Dict[str, Any]) -> Env:
        config = dict((data_dict or {}).get("env_config") or {})
        name = config.get("name", self.gym_env)
        if name not in envs:
            raise ValueError(f"--gym_env {name!r} is not a registered environment; registered: "
                             f"{sorted(envs)}. Fix: pick one, or register it in a plugin "
                             "(envs['name'] = cls) passed with --external_plugins")
        return envs[name](config)

    def on_trajectory_start(self, requests) -> None:
        for req in requests:
            env = self._make_env(req.data_dict)
            observation, _info, system = call_hook(env.reset(req))
            req.messages = ([{"role": "system", "content": system}] if system else []) + \
                [{"role": "user", "content": observation}]
            self._envs[req.uuid], self._rewards[req.uuid], self._next[req.uuid] = env, [], None

    def on_turn_end(self, infer_request, response_choice, current_turn) -> Dict:
        env = self._envs.get(infer_request.uuid)
        if env is None:
            return {"done": True}
        observation, reward, done, _info = call_hook(env.step([dict(m) for m in
                                                               infer_request.messages]))
        rewards = self._rewards[infer_request.uuid]
        rewards.append(float(reward))
        self._next[infer_request.uuid] = None if done else observation
        infos = {"total_reward": sum(rewards), "step_rewards": list(rewards), "gym_done": bool(done)}
        if done:
            self._close(infer_request.uuid)
        return {"done": bool(done), "rollout_infos": infos}

    def step(self, infer_request, response_choice, current_turn) -> Dict:
        observation = self._next.pop(infer_request.uuid, None)
        if observation is not None:
            infer_request.messages.append({"role": "user", "content": observation})
        return {"infer_request": infer_request}

    def _close(self, uuid: str) -> None:
        env = self._envs.pop(uuid, None)
        if env is not None:
            call_hook(env.close())

    def close(self) -> None:
        """Close the environments of trajectories cut before they were done."""
        for uuid in list(self._envs):
            self._close(uuid)


GUESS = re.compile(r"<guess>\s*(-?\d+)\s*</guess>")


@register_env("guess_number")
class GuessNumberEnv(Env):
    """Find the secret number; feedback after each guess (module docstring)."""

    def reset(self, config) -> Tuple[str, Dict, str]:
        c = self.env_config
        self.low, self.high = int(c.get("low", 1)), int(c.get("high", 16))
        self.secret = int(c["secret"]) if "secret" in c else \
            random.Random(c.get("seed", 0)).randint(self.low, self.high)
        system = ("Guess the secret number. Reply with one guess as <guess>N</guess>; "
                  "you will be told higher or lower.")
        return f"The number is between {self.low} and {self.high}.", {}, system

    def step(self, action) -> Tuple[str, float, bool, Dict]:
        found = GUESS.findall(action[-1]["content"] or "")
        if not found:
            return "Reply with <guess>N</guess>.", 0.0, False, {"valid": False}
        guess = int(found[-1])
        if guess == self.secret:
            return "correct", 1.0, True, {"valid": True}
        return ("higher" if guess < self.secret else "lower"), 0.0, False, {"valid": True}
