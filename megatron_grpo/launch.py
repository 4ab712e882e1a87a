"""Re-launch a `megatron` subcommand under torchrun, the way ms-swift users expect.

    NPROC_PER_NODE=4 megatron rlhf --rlhf_type grpo ...
    NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 NPROC_PER_NODE=8 megatron ...

When NPROC_PER_NODE (or `--nproc_per_node N`) asks for more than one process and we
are not already a torchrun worker, the command re-executes itself through
`torch.distributed.run` with the same arguments. Each worker then sees RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
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
    """Run `megatron <subcommand> argv` under torchrun with `spec`; returns its exit code."""
    cmd = [sys.executable, "-m", "torch.distributed.run",
           f"--nproc_per_node={spec.nproc_per_node}", f"--nnodes={spec.nnodes}",
           f"--node_rank={spec.node_rank}", f"--master_addr={spec.master_addr}",
           f"--master_port={spec.master_port}",
           "-m", "megatron_grpo.cli", subcommand, *argv]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.call(cmd, env=env)
