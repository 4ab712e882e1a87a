"""Reward-function registry: name -> function or class, and plugin files that add to it.

Contract of a reward function (ms-swift's): called as `fn(completions, **columns,
trainer_state=...)` with `completions: list[str]` (N completions) and, as keyword lists
of length N, every dataset column of the completion's prompt (`solution`, `target`,
`nums`, ...) plus ms-swift's per-sample ones: `messages` (the conversation, the
completion last), `completion_lengths` (the model's tokens), `response_token_ids`,
`finish_reason`, `is_truncated`, `prompt_id` (shared by a prompt's group), `request_id`,
`rollout_infos`; `trainer_state` (scoring.TrainerState: global_step, max_steps). It
returns N floats or bools (None for a sample it does not apply to). It must accept
`**kwargs` it does not use.

    from megatron_grpo.rewards import register_reward

    @register_reward("shorter")                 # a function ...
    def shorter(completions, **kwargs):
        return [-len(c) / 100 for c in completions]

    @register_reward("keyword")                 # ... or a class built once per run:
    class Keyword:                              # `from_config(config)` if it has one,
        def __init__(self, config=None): ...    # else `cls(config)` (config: GRPOConfig
        def __call__(self, completions, **kw): ...  # or None)

A plugin file given with `--external_plugins` is imported before the reward names
are resolved. ms-swift plugins work with one change, their import line:

    from swift.rewards import ORM, orms          # or: from swift.plugin import ORM, orms
 -> from megatron_grpo.rewards import ORM, orms  # AsyncORM too

`orms` is this registry. A subclass of `ORM` is built as ms-swift builds it, `cls(args)`
with `args` the run's options by their flat ms-swift names (`args.max_completion_length`,
`args.cosine_max_len`), kept as `self.args`; other classes get the nested GRPOConfig. A plugin that still imports `swift` is refused before it runs, with a
one-line message naming the file, the line and the replacement import.
"""
from __future__ import annotations

import ast
import hashlib
import importlib.util
import inspect
import os
import sys
import types
from typing import Any, Callable, Dict, Iterable, List, NamedTuple, Optional

# name -> function or class. Module state is limited to this table and the set of
# plugin files already imported (so loading is idempotent within a process).
REWARDS: Dict[str, Any] = {}
orms = REWARDS  # ms-swift's name for it
_LOADED_PLUGINS: set = set()


class RewardFunc(NamedTuple):
    """A built reward function and the name metrics and errors use."""
    name: str
    fn: Callable[..., List[Optional[float]]]


