"""launch.py: what the torchrun re-launch takes from the environment."""
import socket

import pytest

from megatron_grpo.launch import launch_spec


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
    try:
        os.kill(child, 0)
        with open(f"/proc/{child}/stat") as f:      # gone, or a zombie nobody reaped
            assert f.read().split(")")[-1].split()[0] == "Z", "the child outlived the worker"
    except (ProcessLookupError, FileNotFoundError):
        pass


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
    try:
        os.kill(sleeper_pid, 0)
        with open(f"/proc/{sleeper_pid}/stat") as f:
            assert f.read().split(")")[-1].split()[0] == "Z", "worker 1 outlived the run"
    except (ProcessLookupError, FileNotFoundError):
        pass
    ok = [sys.executable, "-c", "pass"]
    assert run_workers([(ok, env), (ok, env)]) == 0
