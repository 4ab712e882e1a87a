"""Re-launch a `megatron` subcommand as N worker processes, the way ms-swift users expect.

    NPROC_PER_NODE=4 megatron rlhf --rlhf_type grpo ...
    NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 NPROC_PER_NODE=8 megatron ...

When NPROC_PER_NODE (or `--nproc_per_node N`) asks for more than one process and we
are not already a worker, the command runs again as N workers with the same arguments:
on one node it starts them itself, on several through `torch.distributed.run`
(torchrun). Each worker sees what torchrun gives its workers: RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT.

On one node the workers of `megatron rlhf` are forks of the launcher, made after it
imported what they use (torch, Megatron, transformers, vLLM: once instead of once per
worker), where that is safe: a CPU-only build of torch and one OpenMP thread per worker
(`fork_problem`). Otherwise, a GPU build of torch above all, each worker is a new
interpreter (`python -u -m megatron_grpo.cli ...`), as torchrun starts them.
"""
from __future__ import annotations

import ast
import functools
import gc
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import dataclasses
from dataclasses import dataclass
from typing import Callable

from . import console


@dataclass(frozen=True)
class LaunchSpec:
    nproc_per_node: int
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


def _env_int(name: str, default: int, env) -> int:
    raw = env.get(name)
    if raw in (None, ""):
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} must be an integer") from None
    return value


def pop_nproc_flag(argv: list[str]) -> tuple[list[str], int | None]:
    """Remove `--nproc_per_node N` from argv (it is the launcher's, not the command's)."""
    out, nproc = [], None
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--nproc_per_node" and i + 1 < len(argv):
            nproc, i = argv[i + 1], i + 2
            continue
        if a.startswith("--nproc_per_node="):
            nproc, i = a.split("=", 1)[1], i + 1
            continue
        out.append(a)
        i += 1
    if nproc is not None:
        try:
            nproc = int(nproc)
        except ValueError:
            raise ValueError(f"--nproc_per_node {nproc!r} must be a positive integer") from None
    return out, nproc


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_spec(nproc_flag: int | None = None, env=None) -> LaunchSpec:
    """What the environment (and --nproc_per_node) ask for; checked, nothing started."""
    env = os.environ if env is None else env
    nproc = nproc_flag if nproc_flag is not None else _env_int("NPROC_PER_NODE", 1, env)
    nnodes = _env_int("NNODES", 1, env)
    node_rank = _env_int("NODE_RANK", 0, env)
    # One node and no MASTER_PORT: a free port, so two runs on one machine never clash.
    # Several nodes must agree on it: torchrun's 29500 unless MASTER_PORT says otherwise.
    port = _env_int("MASTER_PORT", 29500 if nnodes > 1 else 0, env) or _free_port()
    if nproc < 1:
        raise ValueError(f"NPROC_PER_NODE / --nproc_per_node {nproc} must be >= 1")
    if nnodes < 1:
        raise ValueError(f"NNODES {nnodes} must be >= 1")
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"NODE_RANK {node_rank} must be in [0, NNODES={nnodes})")
    if not 0 < port < 65536:
        raise ValueError(f"MASTER_PORT {port} is not a valid port (1-65535)")
    return LaunchSpec(nproc, nnodes, node_rank, env.get("MASTER_ADDR", "127.0.0.1"), port)


def fresh_port(spec: LaunchSpec, env=None) -> LaunchSpec:
    """`spec` with another free port when the launcher picked it (one node, no MASTER_PORT):
    the later the pick before the workers bind it, the less likely another process took
    it meanwhile."""
    env = os.environ if env is None else env
    if spec.nnodes > 1 or env.get("MASTER_PORT"):
        return spec
    return dataclasses.replace(spec, master_port=_free_port())


def in_torchrun(env=None) -> bool:
    env = os.environ if env is None else env
    return "LOCAL_RANK" in env and "WORLD_SIZE" in env


def current_world_size(spec: LaunchSpec, env=None) -> int:
    env = os.environ if env is None else env
    if in_torchrun(env):
        return int(env["WORLD_SIZE"])
    return spec.world_size


