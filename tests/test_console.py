"""What a run prints: the plan, one progress display, the warnings that matter and the
result on the console; the libraries' output (vLLM, Megatron-Core, torch, gloo) in
OUTPUT_DIR/logs/ (megatron_grpo/console.py).

The unit test drives `console.quiet` in a child interpreter with output of every kind
(print, a C-level write to descriptor 2, a Python warning, a package warning, an
uncaught exception). The end-to-end test runs the quickstart's config (the real CLI, 2
processes, colocated vLLM) twice: on a terminal (a pseudo-terminal with a size, as a
user's) and piped (as in a job's log), and counts the lines."""
import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
import textwrap

import pytest

from tests import cli_zygote
from tests.harness import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(ROOT, "configs", "quickstart_cpu.yaml")
# What the libraries print that must not reach the console.
CHATTER = ("INFO", "UserWarning", "FutureWarning", "prefix cache", "NUMA binding",
           "LD_PRELOAD", "Loading safetensors")


def test_quiet_keeps_the_console_for_the_user_and_logs_the_rest(tmp_path):
    log = tmp_path / "logs" / "rank-0.log"
    script = textwrap.dedent(f"""
        import logging, os, warnings
        from megatron_grpo import console
        print("before quiet")
        console.quiet({str(log)!r})
        print("library chatter")
        os.write(2, b"C-level warning\\n")
        warnings.warn("a library's UserWarning")
        logging.getLogger("megatron_grpo.config").info("an info record")
        logging.getLogger("megatron_grpo.config").warning("a warning that matters")
        console.say("the plan")
        raise RuntimeError("the run failed")
        """)
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 1
    assert r.stdout.splitlines() == ["before quiet", "the plan"]
    assert r.stderr.splitlines()[0] == "a warning that matters"
    assert "RuntimeError: the run failed" in r.stderr and "Traceback" in r.stderr
    for hidden in ("library chatter", "C-level warning", "UserWarning", "an info record"):
        assert hidden not in r.stdout + r.stderr
    text = log.read_text()
    for part in ("library chatter", "C-level warning", "a library's UserWarning",
                 "a warning that matters", "the plan", "RuntimeError: the run failed"):
        assert part in text, part


def _on_a_terminal(cmd, env, timeout=300):
    """Run cmd with its standard output and error on a pseudo-terminal of 120 x 40; its
    exit code and everything it wrote there."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=slave, stderr=slave,
                            stdin=subprocess.DEVNULL)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 1 << 16)
        except OSError:         # EIO: every writer has closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    return proc.wait(timeout), b"".join(chunks).decode(errors="replace")


@pytest.mark.vllm
@pytest.mark.slow
def test_the_quickstart_prints_a_plan_a_progress_display_and_the_result(tiny_model, tmp_path):
    argv = ["rlhf", "--config", QUICKSTART, "--model", _tiny(tiny_model), "--train_iters", "6",
            "--bf16", "false"]
    env = dict(os.environ, NPROC_PER_NODE="2", OMP_NUM_THREADS="1")

    # A terminal: a new interpreter, as `megatron rlhf` is started by a user.
    out = str(tmp_path / "tty")
    code, text = _on_a_terminal([sys.executable, "-m", "megatron_grpo.cli", *argv,
                                 "--output_dir", out],
                                dict(env, MASTER_PORT=str(free_port())))
    assert code == 0, text[-3000:]
    lines = text.replace("\r\n", "\n").split("\n")
    assert len(lines) <= 40, text
    assert "GRPO:" in text and "6/6" in text                 # the bar, redrawn in place
    assert "[megatron] memory plan per rank" in text and "done: 6 steps" in text
    assert not [c for c in CHATTER if c in text], text
    logs = os.path.join(out, "logs")
    assert sorted(os.listdir(logs)) == ["launcher.log", "rank-0.log", "rank-1.log"]
    with open(os.path.join(logs, "launcher.log")) as f:     # Megatron-Core's import notes
        assert "Transformer Engine and Apex are not installed" in f.read()
    for rank in (0, 1):
        with open(os.path.join(logs, f"rank-{rank}.log")) as f:
            assert "Initializing a V1 LLM engine" in f.read()    # vLLM's start-up lines

    # Piped: one line per logging_steps (5) and the last step, no bar.
    out = str(tmp_path / "pipe")
    r = subprocess.run(cli_zygote.command(*argv, "--output_dir", out), cwd=ROOT,
                       env=cli_zygote.env(dict(env, MASTER_PORT=str(free_port()))),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    text = r.stdout + r.stderr
    assert len(text.splitlines()) <= 40, text
    steps = [line.split(":")[0] for line in r.stdout.splitlines() if line.startswith("step ")]
    assert steps == ["step 5/6", "step 6/6"], r.stdout
    assert "GRPO:" not in text and not [c for c in CHATTER if c in text], text


@pytest.mark.slow
def test_the_launcher_preloads_tcmalloc_where_found_and_says_so(tiny_model, tmp_path):
    """With MGRPO_PRELOAD=1, where tcmalloc is found (here MGRPO_TCMALLOC names a harmless
    stand-in, libm), the command re-executes itself with it in LD_PRELOAD and says so in
    its plan; without it (the default) nothing is preloaded. The dry run shows it without
    starting anything."""
    from megatron_grpo.preload import to_preload

    on = {"MGRPO_TCMALLOC": "libm.so.6", "MGRPO_PRELOAD": "1"}
    assert to_preload(on) == ["libm.so.6"]
    assert to_preload({"MGRPO_TCMALLOC": "libm.so.6"}) == []            # off by default
    assert to_preload(dict(on, LD_PRELOAD="/x/libm.so.6")) == []
    assert to_preload(on, cpu_build=False) == []
    argv = [sys.executable, "-m", "megatron_grpo.cli", "rlhf", "--dry_run", "true",
            "--config", QUICKSTART, "--model", _tiny(tiny_model), "--bf16", "false",
            "--output_dir", str(tmp_path / "run")]
    env = dict(os.environ, MGRPO_PRELOAD="1", MGRPO_TCMALLOC="libm.so.6", NPROC_PER_NODE="2")
    r = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "[megatron] preloaded libm.so.6 (MGRPO_PRELOAD=1, vLLM's advice for CPUs)" in r.stdout
    r = subprocess.run(argv, cwd=ROOT, env=dict(env, MGRPO_PRELOAD="0"), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "preloaded" not in r.stdout, r.stdout + r.stderr


def _tiny(tiny_model):
    """The quickstart's tiny Qwen2 (built once per session)."""
    return str(tiny_model(family="qwen2", num_layers=2, hidden_size=128, num_attention_heads=4,
                          num_key_value_heads=2, intermediate_size=256, vocab_size=999))


