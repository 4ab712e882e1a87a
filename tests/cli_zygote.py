"""`megatron` commands for the tests, started as forks of one process that imported the
CLI's heavy modules once (a "zygote"), instead of new interpreters.

    cmd = cli_zygote.command("rlhf", *argv)   # python -S THIS_FILE megatron_grpo.cli rlhf ...
    subprocess.run(cmd, env=cli_zygote.env(...), ...)

A new `python -m megatron_grpo.cli` imports torch, Megatron, transformers and vLLM before
it forks its workers: ~7 CPU s per launch here, ~40 launches in the suite, on 2 cores that
were busy anyway. The command above runs a small client
of this file instead (standard library only, no site packages: ~30 ms). It hands its argv,
environment, working directory and its stdin/stdout/stderr file descriptors to the zygote
over a Unix socket; the zygote forks, and the fork runs the module as `python -m` does
(runpy) with exactly those, in a session of its own. The client waits and exits as the
fork did: the same code, or the same signal. A SIGTERM, SIGINT or SIGHUP to the client is
passed on to the fork's process group; if the client dies (a test's timeout kills it) the
zygote kills that group. So a test sees the command as a real process: its exit code, its
output on its own pipes, files written, signals obeyed.

What differs from a new interpreter: the modules were imported before the command parsed
its options, with the zygote's environment. So the zygote runs a command only when the
variables read at import time (torch's threads, HF, vLLM, Python's own: `_IMPORT_TIME`)
are the ones it was started with, or as its own imports left them
(`import_time_differences`); otherwise the client runs the real `python -m MODULE` in its
place (exec). `module=` runs another module the same way (tests.harness.rollout_server:
`megatron_grpo.rollout.server`). Tests of the start-up itself (import
order, `-X importtime`, several nodes, OpenMP threads > 1, a SIGKILL of the whole
group) call the real command directly.

One zygote per test process (each pytest-xdist worker), started on first use and stopped
with that process. MGRPO_TEST_CLI_NEW_INTERPRETERS=1 runs every command in a new
interpreter instead (`python -m MODULE ARGV`), to rule the zygote out when a test fails.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import struct
import sys

SOCKET_VAR = "MGRPO_TEST_CLI_ZYGOTE"
NEW_INTERPRETERS_VAR = "MGRPO_TEST_CLI_NEW_INTERPRETERS"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Environment variables that the preloaded modules may have read when they were imported:
# a command whose value of one of these differs from the zygote's runs in a new interpreter.
_IMPORT_TIME = ("OMP_", "MKL_", "KMP_", "GOMP_", "TORCH", "PYTORCH_", "CUDA", "NCCL_",
                "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TOKENIZERS_", "VLLM_", "TRITON_",
                "PYTHON", "LD_", "MALLOC_", "WANDB_", "MEGATRON_", "NVTE_")
# ... except these, which are read when used (vLLM's envs module reads its variables on
# access), and PYTHONPATH when the zygote's sys.path has its entries already.
_READ_WHEN_USED = ("VLLM_ENABLE_V1_MULTIPROCESSING",)
_HEADER = struct.Struct("!I")


# ---------------------------------------------------------------- the tests' side

_zygote = None     # (subprocess.Popen, socket path) of this process's zygote


def command(*argv: str, module: str = "megatron_grpo.cli") -> list[str]:
    """The command line that runs `python -m MODULE ARGV` (by default `megatron ARGV`)
    through this process's zygote (started here on first use); pass `env()` as its
    environment."""
    if os.environ.get(NEW_INTERPRETERS_VAR) == "1":
        return [sys.executable, "-m", module, *argv]
    _start()
    return [sys.executable, "-S", os.path.abspath(__file__), module, *argv]


def env(base: dict | None = None, **extra: str) -> dict:
    """`base` (default os.environ) plus `extra`, with the zygote's socket."""
    env = dict(os.environ if base is None else base, **extra)
    if os.environ.get(NEW_INTERPRETERS_VAR) != "1":
        _start()
        env[SOCKET_VAR] = _zygote[1]
    return env


