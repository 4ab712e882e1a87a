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
