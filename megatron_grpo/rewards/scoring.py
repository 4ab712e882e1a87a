"""Run every reward function over a batch of completions: a [N, F] tensor.

A reward function that raises is re-run one sample at a time to find the sample
that breaks it, and the error names the function, that sample's index, the start
of its completion and its dataset columns. A function returning the wrong number
of values or a non-number fails the same way. `None` (the function does not apply
to a sample) becomes NaN, for the trainer's nan-aware weighting; a bool counts 1 or 0
(as ms-swift's tensor of the returned list does).

Besides the per-sample columns, every function gets `trainer_state` (ms-swift's
keyword): a TrainerState with `global_step` and `max_steps`, for rewards on a schedule.
"""
from __future__ import annotations

import asyncio
import inspect
import math
import numbers
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, List, Mapping, Optional, Sequence, Union

from .registry import RewardFunc

if TYPE_CHECKING:
    import torch

PREFIX_CHARS = 120  # completion characters shown in an error


class RewardFunctionError(RuntimeError):
    """A reward function failed; the message names it and the sample."""


@dataclass(frozen=True)
class TrainerState:
    """What ms-swift's Megatron trainer passes reward functions as `trainer_state`:
    `iteration` (optimizer steps done; `global_step` too, as transformers' TrainerState
    names it), `max_steps` (the run's), `consumed_train_samples` (samples the optimizer
    steps so far took, global_batch_size each)."""
    iteration: int = 0
    max_steps: Optional[int] = None
    global_batch_size: int = 0

    @property
    def global_step(self) -> int:
        return self.iteration

    @property
    def consumed_train_samples(self) -> int:
        return self.iteration * self.global_batch_size


def _sample_view(completions: Sequence[str], columns: Mapping[str, Sequence[Any]], i: int) -> str:
    text = completions[i]
    prefix = text[:PREFIX_CHARS] + ("..." if len(text) > PREFIX_CHARS else "")
    cols = {k: _short(v[i]) for k, v in columns.items()}
    return f"sample {i}: completion {prefix!r}, columns {cols}"


def _short(value: Any, limit: int = 80) -> Any:
    text = repr(value)
    return value if len(text) <= limit else text[:limit] + "..."


def _locate(fn: Callable, completions: Sequence[str], columns: Mapping[str, Sequence[Any]],
            state: Optional[TrainerState]) -> Optional[int]:
    """Index of the first sample on which `fn` alone raises, or None."""
    for i in range(len(completions)):
        try:
            _call(fn, completions[i:i + 1], {k: v[i:i + 1] for k, v in columns.items()}, state)
        except Exception:
            return i
    return None


def _as_floats(name: str, out: Any, completions: Sequence[str],
               columns: Mapping[str, Sequence[Any]]) -> List[float]:
    if hasattr(out, "tolist"):  # a tensor or numpy array
        out = out.tolist()
    try:
        out = list(out)
    except TypeError:
        raise RewardFunctionError(f"reward function {name!r} returned {type(out).__name__}, "
                                  f"expected a list of {len(completions)} floats") from None
    if len(out) != len(completions):
        raise RewardFunctionError(f"reward function {name!r} returned {len(out)} values for "
                                  f"{len(completions)} completions")
    values = []
    for i, v in enumerate(out):
        if v is None:
            values.append(math.nan)
        elif isinstance(v, numbers.Real):       # bool included: True counts 1.0
            values.append(float(v))
        else:
            raise RewardFunctionError(f"reward function {name!r} returned {v!r} (not a number) for "
                                      f"{_sample_view(completions, columns, i)}")
    return values


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def _call(fn: Callable, completions: Sequence[str], columns: Mapping[str, Sequence[Any]],
          state: Optional[TrainerState]) -> Any:
    """fn(completions, **columns, trainer_state=state), awaited when fn is async (ms-swift's
    AsyncORM)."""
    result = fn(list(completions), **{k: list(v) for k, v in columns.items()},
                trainer_state=state)
    if inspect.isawaitable(result):
        result = asyncio.run(_awaited(result))
    return result


def score(reward_funcs: Sequence[Union[RewardFunc, Callable]], completions: Sequence[str],
          columns: Optional[Mapping[str, Sequence[Any]]] = None,
          trainer_state: Optional[TrainerState] = None) -> "torch.Tensor":
    """Rewards [N, F] (float32) of N completions under F reward functions.

    `columns` maps each dataset column (and `completion_lengths`, `messages`, ...) to N
    values, one per completion (a prompt's columns repeated for each of its completions).
    """
    import torch  # here, so that config validation (which loads plugins) stays light

    columns = dict(columns or {})
    n = len(completions)
    for key, value in columns.items():
        if len(value) != n:
            raise ValueError(f"column {key!r} has {len(value)} values for {n} completions")
    out = torch.empty(n, len(reward_funcs), dtype=torch.float32)
    for j, rf in enumerate(reward_funcs):
        name, fn = (rf.name, rf.fn) if isinstance(rf, RewardFunc) else (getattr(rf, "__name__", repr(rf)), rf)
        try:
            result = _call(fn, completions, columns, trainer_state)
        except Exception as e:
            i = _locate(fn, completions, columns, trainer_state)
            where = (_sample_view(completions, columns, i) if i is not None
                     else f"the batch of {n} (each sample alone passed)")
            raise RewardFunctionError(f"reward function {name!r} raised {type(e).__name__}: {e} "
                                      f"on {where}") from e
        out[:, j] = torch.tensor(_as_floats(name, result, completions, columns), dtype=torch.float32)
    return out
