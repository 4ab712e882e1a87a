"""Run a test body in N gloo processes, with a timeout that turns a hang into a failure.

    from tests.harness import run_distributed

    def _body(rank, world_size, x):      # module level, so that `spawn` can pickle it
        ...                              # torch.distributed (gloo) is initialised here
        return something_picklable

    def test_x():
        results = run_distributed(_body, world_size=2, args=(3,), timeout=120)

Each rank runs in a fresh `spawn`ed process with torchrun's environment variables
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) and OMP_NUM_THREADS=1, so
code under test initialises exactly as it does under torchrun. A rank that raises
fails the test with its traceback; if the ranks do not all finish within `timeout`
seconds (a hung collective), every live rank dumps its Python stack (faulthandler on
SIGUSR1) and the test fails with those stacks instead of hanging CI.
"""
from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import signal
import socket
import sys
import tempfile
import time
import traceback
import warnings
from typing import Any, Callable, Sequence


class DistributedTestError(AssertionError):
    """One or more ranks failed or hung."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank, world_size, port, args, env, queue, stack_file, timeout):
    # Environment first: torch reads OMP_NUM_THREADS at import.
    os.environ.update(env)
    os.environ.update({
        "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    })
    stacks = open(stack_file, "w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    # A watchdog thread as well: libraries may take SIGUSR1 over, and a rank stuck in
    # C code still gets its Python stack written just before the parent gives up.
    faulthandler.dump_traceback_later(max(timeout - 2.0, 1.0), exit=False, file=stacks)
    # Megatron and vLLM warn at import about GPU-only extras a CPU run never has.
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine|TransformerEngine|"
                            "cuda_graph_scope|apex).*")
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        try:
            result = fn(rank, world_size, *args)
        finally:
            _teardown()
        faulthandler.cancel_dump_traceback_later()
        # Plain pickle sends tensors by value; the queue's own reducer would pass
        # shared-memory handles that die with this process.
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        queue.put((rank, "error", traceback.format_exc()))


def _teardown():
    try:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
    except Exception:  # megatron not imported or not initialised
        pass
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def run_distributed(fn: Callable[..., Any], world_size: int, args: Sequence[Any] = (),
                    timeout: float = 180.0, env: dict[str, str] | None = None) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; return results by rank."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    child_env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                 "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
                 "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **(env or {})}
    tmp = tempfile.mkdtemp(prefix="mgrpo_ranks_")
    stack_files = [os.path.join(tmp, f"rank{r}.stack") for r in range(world_size)]
    procs = [ctx.Process(target=_entry, daemon=False,
                         args=(fn, r, world_size, port, tuple(args), child_env, queue, stack_files[r],
                               timeout))
             for r in range(world_size)]
    for p in procs:
        p.start()

    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    while len(results) + len(errors) < world_size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            rank, status, payload = queue.get(timeout=min(remaining, 1.0))
        except queue_mod.Empty:  # check for ranks that died without reporting
            dead = [r for r, p in enumerate(procs)
                    if not p.is_alive() and p.exitcode not in (0, None)
                    and r not in results and r not in errors]
            for r in dead:
                errors[r] = f"process exited with code {procs[r].exitcode} without a report"
            if dead and len(errors) + len(results) < world_size:
                # The others are likely blocked in a collective with the dead rank.
                deadline = min(deadline, time.monotonic() + 15)
            continue
        if status == "ok":
            results[rank] = pickle.loads(payload)
        else:
            errors[rank] = payload

    hung = [r for r in range(world_size) if r not in results and r not in errors]
    if hung:
        for r in hung:
            if procs[r].is_alive():
                os.kill(procs[r].pid, signal.SIGUSR1)
        time.sleep(1.0)
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()

    if errors or hung:
        parts = []
        for r in sorted(errors):
            parts.append(f"--- rank {r} failed ---\n{errors[r]}")
        for r in hung:
            with open(stack_files[r]) as f:
                stack = f.read().strip() or "(no stack dumped)"
            parts.append(f"--- rank {r} hung (no result after {timeout:.0f}s; exit code "
                         f"{procs[r].exitcode}); stack ---\n{stack}")
        raise DistributedTestError(f"{len(errors)} rank(s) failed, {len(hung)} hung "
                                   f"of {world_size}:\n" + "\n".join(parts))
    return [results[r] for r in range(world_size)]


if __name__ == "__main__":  # pragma: no cover - manual smoke check
    print(run_distributed(lambda r, w: r, 2), file=sys.stderr)
