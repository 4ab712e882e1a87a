"""tests/cli_zygote.py: a command run through the tests' CLI zygote behaves as the same
command in a new interpreter (exit code, output, input, working directory, environment,
signals both ways), runs in a fork of the zygote (not a new interpreter) unless an
import-time variable differs, and dies with its client.

The probe is this file run as a module (`python -m tests.test_cli_zygote ...`, below)."""
import os
import signal
import subprocess
import sys
import time

import pytest

from tests import cli_zygote
from tests.harness import process_running

# The zygote's start (torch, Megatron, transformers, vLLM imported) is ~9 s of the first test.
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.environ.get(cli_zygote.NEW_INTERPRETERS_VAR) == "1",
                                 reason="the CLI zygote is off "
                                        "(MGRPO_TEST_CLI_NEW_INTERPRETERS=1)")]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBE = "tests.test_cli_zygote"


def _probe(*argv, **env):
    return cli_zygote.command(*argv, module=PROBE), cli_zygote.env(**env)


def test_a_command_sees_its_argv_cwd_environment_and_stdin_and_exits_with_its_code(tmp_path):
    cmd, env = _probe("report", "--flag", "a b", PROBE_VAR="x y")
    p = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = p.communicate("some input", timeout=60)
    assert p.returncode == 3, err
    lines = dict(line.split("=", 1) for line in out.splitlines())
    assert lines["argv"] == repr(["report", "--flag", "a b"])
    assert lines["argv0"].endswith(os.path.join("tests", "test_cli_zygote.py"))
    assert lines["name"] == "__main__"
    assert lines["cwd"] == str(tmp_path)
    assert lines["var"] == "x y" and lines["socket_var"] == "None"
    assert lines["stdin"] == "some input"
    assert err == "to stderr\n"
    # A fork of the zygote (the heavy modules already there), not the client's exec.
    assert int(lines["pid"]) != p.pid
    assert lines["preloaded"] == "True"


def test_an_import_time_variable_that_differs_runs_a_new_interpreter():
    cmd, env = _probe("report")
    env["TOKENIZERS_PARALLELISM"] = "false" if env.get("TOKENIZERS_PARALLELISM") != "false" \
        else "true"
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
                       input="")
    assert r.returncode == 3, r.stderr
    lines = dict(line.split("=", 1) for line in r.stdout.splitlines())
    assert lines["preloaded"] == "False"       # nothing imported before the command
    assert lines["socket_var"] == "None"


def test_which_variables_send_a_command_to_a_new_interpreter():
    base = {"OMP_NUM_THREADS": "1", "HOME": "/root", "PYTHONPATH": "/repo"}
    after = {"LD_LIBRARY_PATH": "/cv2/lib64"}      # what the zygote's imports set
    path = ["/repo", "/lib"]

    def differ(**env):
        return cli_zygote.import_time_differences(dict(base, **env), base, after, path)

    assert differ() == []
    assert differ(HOME="/elsewhere", NPROC_PER_NODE="4", MASTER_PORT="1234") == []
    assert differ(OMP_NUM_THREADS="2") == ["OMP_NUM_THREADS"]
    assert differ(HF_HUB_OFFLINE="1", TORCHINDUCTOR_CACHE_DIR="/x") == \
        ["HF_HUB_OFFLINE", "TORCHINDUCTOR_CACHE_DIR"]
    assert differ(LD_LIBRARY_PATH="/cv2/lib64") == []      # as after the imports
    assert differ(LD_LIBRARY_PATH="/other") == ["LD_LIBRARY_PATH"]
    assert differ(PYTHONPATH="/lib" + os.pathsep + "/repo") == []
    assert differ(PYTHONPATH="/not/on/the/path") == ["PYTHONPATH"]
    assert differ(VLLM_ENABLE_V1_MULTIPROCESSING="0") == []      # read when used
    assert differ(VLLM_CPU_KVCACHE_SPACE="1") == ["VLLM_CPU_KVCACHE_SPACE"]