def register_reward(name: str, *, override: bool = False) -> Callable[[Any], Any]:
    """Decorator registering a reward function or class under `name`."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_reward needs a non-empty name, got {name!r}")

    def deco(obj: Any) -> Any:
        if not callable(obj):
            raise ValueError(f"register_reward({name!r}): {obj!r} is not callable")
        old = REWARDS.get(name)
        if old is not None and old is not obj and not override and not _same_definition(old, obj):
            raise ValueError(f"reward function {name!r} is already registered ({_where(old)}); "
                             "pick another name or pass register_reward(name, override=True)")
        REWARDS[name] = obj
        return obj

    return deco


def _same_definition(a: Any, b: Any) -> bool:
    # The same source imported twice (a plugin also imported as a module) is not a clash.
    def identity(obj: Any) -> tuple:
        code = getattr(obj, "__code__", None)
        return (_where(obj), code.co_firstlineno if code is not None else None)
    return identity(a) == identity(b)


def _where(obj: Any) -> str:
    try:
        return f"{inspect.getsourcefile(obj)}:{getattr(obj, '__qualname__', obj)}"
    except TypeError:
        return repr(obj)


def registered_names() -> List[str]:
    return sorted(REWARDS)


# ms-swift modules whose API this package provides, and where: rewards, and the
# multi-turn schedulers and gym environments (megatron_grpo/multi_turn).
_SWIFT_REWARD_MODULES = ("swift.rewards", "swift.rewards.orm", "swift.plugin", "swift.plugin.orm")
_SWIFT_MODULES = {**{m: "megatron_grpo.rewards" for m in _SWIFT_REWARD_MODULES},
                  **{m: "megatron_grpo.multi_turn" for m in (
                      "swift.rollout", "swift.rollout.multi_turn", "swift.rollout.gym_env",
                      "swift.plugin.multi_turn", "swift.infer_engine.protocol")}}
REPLACEMENT_IMPORT = "from megatron_grpo.rewards import ORM, AsyncORM, orms"


def check_no_swift_import(path: str) -> None:
    """Refuse a plugin that imports ms-swift, naming the line and what to write instead.

    Checked on the source (not by importing it), so the message is the same whether or
    not ms-swift happens to be installed: with it installed, the plugin would register
    into ms-swift's table and its names would not be found here.
    """
    with open(path, encoding="utf-8") as f:
        source = f.read()
    try:
        tree = ast.parse(source, filename=path)
    except SyntaxError:
        return  # the import below reports it with the file's name
    lines = source.splitlines()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module]
        elif isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        else:
            continue
        swift = [m for m in modules if m == "swift" or m.startswith("swift.")]
        if not swift:
            continue
        line = lines[node.lineno - 1].strip()
        if isinstance(node, ast.ImportFrom) and node.module in _SWIFT_MODULES:
            names = ", ".join(a.name if a.asname is None else f"{a.name} as {a.asname}" for a in node.names)
            fix = f"replace it with `from {_SWIFT_MODULES[node.module]} import {names}`"
        else:
            fix = (f"megatron-grpo has no {swift[0]}; remove it (reward plugins need only "
                   f"`{REPLACEMENT_IMPORT}`)")
        raise ValueError(f"--external_plugins {path}:{node.lineno}: `{line}` imports ms-swift; {fix}")


def load_plugins(paths: Iterable[str]) -> None:
    """Import each plugin file once; an import error names the file."""
    for path in paths:
        path = os.path.abspath(path)
        if path in _LOADED_PLUGINS:
            continue
        if not os.path.isfile(path):
            raise ValueError(f"--external_plugins {path!r}: file not found")
        check_no_swift_import(path)
        digest = hashlib.sha1(path.encode()).hexdigest()[:8]
        mod_name = f"megatron_grpo_plugin_{os.path.splitext(os.path.basename(path))[0]}_{digest}"
        spec = importlib.util.spec_from_file_location(mod_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as e:
            sys.modules.pop(mod_name, None)
            raise ValueError(f"--external_plugins {path!r} failed to import: "
                             f"{type(e).__name__}: {e}") from e
        _LOADED_PLUGINS.add(path)


def build_reward_funcs(names: Iterable[str], config: Any = None) -> List[RewardFunc]:
    """Instantiate the named reward functions for a run (classes get the config)."""
    built = []
    for name in names:
        if name not in REWARDS:
            raise ValueError(f"--reward_funcs {name!r} is not a registered reward function; "
                             f"registered: {registered_names()}")
        obj = REWARDS[name]
        if inspect.isclass(obj):
            if hasattr(obj, "from_config"):
                obj = obj.from_config(config)
            elif issubclass(obj, ORM):  # ms-swift's constructor: the flat arguments
                obj = obj(flat_args(config))
            else:
                obj = obj(config)
        built.append(RewardFunc(name, obj))
    return built


def flat_args(config: Any) -> Any:
    """ms-swift's `args` for a GRPOConfig: its options by flat name; anything else as is."""
    to_flat = getattr(config, "to_flat", None)
    return types.SimpleNamespace(**to_flat()) if callable(to_flat) else config


class ORM:
    """Optional base class for class-style rewards (ms-swift's name and constructor).

    `build_reward_funcs` passes `args`: the run's options by flat name (`flat_args`), as
    ms-swift plugins read them (`args.max_completion_length`); None outside a run.
    """

    def __init__(self, args: Any = None, **kwargs: Any) -> None:
        self.args = args

    def __call__(self, completions: List[str], **kwargs: Any) -> List[Optional[float]]:
        raise NotImplementedError


class AsyncORM(ORM):
    """ms-swift's base for rewards whose `async def __call__` waits on I/O; `score` runs it."""

    async def __call__(self, completions: List[str], **kwargs: Any) -> List[Optional[float]]:
        raise NotImplementedError
