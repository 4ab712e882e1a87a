"""Multi-turn schedulers: ms-swift's contract, and a registry by name.

A scheduler decides, after each model turn of a trajectory, whether the trajectory
ends and what comes next (a tool's answer, an environment's observation). The
rollout loop that drives it (rollout/trajectory.py) owns the tokens: it samples each
turn from the exact token ids of the trajectory so far, and appends the messages a
scheduler adds by tokenizing only the span the chat template adds for them.

The contract is ms-swift's (swift/rollout/multi_turn.py, docs .../GRPO/DeveloperGuide/
multi_turn.md), so an ms-swift plugin runs after one change of its import line:

    from swift.rollout.multi_turn import MultiTurnScheduler, multi_turns
 -> from megatron_grpo.multi_turn import MultiTurnScheduler, multi_turns

Per turn of a trajectory, in this order (`current_turn` counts from 1):

    loop appends {"role": "assistant", "content": completion} to infer_request.messages
    on_turn_end(infer_request, response_choice, current_turn) -> {"done"?, "rollout_infos"?}
    check_finished(infer_request, response_choice, current_turn) -> bool
        ("done" from on_turn_end wins; max_turns always ends it)
    if not finished: step(infer_request, response_choice, current_turn) -> dict with
        infer_request        (required) the request of the next turn (messages appended)
        response_token_ids   (optional) this turn's tokens as the scheduler wants them
        response_loss_mask   (optional) 1/0 per response_token_ids (needs them)
        rollout_logprobs     (optional) one per token of mask 1 (else the sampled ones)
        rollout_infos        (optional) merged into the trajectory's infos

`on_trajectory_start(requests)` runs once before the first turn and may replace
`requests[i].messages` (a gym environment's first observation). Hooks may be plain or
`async def` (ms-swift's current ones are async; its docs show plain ones): both run.
Overriding `run()` (ms-swift's fully custom rollout, which calls the engine itself) is
not supported: the loop here keeps every trajectory in flight together, token-exact.
Such a scheduler is refused by name when the options are checked (check_scheduler).
"""
from __future__ import annotations

import inspect
import uuid as _uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

Messages = List[Dict[str, Any]]


# ---- what a scheduler sees (ms-swift's protocol names, the fields plugins read) ---------------

@dataclass
class RolloutInferRequest:
    """One trajectory's conversation; `data_dict`: its dataset row's other columns."""
    messages: Messages
    data_dict: Dict[str, Any] = field(default_factory=dict)
    tools: Optional[List[Any]] = None
    uuid: str = field(default_factory=lambda: _uuid.uuid4().hex)
    images: List[Any] = field(default_factory=list)
    audios: List[Any] = field(default_factory=list)
    videos: List[Any] = field(default_factory=list)
    objects: Dict[str, Any] = field(default_factory=dict)


@dataclass
class ChatMessage:
    role: str
    content: str
    tool_calls: Optional[List[Any]] = None


@dataclass
class ChatCompletionResponseChoice:
    """The model's turn. `token_ids`: what vLLM sampled (eos included when it stopped
    there); `logprobs`: {"content": [{"token": id, "logprob": x}, ...]} as ms-swift."""
    index: int
    message: ChatMessage
    finish_reason: Optional[str]
    token_ids: List[int]
    logprobs: Optional[Dict[str, Any]] = None


# ---- the schedulers ---------------------------------------------------------------------------

class RolloutScheduler:
    """Base of every scheduler (ms-swift's constructor: engine, max_turns, keywords).

    Keywords the loop passes: `tokenizer` (the run's), `gym_env` (--gym_env), `args`
    (the run's options by flat name, or None)."""

    def __init__(self, infer_engine: Any = None, max_turns: Optional[int] = None, *args,
                 **kwargs) -> None:
        self.infer_engine = infer_engine
        self.max_turns = max_turns
        self._tokenizer = kwargs.get("tokenizer")
        self.args = kwargs.get("args")

    @property
    def tokenizer(self):
        return self._tokenizer

    def on_trajectory_start(self, requests: List[RolloutInferRequest]) -> None:
        """Before the first turn; may change requests[i].messages in place."""

    def on_turn_end(self, infer_request: RolloutInferRequest,
                    response_choice: ChatCompletionResponseChoice, current_turn: int) -> Dict:
        """After the assistant message is appended: {'done': bool?, 'rollout_infos': dict?}."""
        return {}

    def check_finished(self, infer_request: RolloutInferRequest,
                       response_choice: ChatCompletionResponseChoice, current_turn: int) -> bool:
        """A single-turn scheduler: every trajectory ends after its first turn."""
        return True

    def step(self, infer_request: RolloutInferRequest,
             response_choice: ChatCompletionResponseChoice, current_turn: int) -> Dict:
        return {"infer_request": infer_request}

    @staticmethod
    def _extract_logprobs_from_choice(response_choice: ChatCompletionResponseChoice) -> List[float]:
        if not response_choice.logprobs or "content" not in response_choice.logprobs:
            return []
        return [item["logprob"] for item in response_choice.logprobs["content"]]