def relaunch(subcommand: str, argv: list[str], spec: LaunchSpec,
             preload: Callable[[], None] | None = None,
             fork_main: Callable[[list[str]], int] | None = None,
             plan: dict | None = None) -> int:
    """Run `megatron <subcommand> argv` as the `spec.world_size` workers of `spec`; returns
    the exit code (0, or the first failing worker's).

    One node: the workers are started here, with the environment torchrun gives its
    workers (`worker_env`). torchrun's agent would first import torch (1.2-1.7 CPU
    seconds, 2-6 s of wall time measured on the critical path before any worker starts,
    docs/benchmarks.md) for rendezvous and restarts that a single node does not use.
    Given `preload` and `fork_main`, and where `fork_problem()` finds none, they are forks
    of this process made after `preload()` imported what each would import
    (`fork_workers`); otherwise new interpreters. Several nodes: torchrun, whose
    rendezvous joins them."""
    if spec.nnodes > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run",
               f"--nproc_per_node={spec.nproc_per_node}", f"--nnodes={spec.nnodes}",
               f"--node_rank={spec.node_rank}", f"--master_addr={spec.master_addr}",
               f"--master_port={spec.master_port}",
               "-m", "megatron_grpo.cli", subcommand, *argv]
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        # Supervised as one worker: a SIGTERM or Ctrl-C here reaches torchrun as SIGTERM,
        # which stops its workers (within 30 s, then SIGKILL); subprocess.call would kill
        # torchrun alone 0.25 s after a Ctrl-C and leave its workers running.
        return run_workers([(cmd, env)], grace_s=30.0)
    own = not os.environ.get(STATUS_ENV)           # a folder given by the caller stays
    status_dir = tempfile.mkdtemp(prefix="megatron-status-") if own else os.environ[STATUS_ENV]
    os.environ[STATUS_ENV] = status_dir           # the workers' phases (memory/measure.py)
    if plan is not None:
        with open(os.path.join(status_dir, "plan.json"), "w") as f:
            json.dump(plan, f)
    report = functools.partial(report_failure, status_dir)
    if console.log_path() is not None:      # quiet: the workers' errors shown from here
        os.environ[console.SUPERVISED_ENV] = "1"
    try:
        if preload is not None and fork_main is not None and fork_problem() is None:
            print(f"[megatron] starting {spec.nproc_per_node} workers {FORK_NOTE} (their "
                  "modules imported once, here)", flush=True)
            return fork_workers(spec, preload, lambda: fork_main([subcommand, *argv]),
                                on_failure=report)
        # -u: unbuffered output, as torchrun starts its workers (a log piped to `tee` stays
        # live).
        cmd = [sys.executable, "-u", "-m", "megatron_grpo.cli", subcommand, *argv]
        return run_workers([(cmd, worker_env(spec, r)) for r in range(spec.nproc_per_node)],
                           on_failure=report)
    finally:
        if own:
            shutil.rmtree(status_dir, ignore_errors=True)


STATUS_ENV = "MGRPO_STATUS_DIR"     # memory/measure.py writes rank-N.json there


def _gib(nbytes) -> str:
    return "n/a" if nbytes is None else f"{nbytes / (1 << 30):.2f} GiB"


def describe_failure(status_dir: str, rank: int, code: int) -> str | None:
    """What a worker that ended with `code` (-N: killed by signal N) was doing, from the
    files it and the launcher left in `status_dir`; None for an ordinary error exit (the
    worker printed its own traceback)."""
    if code >= 0:
        return None
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    status, plan = {}, {}
    for path, into in ((os.path.join(status_dir, f"rank-{rank}.json"), status),
                       (os.path.join(status_dir, "plan.json"), plan)):
        try:
            with open(path) as f:
                into.update(json.load(f))
        except (OSError, ValueError):
            pass
    why = " (the kernel's out-of-memory killer sends it)" if -code == signal.SIGKILL else ""
    lines = [f"[megatron] rank {rank} was killed by {name}{why}"
             + (f" in its {status['phase']} phase at step {status.get('step', 0) + 1}"
                if status.get("phase") else " before its first phase")]
    if status:
        lines.append(f"  its memory then: {_gib(status.get('rss'))} resident at the phase's "
                     f"start; the last measured phase ({status.get('last_phase') or 'none'}) "
                     f"peaked at {_gib(status.get('last_peak'))}")
    if plan:
        lines.append(f"  the memory plan: {_gib(plan.get('peak'))} per rank at its "
                     f"{plan.get('peak_phase')} peak, {_gib(plan.get('machine_peak'))} per "
                     f"machine of {_gib(plan.get('available'))} available")
        if plan.get("options"):
            lines.append("  options that lower it: " + "; ".join(
                f"{what} (-{_gib(saved)} per rank)" for what, saved in plan["options"]))
    if plan.get("output_dir"):
        lines.append(f"  a rerun of the same command resumes from the newest complete "
                     f"checkpoint in {plan['output_dir']} (if any)")
    return "\n".join(lines)


