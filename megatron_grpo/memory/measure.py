"""Measured memory: the peak of each phase of a step, on every rank.

    meter = MemoryMeter(status_dir)          # status_dir: where the launcher looks (or None)
    with meter.phase("generate"):
        ...
    metrics.update(meter.step_metrics())     # memory/generate, ..., memory/peak (GiB)

CPU: a phase's peak is the kernel's resident-set high-water mark (`VmHWM` of
/proc/PID/status) of this process and its descendants (a vLLM engine core or worker
process), reset at the phase's start by writing 5 to /proc/PID/clear_refs, so that a
peak inside the phase is seen however short it was and nothing samples in the
background. The sum over processes is what the kernel's out-of-memory killer compares
with the machine (it counts resident pages, shared or not).
GPU: the CUDA caching allocator's peak reserved bytes (`torch.cuda.max_memory_reserved`,
reset per phase), what an allocation fails against; the host's figure is logged beside it
as `memory/host_peak`.

Each rank also writes its current phase, step and last figures to
`status_dir/rank-N.json` (when the launcher gave it a folder, MGRPO_STATUS_DIR): a rank
the kernel kills leaves there what it was doing, which the launcher reports
(launch.py). Figures are GiB (2^30 bytes) in the metrics, bytes in the status files.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from typing import Optional

GIB = float(1 << 30)
STATUS_ENV = "MGRPO_STATUS_DIR"    # set by launch.py for its workers
# "PHASE:STEP:RANK": that rank kills itself (SIGKILL) as it enters that phase of that step,
# as the kernel's out-of-memory killer would (tests of the launcher's report and resume)
KILL_ENV = "MGRPO_KILL_AT"
# The phases of a step in the order they run (`memory/<phase>` keys of metrics.jsonl), and
# the run's final export of final_hf/ ("export", in the run's last line).
PHASES = ("generate", "logprobs", "train", "optimizer", "sync", "save", "export")


# ---------------------------------------------------------------- /proc readers
def _status_field(pid: int, field: str) -> int:
    """A `kB` field of /proc/PID/status in bytes; 0 when the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def descendants(pid: int) -> list[int]:
    """The processes below `pid` (children of every thread, recursively)."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids = [int(k) for k in f.read().split()]
        except OSError:
            continue
        for kid in kids:
            out.append(kid)
            out.extend(descendants(kid))
    return out


def rss(pid: int) -> int:
    return _status_field(pid, "VmRSS")


def peak_rss(pid: int) -> int:
    """The process's resident high-water mark since its start or its last reset."""
    return _status_field(pid, "VmHWM")


