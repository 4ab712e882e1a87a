"""tests/harness.py: pooled worlds reuse their processes and still report failures and hangs."""
import os
import time

import pytest

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