def report_failure(status_dir: str, rank: int, code: int) -> None:
    """The first failing worker, on the console: what it was doing when a signal killed
    it; for an error exit (its traceback is on the console already) where its log is."""
    text = describe_failure(status_dir, rank, code)
    folder = os.environ.get(console.LOG_DIR_ENV)
    if text is None and folder:
        text = f"[megatron] rank {rank} failed (exit code {code})"
        try:
            with open(console.error_file(rank)) as f:
                text += ":\n" + f.read().rstrip("\n")
        except OSError:
            pass
        text += f"\n  its output: {os.path.join(folder, f'rank-{rank}.log')}"
    elif text and folder:
        text += f"\n  its output: {os.path.join(folder, f'rank-{rank}.log')}"
    if text:
        console.warn(text)


FORK_NOTE = "as forks of this process"     # what the launcher prints when it forks


def torch_accelerator_builds() -> list[str] | None:
    """The accelerators the installed torch is built for ("cuda", "hip", "xpu"; [] for a
    CPU-only build), read from torch/version.py without importing torch; None when that
    file cannot be read as expected."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "version.py")
    try:
        with open(path) as f:
            tree = ast.parse(f.read())
        values = {}
        for node in tree.body:
            target = node.target if isinstance(node, ast.AnnAssign) else \
                node.targets[0] if isinstance(node, ast.Assign) else None
            if isinstance(target, ast.Name) and node.value is not None:
                values[target.id] = ast.literal_eval(node.value)
    except (OSError, SyntaxError, ValueError):
        return None
    names = ("cuda", "hip", "xpu")
    if not all(name in values for name in names):
        return None
    return [name for name in names if values[name] is not None]


def fork_problem(env=None) -> str | None:
    """Why this node's workers may not be forks of the launcher (None: they may).

    A fork carries over what the launcher imported, and nothing else: no thread, and no
    device state. So only where torch is a CPU-only build (no CUDA, ROCm or XPU driver a
    forked child could inherit half-initialised; a GPU build starts new interpreters, as
    torchrun does) and each worker runs one OpenMP thread (GNU OpenMP's thread pool does
    not survive a fork; with one thread there is none)."""
    env = os.environ if env is None else env
    if not hasattr(os, "fork"):
        return "this platform has no fork()"
    threads = env.get("OMP_NUM_THREADS", "1")
    if threads != "1":
        return f"OMP_NUM_THREADS={threads}: an OpenMP thread pool does not survive a fork"
    builds = torch_accelerator_builds()
    if builds is None:
        return "torch/version.py could not be read"
    if builds:
        return f"torch is built for {', '.join(builds)}"
    return None


def fork_workers(spec: LaunchSpec, preload: Callable[[], None], main: Callable[[], int],
                 poll_s: float = 0.1, grace_s: float = 10.0, on_failure=None) -> int:
    """Start this node's workers as forks of this process, after `preload()` imported the
    modules every worker needs; each fork runs `main()` with its `worker_env` and exits
    with its code. Supervised as `run_workers` does.

    Each worker of a `megatron rlhf` run imports torch, Megatron, transformers and vLLM:
    ~8 CPU s each before its first step (tools/profile_startup.py), paid once here
    instead of once per worker, and their pages are shared until written. The objects
    made so far are frozen (`gc.freeze`): a worker's collector never walks them (nor
    copies their pages by touching them)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")    # what worker_env gives, before torch loads
    enabled = gc.isenabled()
    gc.disable()                # collections during the imports free nothing
    try:
        preload()
    finally:
        if enabled:
            gc.enable()
    gc.freeze()
    procs: list = []
    try:
        for local_rank in range(spec.nproc_per_node):
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _forked_worker(main, worker_env(spec, local_rank))     # never returns
            procs.append(_Forked(pid))
    except BaseException:
        _stop(procs, grace_s)
        raise
    return _supervise(procs, poll_s, grace_s, on_failure)