def reset_peak(pid: int) -> bool:
    """Set the process's high-water mark to its current resident size (Linux >= 4.0)."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def tree_rss(pid: int) -> int:
    """Resident size of `pid` and its descendants (what a phase's peak starts from)."""
    return sum(rss(p) for p in [pid, *descendants(pid)])


def trim_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's malloc_trim). Tensors
    below glibc's mmap threshold (up to 32 MiB) come from the heap, whose freed pages
    otherwise stay resident: without this, the optimizer's and the backward pass's
    temporaries of one phase stay part of the next phase's baseline."""
    global _LIBC
    if _LIBC is None:
        try:
            import ctypes

            _LIBC = ctypes.CDLL("libc.so.6")
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


_LIBC = None


# ---------------------------------------------------------------- what the machine has
def available_bytes() -> dict:
    """What this machine lets the run use: `mem_available` (MemAvailable of
    /proc/meminfo), `cgroup_limit` (memory.max of cgroup v2, or v1's limit; None when
    unlimited) and `cgroup_usage` (what the cgroup holds now), `cuda_free` (free bytes of
    the current GPU, None without one)."""
    out: dict = {"mem_available": None, "cgroup_limit": None, "cgroup_usage": None,
                 "cuda_free": None}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    out["mem_available"] = int(line.split()[1]) * 1024
    except OSError:
        pass
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                         ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                          "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit) as f:
                raw = f.read().strip()
        except OSError:
            continue
        if raw != "max" and int(raw) < (1 << 60):     # v1 says "unlimited" with a huge number
            out["cgroup_limit"] = int(raw)
            try:
                with open(usage) as f:
                    out["cgroup_usage"] = int(f.read().strip())
            except OSError:
                pass
        break
    try:
        import torch

        if torch.cuda.is_available():
            out["cuda_free"] = int(torch.cuda.mem_get_info()[0])
    except Exception:  # noqa: BLE001 - no usable GPU: the CPU figures stand
        pass
    return out


def host_budget(avail: dict) -> Optional[int]:
    """The host bytes a new run may take: MemAvailable, lowered to what the cgroup limit
    leaves; None when neither is known."""
    budget = avail.get("mem_available")
    if avail.get("cgroup_limit") is not None:
        left = avail["cgroup_limit"] - (avail.get("cgroup_usage") or 0)
        budget = left if budget is None else min(budget, left)
    return budget


# ---------------------------------------------------------------- the meter
def _cuda():
    try:
        import torch

        return torch if torch.cuda.is_available() else None
    except ImportError:
        return None


class MemoryMeter:
    """Per-phase peaks of this rank (module docstring). `enabled=False`: phases still
    write the status file, nothing is measured."""

    def __init__(self, status_dir: Optional[str] = None, rank: int = 0, enabled: bool = True):
        self.pid = os.getpid()
        self.rank = rank
        self.enabled = enabled
        self.status_dir = status_dir
        self.cuda = _cuda() if enabled else None
        self.peaks: dict[str, int] = {}          # this step's phase -> bytes
        self.host_peak = 0
        self.step = 0
        self.last: dict = {}                     # the last finished phase: name, bytes
        if status_dir:
            os.makedirs(status_dir, exist_ok=True)

    def _reset(self) -> None:
        for pid in [self.pid, *descendants(self.pid)]:
            reset_peak(pid)
        if self.cuda is not None:
            self.cuda.cuda.reset_peak_memory_stats()

    def _host_peak(self) -> int:
        return sum(peak_rss(p) for p in [self.pid, *descendants(self.pid)])

    def _write_status(self, phase: str, state: str) -> None:
        if not self.status_dir:
            return
        row = {"rank": self.rank, "pid": self.pid, "phase": phase, "state": state,
               "step": self.step, "time": time.time(), "rss": rss(self.pid),
               "last_phase": self.last.get("phase"), "last_peak": self.last.get("bytes")}
        path = os.path.join(self.status_dir, f"rank-{self.rank}.json")
        tmp = path + ".tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(row, f)
            os.replace(tmp, path)
        except OSError:
            pass

    @contextlib.contextmanager
    def phase(self, name: str):
        """Measure the peak of the enclosed code as phase `name` (phases do not nest)."""
        self._write_status(name, "running")
        if os.environ.get(KILL_ENV) == f"{name}:{self.step + 1}:{self.rank}":
            os.kill(os.getpid(), signal.SIGKILL)      # a test's stand-in for the OOM killer
        if self.enabled:
            self._reset()
        try:
            yield
        finally:
            if self.enabled:
                if self.cuda is None:
                    trim_heap()
                host = self._host_peak()
                peak = int(self.cuda.cuda.max_memory_reserved()) if self.cuda is not None \
                    else host
                self.peaks[name] = max(self.peaks.get(name, 0), peak)
                self.host_peak = max(self.host_peak, host)
                self.last = {"phase": name, "bytes": peak}
            self._write_status(name, "done")

    def step_metrics(self, step: int, group=None) -> dict:
        """This step's `memory/<phase>` peaks (GiB, the largest over the ranks of `group`,
        default the world), `memory/peak` (the step's largest) and on a GPU
        `memory/host_peak`; the peaks start again for the next step. Collective when
        torch.distributed is initialised."""
        self.step = step
        if not self.enabled:
            return {}
        names = [p for p in PHASES] + ["host"]
        values = [float(self.peaks.get(p, -1)) for p in PHASES] + [float(self.host_peak)]
        try:
            import torch
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                t = torch.tensor(values, dtype=torch.float64)
                if self.cuda is not None:
                    t = t.cuda()
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
                values = t.cpu().tolist()
        except ImportError:
            pass
        self.peaks, self.host_peak = {}, 0
        out = {f"memory/{n}": v / GIB for n, v in zip(names, values)
               if n != "host" and v >= 0}
        if out:
            out["memory/peak"] = max(out.values())
        if self.cuda is not None:
            out["memory/host_peak"] = values[-1] / GIB
        return out

    def local_metrics(self) -> dict:
        """This rank's `memory/<phase>` peaks of the step so far (GiB) and their largest,
        without step_metrics' collective or reset: what a checkpoint keeps of its step's
        row, for a resume to write when a crash came before the row (train/run.py)."""
        if not self.enabled:
            return {}
        out = {f"memory/{p}": float(self.peaks[p]) / GIB for p in PHASES
               if self.peaks.get(p, -1) >= 0}
        if out:
            out["memory/peak"] = max(out.values())
        return out


def meter_for_rank(rank: int, environ=None) -> MemoryMeter:
    """The meter of a worker: its status folder from the launcher's MGRPO_STATUS_DIR."""
    environ = os.environ if environ is None else environ
    return MemoryMeter(environ.get(STATUS_ENV) or None, rank=rank)
