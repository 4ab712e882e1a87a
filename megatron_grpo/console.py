"""What a run shows its user, and where everything else goes.

The console is the user's: the plan, one progress display, the warnings that matter and
the result. What the libraries of a run write besides (vLLM's and Megatron-Core's INFO
lines and fallback notices, gloo's and torch's C++ warnings, Python warnings, progress
bars of checkpoint loading) goes to one log file per process in OUTPUT_DIR/logs/:
`launcher.log` for the command that starts the workers, `rank-N.log` for each rank.

`quiet(path)` moves this process's file descriptors 1 and 2 onto the log file, so that
output of any kind and level, Python's or a C++ library's, lands there, and keeps
duplicates of the original descriptors as the console. Workers forked or started by the
launcher inherit the console's descriptors (their numbers in CONSOLE_ENV) and move their
own 1 and 2 onto their rank's log. `say` and `warn` write to the console and the log;
the package's loggers (`megatron_grpo.*`) reach the console at WARNING and above; an
uncaught exception is written to both. Without `quiet` (`--log_level info` or `debug`)
nothing moves and `say` is print.
"""
from __future__ import annotations

import logging
import os
import sys
import traceback
from typing import Optional, TextIO

CONSOLE_ENV = "MGRPO_CONSOLE_FDS"   # "OUT,ERR": the console's descriptors, inherited
LOG_DIR_ENV = "MGRPO_LOG_DIR"       # where a worker writes rank-N.log
LEVEL_ENV = "MGRPO_LOG_LEVEL"       # --log_level of a quiet launcher, for its workers
SUPERVISED_ENV = "MGRPO_SUPERVISED"  # set for the workers of a quiet launcher
LOG_LEVELS = ("debug", "info", "warning", "error")

_out: Optional[TextIO] = None       # the console while quiet (None: sys.stdout / sys.stderr)
_err: Optional[TextIO] = None
_log_path: Optional[str] = None


def out() -> TextIO:
    """The user's standard output."""
    return _out or sys.stdout


def err() -> TextIO:
    """The user's standard error."""
    return _err or sys.stderr


def log_path() -> Optional[str]:
    """This process's log file while quiet, else None."""
    return _log_path


def say(message: str) -> None:
    """A line for the user (and, while quiet, for the log)."""
    _both(out(), message)


def warn(message: str) -> None:
    """A warning for the user, on standard error (and, while quiet, in the log)."""
    _both(err(), message)


def _both(stream: TextIO, message: str) -> None:
    print(message, file=stream, flush=True)
    if _out is not None:
        print(message, file=sys.stderr, flush=True)


def _inherited() -> Optional[tuple]:
    """The console's descriptors named in CONSOLE_ENV, when they are open in this process
    (a launcher's fork or child started with them); else None."""
    value = os.environ.get(CONSOLE_ENV, "")
    try:
        fds = tuple(int(v) for v in value.split(","))
        for fd in fds:
            os.fstat(fd)
    except (ValueError, OSError):
        return None
    return fds if len(fds) == 2 else None


def inherited_fds() -> tuple:
    """The console's descriptors for a child process to keep open (subprocess's pass_fds);
    () when this process is not quiet."""
    if _out is None:
        return ()
    return _inherited() or ()


def quiet(path: str, level: str = "warning", route_logs: bool = True) -> None:
    """Send this process's descriptors 1 and 2 to the log file `path` (appended to) and
    keep the console for `say`, `warn`, uncaught exceptions and (route_logs) the package's
    log records at `level` and above. Idempotent per path; a second path (a forked worker
    after its launcher) moves 1 and 2 again and keeps the same console."""
    global _out, _err, _log_path
    if _log_path == path:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    fds = _inherited()
    if fds is None:
        fds = (os.dup(1), os.dup(2))
    for fd in fds:
        os.set_inheritable(fd, True)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    if _out is None or _out.fileno() != fds[0]:
        _out = os.fdopen(fds[0], "w", buffering=1, closefd=False)
        _err = os.fdopen(fds[1], "w", buffering=1, closefd=False)
    _log_path = path
    os.environ[CONSOLE_ENV] = f"{fds[0]},{fds[1]}"
    os.environ[LOG_DIR_ENV] = os.path.dirname(os.path.abspath(path))
    os.environ[LEVEL_ENV] = level
    if route_logs:
        route_package_logs(level)
    sys.excepthook = _excepthook


def quiet_worker(rank: int) -> bool:
    """In a worker started by a quiet launcher (LOG_DIR_ENV set): its own log,
    LOG_DIR/rank-N.log. The package's warnings reach the console only once the worker
    calls `route_package_logs` (after its option checks, whose warnings the launcher has
    shown already). Returns whether it did."""
    folder = os.environ.get(LOG_DIR_ENV)
    if not folder:
        return False
    quiet(os.path.join(folder, f"rank-{rank}.log"), os.environ.get(LEVEL_ENV, "warning"),
          route_logs=False)
    return True


class _ConsoleHandler(logging.Handler):
    """The package's log records at WARNING and above, to the console and the log."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            warn(self.format(record))
        except Exception:   # noqa: BLE001  (logging's contract: never raise from emit)
            self.handleError(record)


def route_package_logs(level: Optional[str] = None) -> None:
    """The package's log records (`megatron_grpo.*`) at `level` (default: the quiet
    launcher's, else warning) and above to the console and the log."""
    level = (level or os.environ.get(LEVEL_ENV, "warning")).upper()
    logger = logging.getLogger("megatron_grpo")
    for handler in [h for h in logger.handlers if isinstance(h, _ConsoleHandler)]:
        logger.removeHandler(handler)
    handler = _ConsoleHandler(getattr(logging, level))
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)


def error_file(rank: int) -> Optional[str]:
    """Where a supervised worker leaves the traceback that ended it, for its launcher to
    show (launch.report_failure); None outside a quiet launcher's workers."""
    folder = os.environ.get(LOG_DIR_ENV)
    return os.path.join(folder, f"rank-{rank}.error") if folder else None


def report_exception(exc_type, exc, tb) -> None:
    """An exception that ends the process: its traceback in the log and on the console.
    A worker of a quiet launcher (SUPERVISED_ENV) leaves it in rank-N.error instead of
    the console: the launcher shows the first failing rank's, once, rather than every
    rank printing its own."""
    text = "".join(traceback.format_exception(exc_type, exc, tb))
    if _out is not None:
        sys.stderr.write(text)
        sys.stderr.flush()
    path = error_file(int(os.environ.get("RANK", "0")))
    if os.environ.get(SUPERVISED_ENV) and path:
        with open(path, "w") as f:
            f.write(text)
        return
    err().write(text)
    err().flush()


def _excepthook(exc_type, exc, tb) -> None:
    if issubclass(exc_type, KeyboardInterrupt):
        sys.__excepthook__(exc_type, exc, tb)
        return
    report_exception(exc_type, exc, tb)
