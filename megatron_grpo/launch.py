"""Re-launch a `megatron` subcommand as N worker processes, the way ms-swift users expect.

    NPROC_PER_NODE=4 megatron rlhf --rlhf_type grpo ...
    NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 NPROC_PER_NODE=8 megatron ...

When NPROC_PER_NODE (or `--nproc_per_node N`) asks for more than one process and we
are not already a worker, the command re-executes itself as N workers with the same
arguments: on one node it starts them itself, on several through
`torch.distributed.run` (torchrun). Each worker sees what torchrun gives its workers:
RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass


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


def in_torchrun(env=None) -> bool:
    env = os.environ if env is None else env
    return "LOCAL_RANK" in env and "WORLD_SIZE" in env


def current_world_size(spec: LaunchSpec, env=None) -> int:
    env = os.environ if env is None else env
    if in_torchrun(env):
        return int(env["WORLD_SIZE"])
    return spec.world_size


def relaunch(subcommand: str, argv: list[str], spec: LaunchSpec) -> int:
    """Run `megatron <subcommand> argv` as the `spec.world_size` workers of `spec`; returns
    the exit code (0, or the first failing worker's).

    One node: the workers are started here, with the environment torchrun gives its
    workers (`worker_env`). torchrun's agent would first import torch (1.2-1.7 CPU
    seconds, 2-6 s of wall time measured on the critical path before any worker starts,
    docs/benchmarks.md) for rendezvous and restarts that a single node does not use.
    Several nodes: torchrun, whose rendezvous joins them."""
    if spec.nnodes > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run",
               f"--nproc_per_node={spec.nproc_per_node}", f"--nnodes={spec.nnodes}",
               f"--node_rank={spec.node_rank}", f"--master_addr={spec.master_addr}",
               f"--master_port={spec.master_port}",
               "-m", "megatron_grpo.cli", subcommand, *argv]
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        return subprocess.call(cmd, env=env)
    # -u: unbuffered output, as torchrun starts its workers (a log piped to `tee` stays live).
    cmd = [sys.executable, "-u", "-m", "megatron_grpo.cli", subcommand, *argv]
    return run_workers([(cmd, worker_env(spec, r)) for r in range(spec.nproc_per_node)])


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


def run_workers(workers: list, poll_s: float = 0.1, grace_s: float = 10.0) -> int:
    """Start `workers` ((argv, env) each) and wait for them: 0 when all exit with 0. When
    one fails, the others (waiting in a collective for it, as likely as not) are stopped
    (SIGTERM, SIGKILL after grace_s) and its exit code is returned. A SIGTERM to this
    process stops them as well; Ctrl-C reaches them through the terminal's process group."""
    procs = [subprocess.Popen(argv, env=env) for argv, env in workers]

    def stop(*_):
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

    previous = signal.signal(signal.SIGTERM, lambda *_: (stop(), sys.exit(128 + signal.SIGTERM)))
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                stop()
                return failed[0] if failed[0] > 0 else 128 - failed[0]   # -N: killed by N
            if all(c == 0 for c in codes):
                return 0
            time.sleep(poll_s)
    except KeyboardInterrupt:
        stop()
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
