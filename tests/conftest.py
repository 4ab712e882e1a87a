"""Suite-wide pytest set-up: markers derived from what a test does, and shared fixtures.

Markers (registered in pytest.ini):
- `multiprocess` is added to every test that starts gloo ranks: it reaches
  `tests.harness.run_distributed` (in its body, a fixture it uses, or a module-level
  helper of a tests module they call), or one of `_LAUNCHERS`: functions that start the
  training CLI on several processes without the harness.
- `slow` is added to every `multiprocess` and `vllm` test: starting ranks or an engine
  alone costs more than the ~5 s a test of the fast subset may take. Single-process tests
  measured over ~5 s carry `@pytest.mark.slow` in their file.

`pytest -m "not slow"` is the fast subset for the edit loop (under 2 minutes on 2 cores).
"""
from __future__ import annotations

import functools
import os
import types

import pytest

from tests import harness

# The launcher's tcmalloc preload (megatron_grpo/preload.py, MGRPO_PRELOAD=1) re-executes each
# `megatron` command: off for the suite whatever the caller's environment says
# (tests/test_console.py turns it on).
os.environ["MGRPO_PRELOAD"] = "0"

_SPAWNERS = {"run_distributed"}  # names whose use marks a test as multi-process
_LAUNCHERS = {("tests.test_trainer_e2e", "_run")}  # (module, name)


def _codes(code: types.CodeType):
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _spawns(func, seen: set) -> bool:
    """Whether `func` (or a helper of a tests module it names) starts several processes."""
    func = getattr(func, "__wrapped__", func)  # lru_cache, fixtures' wrappers
    code = getattr(func, "__code__", None)
    if code is None or code in seen:
        return False
    if (func.__module__, func.__qualname__) in _LAUNCHERS:
        return True
    seen.add(code)
    namespace = getattr(func, "__globals__", {})
    for c in _codes(code):
        if _SPAWNERS & set(c.co_names):
            return True
        for name in c.co_names:
            obj = namespace.get(name)
            obj = getattr(obj, "__wrapped__", obj)
            if (isinstance(obj, types.FunctionType)
                    and obj.__module__.startswith("tests.") and _spawns(obj, seen)):
                return True
    return False


def pytest_collection_modifyitems(config, items):
    for item in items:
        funcs = [getattr(item, "function", None)]
        for defs in item._fixtureinfo.name2fixturedefs.values():
            funcs += [d.func for d in defs]
        seen: set = set()
        if any(_spawns(f, seen) for f in funcs if f is not None):
            item.add_marker(pytest.mark.multiprocess)
        if item.get_closest_marker("multiprocess") or item.get_closest_marker("vllm"):
            item.add_marker(pytest.mark.slow)
    # The heaviest files first, longest first (HEAVY_FILES), so that the suite ends on short
    # files: pytest-xdist hands a worker the next file in this order when it has fewer
    # than 2 tests left (scripts/test.sh passes --no-loadscope-reorder; xdist's own order
    # is by number of tests, most first, which left the long one-test files to the end).
    # Of the rest, files with a vLLM test run last, each file's tests still together
    # (module fixtures are built once): every vLLM test stops the pooled ranks, so a world
    # after it needs new rank processes (forks of the harness's preloaded fork server:
    # cheap, but the pool's per-world set-up starts again); grouped at the end the pool is
    # restarted a few times instead of once per such file.
    with_vllm = {item.module.__name__ for item in items if item.get_closest_marker("vllm")}
    heavy = {f"tests.{name}": i for i, name in enumerate(HEAVY_FILES)}
    items.sort(key=lambda item: (heavy.get(item.module.__name__, len(heavy)),
                                 item.module.__name__ in with_vllm))


# The files with the most CPU, most first (tools/profile_suite.py on 2 cores:
# 216 CPU s down to ~35). A file missing here only runs later than it could.
HEAVY_FILES = ("test_multi_turn_e2e", "test_trainer_e2e", "test_vl_e2e", "test_rollout_server",
               "test_example_ms_swift", "test_hf_formats", "test_vl_data_rollout",
               "test_lora_e2e",
               "test_lora_vllm", "test_rewards_reward_model", "test_console", "test_moe_e2e",
               "test_train_cp", "test_rollout_sync")


@pytest.fixture(autouse=True)
def _free_pooled_ranks_for_vllm(request):
    """A vLLM engine wants the memory that idle pooled ranks hold (each has torch and
    Megatron loaded): stop them first; the next world starts new ones."""
    if request.node.get_closest_marker("vllm"):
        harness.close_pool()
    yield


def pytest_sessionfinish(session, exitstatus):
    harness.close_pool()


@functools.lru_cache(maxsize=None)
def _tiny_model_cached(root: str, items: tuple):
    from tools.make_tiny_model import make_tiny_model

    name = "_".join(f"{k}-{v}" for k, v in items) or "default"
    return make_tiny_model(f"{root}/{name}", **dict(items))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """`tiny_model(**kwargs)` -> the folder of `tools.make_tiny_model(**kwargs)`, built once
    per session for each set of arguments. Read-only: copy it before changing files."""
    root = str(tmp_path_factory.mktemp("tiny_models"))
    return lambda **kwargs: _tiny_model_cached(root, tuple(sorted(kwargs.items())))
