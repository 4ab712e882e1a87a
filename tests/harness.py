"""Run a test body in N gloo processes, with a timeout that turns a hang into a failure.

    from tests.harness import run_distributed

    def _body(rank, world_size, x):      # module level, so that `spawn` can pickle it
        ...                              # torch.distributed (gloo) is initialised here
        return something_picklable

    def test_x():
        results = run_distributed(_body, world_size=2, args=(3,), timeout=120)

Each rank runs in its own process with torchrun's environment variables (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) and OMP_NUM_THREADS=1, so code under
test initialises exactly as it does under torchrun. The processes are forks of
multiprocessing's fork server, which imported torch, Megatron, transformers and vLLM
once (tests/rank_preload.py) and nothing else: no thread, no process group, no engine.
A rank that raises fails the test with its traceback; if the ranks do not all finish
within `timeout` seconds (a hung collective), every live rank dumps its Python stack
(faulthandler on SIGUSR1) and the test fails with those stacks instead of hanging CI.

Worlds reuse their processes. Starting a rank cost far more than most bodies (the torch
and Megatron imports, ~8 s per rank on a loaded 2-core machine, before the fork server
took them over; a fork still costs its gloo and module set-up), so the ranks are a pool
of long-lived workers: a world of N runs on workers 0..N-1, each with a new process group
on a new port, torchrun's variables set for the call, the environment, torch's default
RNG seed, default dtype and grad mode restored afterwards, and Megatron's parallel state
and the process group torn down. A worker is retired (its process exits) after a call
in which any rank failed or hung (its peers then see closed sockets, as with fresh
processes), and after a call that used vLLM beyond the preloaded import (an engine
start imports more of it; engine state is process-wide). Pass
`fresh=True` for a body that needs a process nothing ran in before (e.g. one that
checks process-wide state such as the CPU layer's install), or set
MGRPO_TEST_FRESH_WORLDS=1 to run every world in fresh processes (to rule the pool out
when a test fails).

`rollout_server(model, log_path, *flags)` runs `megatron rollout` for a test (below).
"""
from __future__ import annotations

import atexit
import contextlib
import faulthandler
import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from typing import Any, Callable, Iterator, Sequence


class DistributedTestError(AssertionError):
    """One or more ranks failed or hung."""


def process_running(pid: int) -> bool:
    """Whether process `pid` still runs (a zombie that nobody reaped has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def free_port() -> int:
    """A TCP port that nothing on this machine is bound to now, picked at random below the
    kernel's ephemeral range: the kernel never gives such a port to an outgoing connection
    (a test's HTTP client, vLLM's sockets), which took a port picked by bind(0) between
    the pick and a trainer's bind (EADDRINUSE). The kernel's own pick where
    the range leaves no room below it."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    rng = random.SystemRandom()
    for _ in range(200 if low >= 12_000 else 0):
        port = rng.randrange(10_000, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hf_tensors(path) -> dict:
    """Every tensor of the HF checkpoint in folder `path` (all its *.safetensors), by name:
    the reference a converted or exported checkpoint is compared with."""
    from safetensors.torch import load_file

    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, name)))
    return out


_IGNORED_WARNINGS = ".*(Apex|Transformer Engine|TransformerEngine|cuda_graph_scope|apex).*"


def run_together(commands: dict, timeout: float = 300, **popen) -> dict:
    """name -> CompletedProcess (text output) of every `(argv, env)` in `commands`, all
    started at once: for single-threaded CLI processes (dry runs), which on 2 cores take
    about the time of one each pair. A process still running at `timeout` is killed."""
    procs = {name: subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, **popen)
             for name, (argv, env) in commands.items()}
    results = {}
    try:
        for name, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=timeout)
            results[name] = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


def _torchrun_env(rank, world_size, port):
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port)}


class _InitError(Exception):
    """The process group could not start (not the body's fault)."""


def _run_rank(fn, rank, world_size, args):
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    except Exception as e:
        raise _InitError(f"init_process_group: {e}") from e
    try:
        return fn(rank, world_size, *args)
    finally:
        _teardown()