def _start(timeout: float = 300) -> None:
    global _zygote
    if _zygote is not None and _zygote[0].poll() is None:
        return
    import atexit
    import subprocess
    import tempfile
    import time

    path = os.path.join(tempfile.mkdtemp(prefix="mgrpo-zygote-"), "socket")
    log = open(path + ".log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "tests.cli_zygote", "serve", path], cwd=ROOT,
                            stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                            start_new_session=True)
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            with open(path + ".log") as f:
                raise RuntimeError(f"the CLI zygote did not start (code {proc.poll()}):\n"
                                   + f.read()[-4000:])
        time.sleep(0.05)
    _zygote = (proc, path)
    atexit.register(_stop, proc, os.path.dirname(path))


def _stop(proc, folder: str) -> None:
    import shutil
    import subprocess

    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    shutil.rmtree(folder, ignore_errors=True)


# ---------------------------------------------------------------- the client

def _client(module: str, argv: list[str]) -> None:
    path = os.environ.get(SOCKET_VAR)
    if not path:
        _exec_real(module, argv)
    env = {k: v for k, v in os.environ.items() if k != SOCKET_VAR}
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError:
        _exec_real(module, argv)
    body = json.dumps({"module": module, "argv": argv, "env": env, "cwd": os.getcwd()}).encode()
    socket.send_fds(sock, [_HEADER.pack(len(body))], [0, 1, 2])
    sock.sendall(body)
    reader = sock.makefile("r")
    reply = reader.readline().split()
    if reply[:1] != ["pid"]:
        sock.close()
        _exec_real(module, argv)       # "exec": an import-time variable differs

    def forward(signum, _frame):
        try:
            sock.sendall(f"sig {signum}\n".encode())
        except OSError:
            pass

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, forward)
    line = reader.readline().split()
    code = int(line[1]) if line[:1] == ["exit"] else 1
    if code < 0:               # the command died of a signal: so does the client
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


def _exec_real(module: str, argv: list[str]) -> None:
    os.environ.pop(SOCKET_VAR, None)
    os.execv(sys.executable, [sys.executable, "-m", module, *argv])


# ---------------------------------------------------------------- the zygote

def _serve(path: str) -> None:
    import gc
    import selectors

    base_env = dict(os.environ)     # before the imports, some of which set variables
    import tests.rank_preload  # noqa: F401  (torch, Megatron, transformers, vLLM's LLM)
    from megatron_grpo import launch, trainer  # noqa: F401  (what the command imports next)

    # What the imports put in the environment (vLLM sets some of its and torch's
    # variables when imported): a command's environment gets them as a new interpreter's
    # imports would set them.
    set_by_imports = {k: v for k, v in os.environ.items() if base_env.get(k) != v}
    gc.collect()
    gc.freeze()               # the preloaded heap stays shared with the forks
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(16)
    os.rename(path + ".tmp", path)        # the socket appears when it accepts
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    children: dict[int, socket.socket] = {}     # fork pid -> its client's connection
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))

    while not stopping and os.getppid() == parent:
        for key, _ in sel.select(timeout=0.05):
            if key.fileobj is listener:
                conn, _ = listener.accept()
                pid = _start_command(conn, base_env, set_by_imports,
                                     [sel, listener, *children.values()])
                if pid is None:
                    conn.close()
                else:
                    children[pid] = conn
                    sel.register(conn, selectors.EVENT_READ, pid)
                continue
            data = key.fileobj.recv(256)
            if not data:               # the client died (killed): so does its command
                _kill_group(key.data, signal.SIGKILL)
                sel.unregister(key.fileobj)
            for line in data.decode().splitlines():
                if line.startswith("sig "):
                    _kill_group(key.data, int(line.split()[1]))
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is None:
                continue
            try:
                conn.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
            except OSError:
                pass
            with contextlib.suppress(KeyError):    # unregistered if its client died
                sel.unregister(conn)
            conn.close()
    for pid in children:
        _kill_group(pid, signal.SIGKILL)
    os.unlink(path)
    os._exit(0)               # no teardown of the preloaded modules


