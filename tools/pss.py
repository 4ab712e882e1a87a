"""Peak memory of a process tree, as proportional set size (PSS), sampled from /proc.

    python tools/pss.py -- CMD [ARGS...]            # run CMD, print its tree's peak PSS
    python tools/pss.py --interval 0.5 -- env NPROC_PER_NODE=2 megatron rlhf --config ...

    from tools.pss import PeakSampler
    with PeakSampler(proc.pid) as sampler:
        proc.wait()
    sampler.peak.gib, sampler.peak.processes

Why PSS: the processes of one run share pages (forked ranks share the launcher's
imported code and data until written; a colocated engine maps the same files), so the
sum of their RSS counts those pages once per process and overstates the run. PSS splits
each shared page among the processes that map it, so the sum over the tree is what the
run costs the machine. It is the `Pss:` line of /proc/PID/smaps_rollup (kB).

The tree is the launched process and all its descendants, found through
/proc/PID/task/*/children (every thread's children: a child forked from another thread
is listed under that thread), walked anew at every sample: ranks and engine processes
that start or exit mid-run are counted while they live. A descendant whose parent exits
is re-parented outside the tree and is lost from then on (a run's launcher outlives its
workers). Sampling every `interval` seconds (default 0.25) sees a peak that lasts at
least that long; a spike shorter than that can fall between samples, and a process the
kernel's OOM killer ends shows the peak of the last sample before it.

The CLI prints, after CMD exits (its exit status is the tool's),

    pss peak_gib=<tree's peak PSS> samples=<n> processes=<at the peak>
    and one line per process at that moment: pid, depth in the tree (0: CMD itself),
    name, PSS and RSS (GiB)
"""
from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

KIB_PER_GIB = 1024 * 1024


@dataclass(frozen=True)
class ProcMem:
    """One process at one sample: PSS and RSS in kB (as /proc writes them)."""
    pid: int
    name: str
    pss_kb: int
    rss_kb: int
    depth: int = 0          # 0: the tree's root, 1: its children, ...


@dataclass
class Peak:
    """The tree's largest PSS sum over the samples, and its processes at that sample."""
    pss_kb: int = 0
    processes: list = field(default_factory=list)     # ProcMem, the largest PSS first
    samples: int = 0

    @property
    def gib(self) -> float:
        return self.pss_kb / KIB_PER_GIB


def children(pid: int) -> list[int]:
    """The direct children of `pid` (of all its threads); [] once it is gone. Falls back
    to scanning /proc/*/stat where the kernel has no task/*/children (CONFIG_PROC_CHILDREN)."""
    tasks = glob.glob(f"/proc/{pid}/task/*/children")
    if not tasks and os.path.isdir(f"/proc/{pid}/task"):
        return _children_by_ppid(pid)
    out = []
    for path in tasks:
        try:
            with open(path) as f:
                out.extend(int(x) for x in f.read().split())
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue                          # the thread or the process ended meanwhile
    return out


def _children_by_ppid(pid: int) -> list[int]:
    out = []
    for path in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(path) as f:
                stat = f.read()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses
        if int(stat[stat.rindex(")") + 2:].split()[1]) == pid:
            out.append(int(stat.split(" ", 1)[0]))
    return out


def process_tree(pid: int) -> list[tuple[int, int]]:
    """(pid, depth) of `pid` and all its descendants, parents before children."""
    out, seen, queue = [], set(), [(pid, 0)]
    while queue:
        p, depth = queue.pop(0)
        if p in seen:
            continue
        seen.add(p)
        out.append((p, depth))
        queue.extend((c, depth + 1) for c in children(p))
    return out


def read_memory(pid: int) -> tuple[int, int] | None:
    """(PSS, RSS) of `pid` in kB from /proc/PID/smaps_rollup; None when it is gone, a
    zombie (no memory left to read), or not ours to read."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            text = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    pss = rss = None
    for line in text.splitlines():
        if line.startswith("Pss:"):
            pss = int(line.split()[1])
        elif line.startswith("Rss:"):
            rss = int(line.split()[1])
    if pss is None or rss is None:
        return None
    return pss, rss


def _name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def tree_memory(pid: int) -> list[ProcMem]:
    """Every live process of the tree under `pid` (itself included) with its PSS and RSS."""
    out = []
    for p, depth in process_tree(pid):
        mem = read_memory(p)
        if mem is not None:
            out.append(ProcMem(p, _name(p), mem[0], mem[1], depth))
    return out


def tree_pss_kb(pid: int) -> int:
    """PSS of the tree under `pid`, summed, in kB."""
    return sum(m.pss_kb for m in tree_memory(pid))


class PeakSampler:
    """Samples the tree under `pid` every `interval` seconds in a daemon thread, keeping
    the largest PSS sum and the processes at that sample. `stop()` (or leaving the `with`
    block) takes one last sample, ends the thread and returns the Peak."""

    def __init__(self, pid: int, interval: float = 0.25):
        if interval <= 0:
            raise ValueError(f"interval={interval} must be > 0 (seconds between samples)")
        self.pid, self.interval = pid, interval
        self.peak = Peak()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"pss-{pid}", daemon=True)

    def sample(self) -> int:
        procs = tree_memory(self.pid)
        total = sum(m.pss_kb for m in procs)
        self.peak.samples += 1
        if total > self.peak.pss_kb:
            self.peak.pss_kb = total
            self.peak.processes = sorted(procs, key=lambda m: -m.pss_kb)
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def start(self) -> PeakSampler:
        self._thread.start()
        return self

    def stop(self) -> Peak:
        if self._thread.is_alive():
            self._stop.set()
            self._thread.join()
        self.sample()
        return self.peak

    def __enter__(self) -> PeakSampler:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def format_peak(peak: Peak, indent: str = "  ", top: int = 8) -> list[str]:
    """The peak's processes, one line each (the `top` largest by PSS, then a count)."""
    lines = [f"{indent}pid {m.pid:<7} depth {m.depth}  {m.name:<15} "
             f"PSS {m.pss_kb / KIB_PER_GIB:6.2f} GiB  RSS {m.rss_kb / KIB_PER_GIB:6.2f} GiB"
             for m in peak.processes[:top]]
    rest = peak.processes[top:]
    if rest:
        lines.append(f"{indent}... {len(rest)} more, PSS "
                     f"{sum(m.pss_kb for m in rest) / KIB_PER_GIB:.2f} GiB together")
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        print("usage: python tools/pss.py [--interval S] -- CMD [ARGS...]  (CMD after `--`)",
              file=sys.stderr)
        return 2
    cut = argv.index("--")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--interval", type=float, default=0.25, help="seconds between samples")
    a = ap.parse_args(argv[:cut])
    if a.interval <= 0:
        ap.error(f"--interval {a.interval} must be > 0 (seconds between samples)")
    cmd = argv[cut + 1:]
    t0 = time.time()
    try:
        proc = subprocess.Popen(cmd)
    except OSError as e:
        print(f"pss: cannot run {cmd[0]!r}: {e}", file=sys.stderr)
        return 127
    with PeakSampler(proc.pid, a.interval) as sampler:
        rc = proc.wait()
    peak = sampler.peak
    print(f"pss peak_gib={peak.gib:.3f} samples={peak.samples} "
          f"processes={len(peak.processes)} wall_s={time.time() - t0:.1f} exit={rc}")
    for line in format_peak(peak):
        print(line)
    return rc if rc >= 0 else 128 - rc


if __name__ == "__main__":
    sys.exit(main())
