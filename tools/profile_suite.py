"""Where the test suite's CPU goes: per test file and test, and per kind of process.

    python tools/profile_suite.py [PYTEST ARGS ...]      # default: the whole suite, 2 workers

Runs pytest (`-n 2 --dist loadfile --no-loadscope-reorder` as scripts/test.sh, unless the
arguments choose), samples every process of the machine once a second (/proc/PID/stat:
user and system CPU since the last sample), and records when each test ran on which pytest-xdist worker (a plugin in the workers). A
process's CPU in a sample is charged to the test running then on the worker it descends
from (ranks of the harness's fork server, forks of the CLI zygote, `megatron` launchers
and their workers, vLLM's engine processes). Prints the run's wall time, the sampled busy
CPU against the cores' capacity, then the files and the tests with the most CPU, each
file with its largest kinds of process. Processes that live less than a second are
missed, so the figures are a lower bound.

Use it to find the next cut in the suite.
"""
from __future__ import annotations

import bisect
import collections
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMES_VAR = "MGRPO_PROFILE_SUITE_DIR"
HZ = os.sysconf("SC_CLK_TCK")


# ------------------------------------------------ the plugin, in each pytest process

def pytest_runtest_logfinish(nodeid, location):   # noqa: ARG001 - pytest's hook signature
    """When each test ended (its teardown included), in which pytest process."""
    folder = os.environ.get(TIMES_VAR)
    if not folder:
        return
    with open(os.path.join(folder, f"{os.getpid()}.jsonl"), "a") as f:
        f.write(json.dumps({"id": nodeid, "pid": os.getpid(), "t1": time.time()}) + "\n")


# ------------------------------------------------ the sampler and the report

def _sample(procs: dict, stop: threading.Event) -> None:
    """procs[(pid, start time)]: cmd, ppid, and (time, CPU s since the last sample) ticks.
    What ran before the first sweep is left out."""
    first = True
    while not stop.is_set():
        now = time.time()
        for p in os.listdir("/proc"):
            if not p.isdigit():
                continue
            try:
                with open(f"/proc/{p}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            end = stat.rfind(")")
            fields = stat[end + 2:].split()
            ppid, user, system, start = (int(fields[1]), int(fields[11]), int(fields[12]),
                                         int(fields[19]))
            e = procs.get((p, start))
            # The command line is read at every sweep: a child caught between fork and exec
            # still shows its parent's, and exec keeps the pid and the start time.
            try:
                with open(f"/proc/{p}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace")[:300]
            except OSError:
                cmd = ""
            if e is None:
                e = procs[p, start] = dict(pid=int(p), ppid=ppid, cmd=cmd, ticks=[],
                                           cpu=user + system if first else 0)
            e["comm"] = stat[stat.find("(") + 1:end]
            e["cmd"] = cmd or e["cmd"]
            if user + system > e["cpu"]:
                e["ticks"].append((now, (user + system - e["cpu"]) / HZ))
                e["cpu"] = user + system
        first = False
        stop.wait(1.0)


def _kind(e: dict) -> str:
    cmd = e["cmd"]
    if "forkserver" in cmd:
        return "harness rank"
    if "cli_zygote" in cmd:
        return "CLI zygote / its forks"
    if "megatron_grpo.cli" in cmd:
        return "megatron " + cmd.split("megatron_grpo.cli", 1)[1].split()[0]
    if "rollout.server" in cmd:
        return "rollout server"
    if e["comm"].startswith("VLLM"):
        return e["comm"]
    if "exec(eval(sys.stdin" in cmd or "pytest" in cmd:
        return "pytest"
    return e["comm"]


def _report(procs: dict, folder: str, wall: float, top: int) -> None:
    finished = [json.loads(line) for path in glob.glob(os.path.join(folder, "*.jsonl"))
                for line in open(path)]
    by_worker = collections.defaultdict(list)
    for t in finished:
        by_worker[t["pid"]].append(t)
    ends = {}
    for pid, tests in by_worker.items():
        tests.sort(key=lambda t: t["t1"])
        ends[pid] = [t["t1"] for t in tests]
    latest = {e["pid"]: e for e in procs.values()}

    def worker_of(e):
        for _ in range(40):
            if e is None:
                return None
            if e["pid"] in by_worker:
                return e["pid"]
            e = latest.get(e["ppid"])
        return None

    per_file, per_test = collections.Counter(), collections.Counter()
    kinds = collections.defaultdict(collections.Counter)
    total = 0.0
    for e in procs.values():
        w = worker_of(e)
        for t, cpu in e["ticks"]:
            total += cpu
            if w is None:
                continue
            i = bisect.bisect_left(ends[w], t - 0.5)     # the test running then: next to end
            test = by_worker[w][i]["id"] if i < len(ends[w]) else "(after the last test)"
            per_file[test.split("::")[0]] += cpu
            per_test[test] += cpu
            kinds[test.split("::")[0]][_kind(e)] += cpu
    cores = os.cpu_count() or 1
    print(f"profile_suite wall_s={wall:.1f} busy_cpu_s={total:.0f} "
          f"capacity_cpu_s={wall * cores:.0f} "
          f"({100 * total / (wall * cores):.0f} % of {cores} cores)")
    print(f"\nfiles by CPU s (of {sum(per_file.values()):.0f} charged to tests):")
    for name, cpu in per_file.most_common(top):
        largest = ", ".join(f"{k} {v:.0f}" for k, v in kinds[name].most_common(3))
        print(f"{cpu:8.1f}  {name}  [{largest}]")
    print("\ntests by CPU s:")
    for name, cpu in per_test.most_common(top):
        print(f"{cpu:8.1f}  {name}")


def main(argv: list[str]) -> int:
    top = 25
    args = argv
    if not any(a == "-n" or a.startswith("-n") and a[2:].isdigit() for a in args):
        args = ["-n", "2", "--dist", "loadfile", "--no-loadscope-reorder", *args]
    folder = tempfile.mkdtemp(prefix="profile_suite-")
    env = dict(os.environ, OMP_NUM_THREADS="1", **{TIMES_VAR: folder},
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    procs: dict = {}
    stop = threading.Event()
    sampler = threading.Thread(target=_sample, args=(procs, stop), daemon=True)
    sampler.start()
    start = time.time()
    code = subprocess.call([sys.executable, "-m", "pytest", "-p", "tools.profile_suite", *args],
                           cwd=ROOT, env=env)
    wall = time.time() - start
    stop.set()
    sampler.join()
    _report(procs, folder, wall, top)
    shutil.rmtree(folder, ignore_errors=True)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