def test_a_failing_rank_is_shown_once_with_its_traceback(tmp_path):
    """Workers forked by a quiet launcher: the rank that raises leaves its traceback for
    the launcher, which shows it once with the rank and its log; the other rank (stopped
    by the launcher) adds nothing to the console."""
    script = textwrap.dedent(f"""
        import os, sys, time
        from megatron_grpo import console, launch
        console.quiet({str(tmp_path / "logs" / "launcher.log")!r})

        def main(argv):
            console.quiet_worker(int(os.environ["RANK"]))
            if os.environ["RANK"] == "1":
                raise RuntimeError("rank one broke")
            time.sleep(30)
            return 0

        spec = launch.LaunchSpec(2, 1, 0, "127.0.0.1", 29999)
        sys.exit(launch.relaunch("rlhf", [], spec, preload=lambda: None, fork_main=main))
        """)
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                       text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 1, r.stderr
    assert r.stdout == ""
    assert r.stderr.startswith("[megatron] rank 1 failed (exit code 1):\nTraceback"), r.stderr
    assert r.stderr.count("Traceback") == 1 and "RuntimeError: rank one broke" in r.stderr
    assert r.stderr.rstrip().endswith(f"its output: {tmp_path / 'logs' / 'rank-1.log'}")
    assert "RuntimeError: rank one broke" in (tmp_path / "logs" / "rank-1.log").read_text()


def test_log_level_info_and_debug_leave_the_output_where_it_is():
    """--log_level info / debug: nothing moves to the logs (the libraries print on the
    console as they do); debug also turns vLLM's logging to DEBUG."""
    import types

    from megatron_grpo import cli, console, launch

    saved = os.environ.pop("VLLM_LOGGING_LEVEL", None)
    spec = launch.LaunchSpec(2, 1, 0, "127.0.0.1", 29999)
    try:
        for level in ("info", "debug"):
            cfg = types.SimpleNamespace(logging=types.SimpleNamespace(log_level=level,
                                                                      output_dir="/nonexistent"))
            cli._route_output(cfg, spec)
            assert console.log_path() is None
        assert os.environ["VLLM_LOGGING_LEVEL"] == "DEBUG"
    finally:      # the variable reaches every later vLLM engine of this test process
        os.environ.pop("VLLM_LOGGING_LEVEL", None)
        if saved is not None:
            os.environ["VLLM_LOGGING_LEVEL"] = saved
