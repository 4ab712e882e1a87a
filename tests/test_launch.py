"""launch.py: what the torchrun re-launch takes from the environment."""
import socket

import pytest

from megatron_grpo.launch import launch_spec


def _assert_gone(pid: int, message: str) -> None:
    """The process `pid` has ended: gone, or a zombie nobody reaped."""
    from tests.harness import process_running

    assert not process_running(pid), message


def test_single_node_without_master_port_picks_a_free_port():
    # Hold 29500 (torchrun's default) so that a fixed default would clash.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        try:
            held.bind(("127.0.0.1", 29500))
        except OSError:
            pass                                  # taken already: the point stands
        spec = launch_spec(env={"NPROC_PER_NODE": "2"})
    assert spec.master_port != 29500 and 0 < spec.master_port < 65536
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", spec.master_port))   # it was free


def test_master_port_and_multi_node_default_are_kept():
    assert launch_spec(env={"MASTER_PORT": "31234"}).master_port == 31234
    assert launch_spec(env={"NNODES": "2", "NODE_RANK": "1"}).master_port == 29500


def test_bad_master_port_names_it():
    with pytest.raises(ValueError, match="MASTER_PORT 70000"):
        launch_spec(env={"MASTER_PORT": "70000"})


def test_finished_worker_exits_at_once_without_leaving_children(tmp_path):
    """cli._exit_worker (a torchrun worker after train() returned): output flushed, exit
    code 0, and a child process (as Megatron's save could leave one) does not outlive it."""
    import os
    import subprocess
    import sys
    import textwrap

    pid_file = tmp_path / "child.pid"
    code = textwrap.dedent(f"""
        import multiprocessing, sys, time
        from megatron_grpo import cli
        child = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(600,))
        child.start()
        open({str(pid_file)!r}, "w").write(str(child.pid))
        print("written", end="")
        sys.stderr.write("to stderr")
        cli._exit_worker()
        print("never")
    """)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout == "written" and "to stderr" in r.stderr, r
    child = int(pid_file.read_text())
    _assert_gone(child, "the child outlived the worker")


def test_single_node_workers_get_torchruns_environment():
    from megatron_grpo.launch import worker_env

    spec = launch_spec(env={"NPROC_PER_NODE": "2", "MASTER_PORT": "31234"})
    env = worker_env(spec, 1, env={"PATH": "/bin"})
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS", "PATH")} == \
        dict(RANK="1", LOCAL_RANK="1", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
             MASTER_ADDR="127.0.0.1", MASTER_PORT="31234", OMP_NUM_THREADS="1", PATH="/bin")
    assert worker_env(spec, 0, env={"OMP_NUM_THREADS": "4"})["OMP_NUM_THREADS"] == "4"


def test_a_failing_worker_stops_the_others_and_its_code_is_returned(tmp_path):
    """launch.run_workers (one node, no torchrun): worker 0 fails while worker 1 would wait
    forever (as in a collective): the code is 0's, and worker 1 does not outlive the call."""
    import os
    import sys

    from megatron_grpo.launch import run_workers

    pid_file = tmp_path / "sleeper.pid"
    sleeper = (f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); "
               "time.sleep(600)")
    failer = (f"import os, sys, time\nwhile not os.path.exists({str(pid_file)!r}): "
              "time.sleep(0.05)\nsys.exit(3)")
    env = dict(os.environ)
    assert run_workers([([sys.executable, "-c", failer], env),
                        ([sys.executable, "-c", sleeper], env)]) == 3
    sleeper_pid = int(pid_file.read_text())
    _assert_gone(sleeper_pid, "worker 1 outlived the run")
    ok = [sys.executable, "-c", "pass"]
    assert run_workers([(ok, env), (ok, env)]) == 0


def test_several_nodes_supervise_torchrun(monkeypatch):
    """NNODES > 1: torchrun runs as one supervised worker (a SIGTERM or Ctrl-C of the
    launcher stops it with SIGTERM, so that it stops its workers; run_workers' own test
    above shows the supervision), not as a bare subprocess.call."""
    from megatron_grpo import launch

    seen = []
    monkeypatch.setattr(launch, "run_workers", lambda workers, **kw: seen.append((workers, kw))
                        or 7)
    spec = launch_spec(env={"NPROC_PER_NODE": "2", "NNODES": "2", "NODE_RANK": "1",
                            "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29600"})
    assert launch.relaunch("rlhf", ["--model", "m"], spec) == 7
    [([(cmd, env)], kw)] = seen
    assert cmd[1:3] == ["-m", "torch.distributed.run"] and "--nnodes=2" in cmd
    assert "--node_rank=1" in cmd and cmd[-3:] == ["rlhf", "--model", "m"]
    assert kw == {"grace_s": 30.0} and env["OMP_NUM_THREADS"]