def _entry(fn, rank, world_size, port, args, env, queue, stack_file, timeout):
    """A fresh process for one rank of one world (fresh=True)."""
    # Environment first (the fork server loaded torch with OMP_NUM_THREADS=1 already).
    os.environ.update(env)
    os.environ.update(_torchrun_env(rank, world_size, port))
    stacks = open(stack_file, "w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    # A watchdog thread as well: libraries may take SIGUSR1 over, and a rank stuck in
    # C code still gets its Python stack written just before the parent gives up.
    faulthandler.dump_traceback_later(max(timeout - 2.0, 1.0), exit=False, file=stacks)
    # Megatron and vLLM warn at import about GPU-only extras a CPU run never has.
    warnings.filterwarnings("ignore", message=_IGNORED_WARNINGS)
    try:
        import torch

        torch.set_num_threads(1)
        result = _run_rank(fn, rank, world_size, args)
        faulthandler.cancel_dump_traceback_later()
        # Plain pickle sends tensors by value; the queue's own reducer would pass
        # shared-memory handles that die with this process.
        queue.put((0, rank, "ok", pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        queue.put((0, rank, "error", traceback.format_exc()))


def _worker(env, tasks, queue, stack_file):
    """A pooled rank: runs one world's body per task until told to stop or retired."""
    preloaded = frozenset(sys.modules)
    _serve(env, tasks, queue, stack_file, preloaded)
    _exit_now(queue, preloaded)


def _children() -> list[str] | None:
    """This process's child processes (Linux /proc), None if they cannot be listed."""
    try:
        me = f"/proc/{os.getpid()}/task"
        pids = []
        for task in os.listdir(me):
            with open(f"{me}/{task}/children") as f:
                pids += f.read().split()
        return pids
    except OSError:
        return None


def _context():
    """multiprocessing's fork server, preloaded with what ranks import (module docstring).
    The server starts with this process's environment at its first use: OMP_NUM_THREADS=1
    there (tests/rank_preload.py), since torch reads it when it loads."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["tests.rank_preload"])
    return ctx


def _ran_vllm(preloaded: frozenset) -> bool:
    """Whether this process used vLLM beyond the preloaded import: starting an engine
    imports vLLM modules the preload did not (its worker, model runner, model class)."""
    return any(name.startswith("vllm") and name not in preloaded for name in sys.modules)


def _exit_now(queue, preloaded: frozenset) -> None:
    """End a worker that is done without the interpreter's clean-up, which costs 1-2 s of
    CPU once torch and Megatron are loaded (5 s and more of wall on a busy 2-core machine,
    where close_pool gave up waiting after its 5 s grace), paid by every stop of the pool.
    What it put on the result queue is flushed first. A worker that ran vLLM, or has child
    processes (e.g. multiprocessing's resource tracker), exits the normal way: their
    clean-up matters (vLLM's CPU communicator unlinks its shared-memory segments, whose
    names are the same in the next engine's TP group, at exit: skipped, that engine fails
    with "create shm in SHMManager failed. errno: 17")."""
    queue.close()
    queue.join_thread()
    if not _ran_vllm(preloaded) and _children() == []:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _serve(env, tasks, queue, stack_file, preloaded: frozenset):
    os.environ.update(env)
    stacks = open(stack_file, "w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    warnings.filterwarnings("ignore", message=_IGNORED_WARNINGS)
    import torch

    # What a fresh process starts with, restored before every task.
    base_env, seed, dtype = dict(os.environ), torch.initial_seed(), torch.get_default_dtype()
    while True:
        task = tasks.get()
        if task is None:
            return
        job, fn, rank, world_size, port, args, timeout = task
        stacks.seek(0)
        stacks.truncate()
        faulthandler.dump_traceback_later(max(timeout - 2.0, 1.0), exit=False, file=stacks)
        os.environ.clear()
        os.environ.update(base_env)
        os.environ.update(_torchrun_env(rank, world_size, port))
        torch.manual_seed(seed)
        torch.set_default_dtype(dtype)
        torch.set_grad_enabled(True)
        torch.set_num_threads(1)
        try:
            result = _run_rank(fn, rank, world_size, args)
            faulthandler.cancel_dump_traceback_later()
        except BaseException as e:  # noqa: BLE001 - report everything to the parent
            status = "init error" if isinstance(e, _InitError) else "error"
            queue.put((job, rank, status, traceback.format_exc()))
            return  # retired: peers blocked on this rank see its sockets close
        # An engine's state is process-wide: after vLLM the next world gets a new process.
        retire = _ran_vllm(preloaded)
        queue.put((job, rank, "ok, exiting" if retire else "ok", pickle.dumps(result)))
        if retire:
            return


def _teardown():
    # Only a Megatron the body imported: importing it here (~5 s of CPU per rank) cost
    # bodies that never use it more than their own work.
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is not None:
        try:
            parallel_state.destroy_model_parallel()
        except Exception:  # not initialised
            pass
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _stop(p, grace: float) -> None:
    """Wait up to `grace` s for a rank process to end, then kill it and what it started
    (a library's helper process would otherwise outlive the test run)."""
    p.join(timeout=grace)
    if p.is_alive():
        try:
            import psutil

            for child in psutil.Process(p.pid).children(recursive=True):
                child.kill()
        except Exception:  # psutil missing, or the process just ended
            pass
        p.kill()
        p.join()


class _Pool:
    """Long-lived rank processes (module docstring), grown on demand, one environment."""

    def __init__(self, env: dict[str, str]):
        self.env = env
        self.ctx = _context()
        self.queue = self.ctx.Queue()
        # After multiprocessing's own exit hook (registered when the queue imported its
        # util module), so that this one runs first: that hook joins live children.
        atexit.register(close_pool)
        self.tmp = tempfile.mkdtemp(prefix="mgrpo_pool_")
        self.workers: list[tuple[Any, Any, str]] = []  # (process, task queue, stack file)
        self.jobs = 0
        self.reruns = 0  # worlds run again after a failed process-group start (run())
        # Retired workers, maybe still exiting: one that ran vLLM needs seconds of clean-up
        # at exit (3.8-7.3 s measured), which so overlaps the test's own work after its
        # world. They are waited for (30 s, then killed) before the next world starts and
        # in close(): vLLM unlinks shared memory at exit under names that the next
        # engine's TP group reuses, and no task may go to a process on its way out.
        self.exiting: list[Any] = []

    def _spawn(self, index):
        tasks = self.ctx.Queue()
        stack_file = os.path.join(self.tmp, f"worker{index}.{time.monotonic_ns()}.stack")
        p = self.ctx.Process(target=_worker, args=(self.env, tasks, self.queue, stack_file))
        p.start()
        return p, tasks, stack_file

    def run(self, fn, world_size, args, timeout):
        try:
            return self._run(fn, world_size, args, timeout)
        except DistributedTestError as e:
            if not getattr(e, "init_only", False):
                raise
            # Seen rarely on a busy machine: gloo's mesh set-up between reused processes
            # fails ("connectFullMesh ... Connection closed by peer") before the body ran.
            # The failed world's processes are gone; run it once more on new ones.
            warnings.warn(f"process group start-up failed, world run again: {e}")
            self.reruns += 1
            return self._run(fn, world_size, args, timeout)

    def _reap(self):
        for p in self.exiting:
            _stop(p, grace=30)
        self.exiting = []

    def _run(self, fn, world_size, args, timeout):
        self._reap()
        for i in range(world_size):
            if i == len(self.workers):
                self.workers.append(self._spawn(i))
            elif not self.workers[i][0].is_alive():
                self.workers[i][0].join()
                self.workers[i] = self._spawn(i)
        self.jobs += 1
        port = free_port()
        ranks = self.workers[:world_size]
        for r, (_, tasks, _) in enumerate(ranks):
            tasks.put((self.jobs, fn, r, world_size, port, tuple(args), timeout))
        exiting: set[int] = set()
        try:
            return _collect([p for p, _, _ in ranks], self.queue, self.jobs,
                            [f for _, _, f in ranks], timeout, exiting, pooled=True)
        finally:
            # Not joined here (see self.exiting); the next world replaces them.
            self.exiting += [self.workers[r][0] for r in exiting]

    def close(self):
        self._reap()
        for p, tasks, _ in self.workers:
            if p.is_alive():
                tasks.put(None)
        for p, _, _ in self.workers:
            _stop(p, grace=5)
        self.workers = []


_POOL: _Pool | None = None


def pool_reruns() -> int:
    """How many worlds the pool has run again on new processes after a failed start."""
    return 0 if _POOL is None else _POOL.reruns


def close_pool():
    """Stop the pooled ranks (conftest calls this at the end of the session)."""
    global _POOL
    if _POOL is not None:
        _POOL.close()
        _POOL = None



# How long the other ranks of a world get to report once one rank failed or died.
_PEER_GRACE = 15.0


def _collect(procs, queue, job, stack_files, timeout, exiting=None, pooled=False):
    """Results of `job` by rank; on a failure or hang, stops every rank's process and
    raises DistributedTestError with the tracebacks and stacks. Ranks that said they
    exit after their result are added to `exiting`."""
    exiting = set() if exiting is None else exiting
    init_errors: set[int] = set()
    world_size = len(procs)
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    while len(results) + len(errors) < world_size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            got_job, rank, status, payload = queue.get(timeout=min(remaining, 1.0))
        except queue_mod.Empty:  # check for ranks that died without reporting
            dead = [r for r, p in enumerate(procs)
                    if not p.is_alive() and p.exitcode not in (0, None)
                    and r not in results and r not in errors]
            for r in dead:
                errors[r] = f"process exited with code {procs[r].exitcode} without a report"
            if dead and len(errors) + len(results) < world_size:
                # The others are likely blocked in a collective with the dead rank.
                deadline = min(deadline, time.monotonic() + _PEER_GRACE)
            continue
        if got_job != job:
            continue  # a late report of an earlier world
        if status.startswith("ok"):
            results[rank] = pickle.loads(payload)
            if status == "ok, exiting":
                exiting.add(rank)
        else:
            errors[rank] = payload
            if status == "init error":
                init_errors.add(rank)
            # The others are likely blocked on this rank: in a collective, or (after a
            # failed process-group start) waiting in init_process_group for keys it will
            # never publish, which gloo waits out for 30 min. Waiting for them until
            # `timeout` made a failed start cost the whole timeout before its rerun.
            deadline = min(deadline, time.monotonic() + _PEER_GRACE)

    hung = [r for r in range(world_size) if r not in results and r not in errors]
    if hung:
        for r in hung:
            if procs[r].is_alive():
                os.kill(procs[r].pid, signal.SIGUSR1)
        time.sleep(1.0)
    if errors or hung:
        for p in procs:  # the whole world: ranks of a failed world do not go on
            _stop(p, grace=1 if pooled else 5)
        parts = []
        for r in sorted(errors):
            parts.append(f"--- rank {r} failed ---\n{errors[r]}")
        for r in hung:
            with open(stack_files[r]) as f:
                stack = f.read().strip() or "(no stack dumped)"
            waited = f"{timeout:.0f}s" if not errors else \
                f"{_PEER_GRACE:.0f}s after another rank failed"
            parts.append(f"--- rank {r} hung (no result after {waited}; exit code "
                         f"{procs[r].exitcode}); stack ---\n{stack}")
        error = DistributedTestError(f"{len(errors)} rank(s) failed, {len(hung)} hung "
                                     f"of {world_size}:\n" + "\n".join(parts))
        error.init_only = bool(init_errors) and set(errors) == init_errors
        raise error
    return [results[r] for r in range(world_size)]


def run_distributed(fn: Callable[..., Any], world_size: int, args: Sequence[Any] = (),
                    timeout: float = 180.0, env: dict[str, str] | None = None,
                    fresh: bool = False) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; return results by rank.

    The ranks are pooled processes unless `fresh` (or MGRPO_TEST_FRESH_WORLDS=1)."""
    global _POOL
    child_env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                 "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
                 "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **(env or {})}
    if not fresh and os.environ.get("MGRPO_TEST_FRESH_WORLDS", "0") in ("", "0"):
        if _POOL is not None and _POOL.env != child_env:
            close_pool()
        if _POOL is None:
            _POOL = _Pool(child_env)
        return _POOL.run(fn, world_size, args, timeout)

    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    tmp = tempfile.mkdtemp(prefix="mgrpo_ranks_")
    stack_files = [os.path.join(tmp, f"rank{r}.stack") for r in range(world_size)]
    procs = [ctx.Process(target=_entry, daemon=False,
                         args=(fn, r, world_size, port, tuple(args), child_env, queue, stack_files[r],
                               timeout))
             for r in range(world_size)]
    for p in procs:
        p.start()
    try:
        return _collect(procs, queue, 0, stack_files, timeout)
    finally:
        for p in procs:
            _stop(p, grace=5)


if __name__ == "__main__":  # pragma: no cover - manual smoke check
    print(run_distributed(lambda r, w: r, 2), file=sys.stderr)


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class PortTaken(AssertionError):
    """The free port picked for a server was taken by another process before it bound."""


class RolloutServerProcess:
    """A `megatron rollout` started by `rollout_server`: its port, process and log."""

    def __init__(self, port: int, proc: "subprocess.Popen", log: str) -> None:
        self.port, self.proc, self.log = port, proc, log

    def log_tail(self, chars: int = 5000) -> str:
        with open(self.log, errors="replace") as f:
            return f.read()[-chars:]

    def wait_until_ready(self, timeout: float = 400) -> None:
        """Until /health answers; fails with the server's log if it never does, or at once
        if the server exited (PortTaken when its port was taken in the meantime)."""
        import urllib.request

        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5):
                    return
            except OSError:
                pass
            if self.proc.poll() is not None:
                tail = self.log_tail()
                kind = PortTaken if "Address already in use" in tail else AssertionError
                raise kind(f"the rollout server exited with {self.proc.returncode} before "
                           f"answering on port {self.port}; log (tail):\n{tail}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no rollout server answered on port {self.port} within "
                                     f"{timeout:.0f} s; log (tail):\n{self.log_tail()}")
            time.sleep(0.5)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the whole process group (the API server and its engine processes): the
        client's group, whose signal the zygote passes on to the server's (SIGKILL: the
        zygote kills it when the client dies), or the server's own in a new interpreter."""
        os.killpg(self.proc.pid, sig)

    def stop(self) -> None:
        """SIGTERM to the group, SIGKILL if it has not exited within 30 s."""
        if self.proc.poll() is None:
            self.kill(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill(signal.SIGKILL)
                self.proc.wait()


@contextlib.contextmanager
def rollout_server(model, log_path, *flags: str, wait: bool = True, timeout: float = 400,
                   unset_env: Sequence[str] = ()) -> Iterator[RolloutServerProcess]:
    """`python -m megatron_grpo.rollout.server --model MODEL --port P *flags` (what
    `megatron rollout` runs) on a free port, output to `log_path`, through the tests' CLI
    zygote (tests/cli_zygote.py: the API server is a fork of it, in a session of its own,
    unless an import-time variable differs), so that the server and its engine processes
    are stopped as one group on exit.

    wait=False returns at once (the caller starts other work while the engine loads,
    and waits with `wait_until_ready`). The child gets OMP_NUM_THREADS=1, this checkout
    on PYTHONPATH, and neither VLLM_ENABLE_V1_MULTIPROCESSING (the server's engine runs in
    its own process) nor the names in `unset_env`.
    """
    drop = {"VLLM_ENABLE_V1_MULTIPROCESSING", *unset_env}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    from tests import cli_zygote

    env = cli_zygote.env(env)
    # A free port can be taken between free_port() and the server's bind (other tests'
    # ranks and servers pick ports too): with wait=True such a start is retried.
    for attempt in range(3):
        port = free_port()
        cmd = cli_zygote.command("--model", str(model), "--port", str(port), *flags,
                                 module="megatron_grpo.rollout.server")
        log = open(log_path, "w")
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        server = RolloutServerProcess(port, proc, str(log_path))
        try:
            if wait:
                server.wait_until_ready(timeout)
        except PortTaken:
            server.stop()
            log.close()
            if attempt == 2:
                raise
            continue
        except BaseException:
            server.stop()
            log.close()
            raise
        break
    try:
        yield server
    finally:
        server.stop()
        log.close()