class MultiTurnScheduler(RolloutScheduler):
    """ms-swift's base for multi-turn: subclasses implement `step` (and may override
    `check_finished`, `on_trajectory_start`, `on_turn_end`)."""

    def check_finished(self, infer_request: RolloutInferRequest,
                       response_choice: ChatCompletionResponseChoice, current_turn: int) -> bool:
        """Ends on a cut turn (finish_reason 'length') or at max_turns."""
        if response_choice.finish_reason == "length":
            return True
        return bool(self.max_turns and current_turn >= self.max_turns)

    def step(self, infer_request: RolloutInferRequest,
             response_choice: ChatCompletionResponseChoice, current_turn: int) -> Dict:
        raise NotImplementedError(f"{type(self).__name__}: a MultiTurnScheduler implements step()")


def call_hook(result: Any) -> Any:
    """The value of a hook's result, running it to completion when the hook is async."""
    if inspect.isawaitable(result):
        import asyncio

        async def wait():
            return await result
        return asyncio.run(wait())
    return result


# ---- gym environments (ms-swift's Env contract) -----------------------------------------------

class Env:
    """A gym-style environment, one instance per trajectory (`env_config`: the dataset
    row's env_config column, or {}). Methods may be plain or async, as in ms-swift.

        reset(request) -> (observation, info, system_message)
        step(messages) -> (next_observation, reward, done, info)   messages: the whole
                          conversation, the model's latest reply last
        close()
    """

    def __init__(self, env_config: Optional[Dict[str, Any]] = None) -> None:
        self.env_config = env_config or {}

    def reset(self, config: RolloutInferRequest):
        raise NotImplementedError

    def step(self, action: Messages):
        raise NotImplementedError

    def close(self) -> None:
        pass


# ---- registries -------------------------------------------------------------------------------

# name -> scheduler class / env class. ms-swift's names, so plugins register as they do
# there (`multi_turns['my_scheduler'] = MyScheduler`, `envs['my_env'] = MyEnv`).
multi_turns: Dict[str, type] = {}
envs: Dict[str, type] = {}


def register_scheduler(name: str) -> Callable[[type], type]:
    def deco(cls: type) -> type:
        multi_turns[name] = cls
        return cls
    return deco


def register_env(name: str) -> Callable[[type], type]:
    def deco(cls: type) -> type:
        envs[name] = cls
        return cls
    return deco


def scheduler_names() -> List[str]:
    return sorted(multi_turns)


def env_names() -> List[str]:
    return sorted(envs)


def check_scheduler(name: str) -> None:
    """Refuse a registered scheduler the loop cannot drive: one that overrides ms-swift's
    `run()` (its own rollout loop over the engine; there is no engine call to hand it here)."""
    cls = multi_turns[name]
    for klass in cls.__mro__:
        if klass in (MultiTurnScheduler, RolloutScheduler, object):
            break
        if "run" in vars(klass):
            where = "" if klass is cls else f" (in its base {klass.__qualname__})"
            raise ValueError(
                f"--multi_turn_scheduler {name!r}: {cls.__qualname__} overrides run(){where}, "
                "ms-swift's fully custom rollout; not supported: the rollout loop here drives "
                "vLLM itself (every trajectory in flight together, token-exact). Fix: drop run() "
                "and put its logic in step() (append the next messages, or return "
                "response_token_ids / response_loss_mask), check_finished(), "
                "on_trajectory_start() and on_turn_end()")


def build_scheduler(name: str, *, max_turns: Optional[int], tokenizer: Any, gym_env: Optional[str] = None,
                    args: Any = None) -> RolloutScheduler:
    """The scheduler registered as `name` (built-ins, plugins loaded beforehand)."""
    if name not in multi_turns:
        raise ValueError(f"--multi_turn_scheduler {name!r} is not a registered scheduler; "
                         f"registered: {scheduler_names()}. Fix: pick one, or register it in a "
                         "plugin file passed with --external_plugins (multi_turns['name'] = cls)")
    check_scheduler(name)
    cls = multi_turns[name]
    return cls(None, max_turns, tokenizer=tokenizer, gym_env=gym_env, args=args)