def test_torch_build_is_read_without_importing_torch():
    """launch.torch_accelerator_builds reads torch/version.py as text (the launcher must
    not pay torch's import to decide how to start its workers); the answer is what torch
    itself says once imported."""
    import json
    import os
    import subprocess
    import sys

    code = ("import json, sys\nfrom megatron_grpo import launch\n"
            "builds = launch.torch_accelerator_builds()\nbefore = 'torch' in sys.modules\n"
            "import torch\n"
            "real = [n for n in ('cuda', 'hip', 'xpu') if getattr(torch.version, n) is not None]\n"
            "print(json.dumps([builds, before, real]))")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    builds, imported_before, real = json.loads(r.stdout.strip().splitlines()[-1])
    assert not imported_before
    assert builds == real


def test_fork_problem_names_what_rules_a_fork_out(monkeypatch):
    from megatron_grpo import launch

    monkeypatch.setattr(launch, "torch_accelerator_builds", lambda: [])
    assert launch.fork_problem(env={}) is None
    assert launch.fork_problem(env={"OMP_NUM_THREADS": "1"}) is None
    assert "OMP_NUM_THREADS=4" in launch.fork_problem(env={"OMP_NUM_THREADS": "4"})
    monkeypatch.setattr(launch, "torch_accelerator_builds", lambda: ["cuda"])
    assert launch.fork_problem(env={}) == "torch is built for cuda"
    monkeypatch.setattr(launch, "torch_accelerator_builds", lambda: None)
    assert "could not be read" in launch.fork_problem(env={})


_FORKING_LAUNCHER = """
import json, os, sys, time
from megatron_grpo import launch

out = sys.argv[1]
mode = sys.argv[2]

def preload():
    with open(os.path.join(out, "preloads"), "a") as f:
        f.write(str(os.getpid()) + "\\n")
    import decimal  # the stand-in for torch, Megatron and vLLM
    decimal.PRELOADED_BY = os.getpid()

def main():
    import decimal
    rank = int(os.environ["RANK"])
    row = dict(rank=rank, preloaded_by=decimal.PRELOADED_BY, pid=os.getpid(),
               ppid=os.getppid(), launcher=launcher,
               env={k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE",
                    "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")})
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(row, f)
    if mode == "ok":
        print(f"rank {rank} says hello")      # unbuffered in the worker, as python -u
        return 0
    if mode == "fail":
        if rank == 0:
            while not os.path.exists(os.path.join(out, "rank1.json")):
                time.sleep(0.05)
            sys.exit(3)
        time.sleep(600)                        # as a rank blocked in a collective
    if mode == "raise":
        raise RuntimeError(f"rank {rank} broke")
    if mode == "message":
        sys.exit(f"rank {rank} gave up")

launcher = os.getpid()
spec = launch.launch_spec(env={"NPROC_PER_NODE": "2", "MASTER_PORT": "31234"})
code = launch.fork_workers(spec, preload, main)
print(f"launcher code {code}")
"""


def _fork_launch(tmp_path, mode):
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    return subprocess.run([sys.executable, "-c", _FORKING_LAUNCHER, str(tmp_path), mode],
                          cwd=root, capture_output=True, text=True, timeout=120,
                          env=dict(env, OMP_NUM_THREADS="1"))


def test_forked_workers_share_one_preload_and_get_torchruns_environment(tmp_path):
    """launch.fork_workers: the preload runs once, in the launcher; each worker is a fork of
    it (its modules already imported) with the environment torchrun gives its workers."""
    import json

    r = _fork_launch(tmp_path, "ok")
    assert r.returncode == 0 and "launcher code 0" in r.stdout, r
    launcher = [int(line) for line in (tmp_path / "preloads").read_text().split()]
    rows = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]
    assert len(launcher) == 1
    for rank, row in enumerate(rows):
        assert row["launcher"] == row["ppid"] == row["preloaded_by"] == launcher[0] != row["pid"]
        assert row["env"] == dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                                  LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                  MASTER_PORT="31234", OMP_NUM_THREADS="1")
        assert f"rank {rank} says hello" in r.stdout


def test_a_failing_forked_worker_stops_the_other_and_its_code_is_returned(tmp_path):
    import json

    r = _fork_launch(tmp_path, "fail")
    assert "launcher code 3" in r.stdout, r
    sleeper = json.loads((tmp_path / "rank1.json").read_text())["pid"]
    _assert_gone(sleeper, "worker 1 outlived the run")


@pytest.mark.parametrize("mode,says", [("raise", "RuntimeError: rank 0 broke"),
                                       ("message", "rank 0 gave up")])
def test_a_forked_worker_that_raises_exits_1_with_its_error(tmp_path, mode, says):
    """As an interpreter would: a traceback (or SystemExit's message) and exit code 1; the
    launcher's own code below the fork never runs in the worker."""
    r = _fork_launch(tmp_path, mode)
    assert "launcher code 1" in r.stdout and says in r.stderr, r
    assert r.stdout.count("launcher code") == 1, r.stdout