def test_a_command_killed_by_a_signal_kills_its_client_with_it():
    cmd, env = _probe("die")
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == -signal.SIGTERM, r.stderr


def test_sigterm_to_the_client_reaches_the_command(tmp_path):
    cmd, env = _probe("wait_for_sigterm", str(tmp_path / "got"))
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().startswith("ready")
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=60) == 0
    assert (tmp_path / "got").read_text() == str(int(signal.SIGTERM))


def test_a_killed_client_takes_the_command_and_its_children_with_it():
    cmd, env = _probe("sleep_with_child")
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
    pids = [int(x) for x in p.stdout.readline().split()]     # the command, its child
    assert all(process_running(pid) for pid in pids)
    p.kill()
    p.wait()
    deadline = time.monotonic() + 30
    while any(process_running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(process_running(pid) for pid in pids)


@pytest.mark.parametrize("argv", [("rlhf", "--no_such_flag", "1"), ("export", "--help")])
def test_megatron_through_the_zygote_equals_a_new_interpreter(argv, tmp_path):
    new = subprocess.run([sys.executable, "-m", "megatron_grpo.cli", *argv], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    forked = subprocess.run(cli_zygote.command(*argv), cwd=ROOT, env=cli_zygote.env(),
                            capture_output=True, text=True, timeout=120)
    assert (forked.returncode, forked.stdout, forked.stderr) == \
        (new.returncode, new.stdout, new.stderr)


@pytest.mark.parametrize("code", ["none", "7", "-1", "message"])
def test_the_exit_equals_a_new_interpreters(code):
    """The fork skips only the interpreter's teardown of its objects (cli_zygote
    _exit_as_interpreter): the non-daemon threads are waited for, the atexit handlers run,
    buffered output is flushed, and sys.exit's code (or message) comes out the same."""
    new = subprocess.run([sys.executable, "-m", PROBE, "exit", code], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    cmd, env = _probe("exit", code)
    forked = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert (forked.returncode, forked.stdout, forked.stderr) == \
        (new.returncode, new.stdout, new.stderr)
    assert new.stdout == "buffered\nthread done\natexit ran\n"


def _main(argv):
    """The probe: what a command run through the zygote sees."""
    if argv[0] == "report":
        print(f"argv={argv!r}")
        print(f"argv0={sys.argv[0]}")
        print(f"name={__name__}")
        print(f"cwd={os.getcwd()}")
        print(f"var={os.environ.get('PROBE_VAR')}")
        print(f"socket_var={os.environ.get(cli_zygote.SOCKET_VAR)}")
        print(f"stdin={sys.stdin.read()}")
        print(f"pid={os.getpid()}")
        print(f"preloaded={'megatron.core' in sys.modules}")
        print("to stderr", file=sys.stderr)
        sys.exit(3)
    if argv[0] == "exit":
        import atexit
        import threading

        atexit.register(print, "atexit ran")
        threading.Thread(target=lambda: (time.sleep(0.3), print("thread done"))).start()
        print("buffered")             # a pipe: still in the buffer at the exit
        sys.exit({"none": None, "message": "a message"}[argv[1]] if argv[1] in ("none", "message")
                 else int(argv[1]))
    if argv[0] == "die":
        os.kill(os.getpid(), signal.SIGTERM)
    if argv[0] == "wait_for_sigterm":
        def on_term(signum, _frame):
            with open(argv[1], "w") as f:
                f.write(str(signum))
            sys.exit(0)

        signal.signal(signal.SIGTERM, on_term)
        print("ready", flush=True)
        time.sleep(60)
        sys.exit(1)
    if argv[0] == "sleep_with_child":
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        print(os.getpid(), child.pid, flush=True)
        time.sleep(60)
        sys.exit(1)


if __name__ == "__main__":
    _main(sys.argv[1:])