def _kill_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except OSError:
        pass


def import_time_differences(env: dict, base_env: dict, set_by_imports: dict,
                            path: list[str]) -> list[str]:
    """The import-time variables whose value in a command's `env` is neither the zygote's
    before its imports (`base_env`) nor as its imports left it (`set_by_imports`: a test
    process that imported vLLM has opencv's LD_LIBRARY_PATH, as the zygote after its
    imports). PYTHONPATH counts only with an entry missing from the zygote's sys.path
    (`path`)."""
    keys = {k for k in set(env) | set(base_env)
            if k.startswith(_IMPORT_TIME) and k not in _READ_WHEN_USED}
    if all(os.path.abspath(p) in path for p in env.get("PYTHONPATH", "").split(os.pathsep) if p):
        keys.discard("PYTHONPATH")
    return sorted(k for k in keys
                  if env.get(k) not in (base_env.get(k), set_by_imports.get(k, base_env.get(k))))


def _start_command(conn, base_env, set_by_imports, inherited) -> int | None:
    """Read one request from `conn` and fork its command; the fork's pid, or None after
    replying "exec" (an import-time variable differs: the client runs it itself)."""
    header, fds, _, _ = socket.recv_fds(conn, _HEADER.size, 3)
    (size,) = _HEADER.unpack(header)
    body = b""
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            break
        body += chunk
    request = json.loads(body)
    env = request["env"]
    request["env"] = dict(env, **set_by_imports)
    differ = import_time_differences(env, base_env, set_by_imports, sys.path)
    if differ:
        print(f"new interpreter for {request['module']} {request['argv'][:1]}: "
              f"{', '.join(differ)} differ", flush=True)
        for fd in fds:
            os.close(fd)
        conn.sendall(b"exec\n")
        return None
    pid = os.fork()
    if pid == 0:
        _become_command(request, fds, [conn, *inherited])
    for fd in fds:
        os.close(fd)
    conn.sendall(f"pid {pid}\n".encode())
    return pid


def _become_command(request, fds, inherited) -> None:
    """In the fork: the command, as `python -m MODULE ARGV` runs it (runpy, as `-m`
    does: the module is `__main__`, `sys.argv[0]` its file). Its exit (SystemExit, or an
    exception with its traceback) unwinds to the interpreter's exit, with atexit handlers,
    as a new interpreter's would."""
    import gc

    os.setsid()
    for obj in inherited:
        obj.close()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = [request["module"], *request["argv"]]
    import runpy

    sys.modules.pop(request["module"], None)     # as in a new interpreter: only as __main__
    # The zygote froze its heap for its forks' sake; the command collects as a new
    # interpreter's does.
    gc.unfreeze()
    try:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    except SystemExit as e:
        _exit_as_interpreter(e.code)
    _exit_as_interpreter(0)


def _exit_as_interpreter(code) -> None:
    """The fork's exit as a new interpreter's with `sys.exit(code)`, less its last step.
    Python's exit waits for the non-daemon threads, runs the atexit handlers, flushes
    stdout/stderr (exit code 120 when that fails), and only then tears down every module
    and object. In a fork that teardown writes to each page of the heap it shares with the
    zygote, which the kernel then copies: ~2.5 CPU s per command here, for a result no
    command can observe. An exception other than SystemExit still takes the whole exit
    (traceback, KeyboardInterrupt's SIGINT)."""
    import atexit
    import threading

    if code is None:
        code = 0
    elif not isinstance(code, int):       # sys.exit("message"): printed, exit code 1
        print(code, file=sys.stderr)
        code = 1
    threading._shutdown()                 # what Py_FinalizeEx does first (private: tests only)
    atexit._run_exitfuncs()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except Exception:                     # noqa: BLE001 - as the interpreter: exit code 120
        code = 120
    os._exit(code & 0xFF)


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        _serve(sys.argv[2])
    else:
        _client(sys.argv[1], sys.argv[2:])