def _forked_worker(main: Callable[[], int], env: dict) -> None:
    """The body of a forked worker: torchrun's environment, unbuffered output (as `python
    -u`), `main()`, then os._exit with its code: the launcher's own stack below the fork
    (and its atexit handlers) must not run in the worker."""
    code = 1
    try:
        os.environ.clear()
        os.environ.update(env)
        for stream in (sys.stdout, sys.stderr):
            if hasattr(stream, "reconfigure"):
                stream.reconfigure(write_through=True)
        code = main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if not isinstance(e.code, (int, type(None))):
            console.warn(str(e.code))
    except BaseException:
        console.report_exception(*sys.exc_info())
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code if isinstance(code, int) and 0 <= code < 256 else 1)


class _Forked:
    """A forked worker, with the part of subprocess.Popen's interface `_supervise` uses."""

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)   # -N: killed by N
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"worker pid {self.pid}", timeout)
            time.sleep(0.02)
        return self.returncode

    def _signal(self, signum: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)


def worker_env(spec: LaunchSpec, local_rank: int, env=None) -> dict:
    """The environment of local worker `local_rank` on a single node: the variables
    torchrun sets for its workers (torch.distributed's env:// initialisation reads RANK,
    WORLD_SIZE, MASTER_ADDR and MASTER_PORT; the rest as torchrun has them), one OpenMP
    thread per worker unless OMP_NUM_THREADS says otherwise (as torchrun)."""
    env = dict(os.environ if env is None else env)
    n = spec.nproc_per_node
    env.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(n),
               LOCAL_WORLD_SIZE=str(n), GROUP_RANK="0", GROUP_WORLD_SIZE="1",
               ROLE_RANK=str(local_rank), ROLE_WORLD_SIZE=str(n), ROLE_NAME="default",
               MASTER_ADDR=spec.master_addr, MASTER_PORT=str(spec.master_port))
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run_workers(workers: list, poll_s: float = 0.1, grace_s: float = 10.0,
                on_failure=None) -> int:
    """Start `workers` ((argv, env) each) and wait for them: 0 when all exit with 0. When
    one fails, the others (waiting in a collective for it, as likely as not) are stopped
    (SIGTERM, SIGKILL after grace_s) and its exit code is returned. A SIGTERM to this
    process stops them as well; Ctrl-C reaches them through the terminal's process group."""
    fds = console.inherited_fds()      # a quiet launcher's console, for rank 0's progress
    return _supervise([subprocess.Popen(argv, env=env, pass_fds=fds) for argv, env in workers],
                      poll_s, grace_s, on_failure)


def _stop(procs: list, grace_s: float) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _supervise(procs: list, poll_s: float, grace_s: float, on_failure=None) -> int:
    """Wait for started workers (Popen or _Forked): see run_workers. `on_failure(local
    rank, code)` is told of the first worker that fails."""
    previous = signal.signal(signal.SIGTERM,
                             lambda *_: (_stop(procs, grace_s), sys.exit(128 + signal.SIGTERM)))
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                # A rank killed by a signal first: the others then fail on its socket.
                first = min(failed, key=lambda i: (codes[i] > 0, i))
                if on_failure is not None:
                    on_failure(first, codes[first])
                _stop(procs, grace_s)
                code = codes[first]
                return code if code > 0 else 128 - code   # -N: killed by signal N
            if all(c == 0 for c in codes):
                return 0
            time.sleep(poll_s)
    except KeyboardInterrupt:
        _stop(procs, grace_s)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
