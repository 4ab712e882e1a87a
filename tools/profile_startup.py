"""Where a CLI run's fixed costs go: the phase timeline of a real `megatron rlhf` run.

    python tools/profile_startup.py                      # quickstart config, 2 steps, 2 ranks
    python tools/profile_startup.py --steps 2 --keep /tmp/ps -- --tensor_model_parallel_size 2

Runs `NPROC_PER_NODE=2 python -m megatron_grpo.cli rlhf --config configs/quickstart_cpu.yaml
--train_iters N` on the quickstart's tiny Qwen2 (built into a temporary folder unless
--model is given), exactly as a user would, with one addition: a `sitecustomize` module
on PYTHONPATH (written by this tool, nothing of the package changes) that every Python
process of the run (the `megatron` parent, torchrun's agent, the ranks) loads first. It
appends timestamped events to a file per process:

- `up`: the interpreter reached site (its start time is read from /proc: the
  interpreter's own start-up before that is `start -> up`);
- `import X` begin / end for the heavy packages (torch, megatron.core, transformers,
  vllm and the parts of them that were seen to cost: wandb, torch._dynamo, ...),
  the first time each is imported in the process;
- begin / end of the run's phases (build_parallel, build_policy, build_sampler, the
  first generates, each optimizer step, checkpoint saves, final_hf, engine close,
  the worker's exit).

It prints one timeline per process (seconds since the tool started the command, and
the process's CPU seconds at that moment), then the summary line

    startup total_s=... first_step_s=... wrapup_s=... cpu_s=...

first_step_s: command start -> the end of rank 0's first optimizer step; wrapup_s: the end
of the last optimizer step -> the command's exit; cpu_s: CPU seconds of every process of
the run (getrusage of the waited-for children). Timestamps are wall clock: on a loaded
machine read them beside cpu_s.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# The hook every process of the run loads (as `sitecustomize`). Kept as text: it must not
# import anything heavy itself, and it runs before the package is importable.
HOOK = r'''
import importlib.abc, importlib.util, json, os, sys, time

_LOG = os.environ.get("PROFILE_STARTUP_DIR")
_WATCH = ("torch", "torch.distributed.run", "megatron.core", "megatron.core.inference",
          "megatron.core.fusions", "transformers", "datasets", "vllm", "vllm.entrypoints.llm",
          "wandb", "torch._dynamo", "torch._inductor", "megatron_grpo.trainer",
          "megatron_grpo.rollout.colocate", "bridge")
_WRAP = {  # module -> functions (Class.method) whose calls are timed
    "megatron_grpo.cli": ["_exit_worker"],
    "megatron_grpo.launch": ["relaunch"],
    "megatron_grpo.data": ["load_datasets"],
    "megatron_grpo.trainer": ["build_run", "rollout_phase", "optimizer_step", "finish"],
    "megatron_grpo.train.run": ["build_parallel", "build_policy", "build_reference",
                                "build_sampler", "save_final_hf"],
    "megatron_grpo.checkpoint": ["save_checkpoint"],
    "megatron_grpo.rollout.colocate": ["ColocateEngine.__init__", "ColocateEngine.generate",
                                       "ColocateEngine.close"],
    "megatron_grpo.rollout.sync": ["WeightSync.__call__"],
}
_seen = set()
_out = None
_forked_at = None     # a forked worker (launch.fork_workers): when, until its first event


def _cmd():
    with open("/proc/self/cmdline", "rb") as f:
        cmd = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    return " ".join(cmd[1:4])[:100]


def _after_fork():
    global _out, _forked_at
    _out, _forked_at = None, time.time()


def _event(name, **kw):
    global _out, _forked_at
    if _out is None:
        _out = open(os.path.join(_LOG, f"{os.getpid()}.jsonl"), "a", buffering=1)
        if _forked_at is not None:     # its "up": the fork (its environment is set by now)
            up = dict(name="up", start=_forked_at, t=_forked_at, cpu=0.0, forked=True,
                      rank=os.environ.get("RANK"), cmd=_cmd())
            _out.write(json.dumps(up) + "\n")
            _forked_at = None
    kw.update(name=name, t=time.time(), cpu=time.process_time())
    _out.write(json.dumps(kw) + "\n")


def _wrap(owner, attr, label):
    fn = getattr(owner, attr, None)
    if fn is None or getattr(fn, "_profiled", False):
        return
    calls = [0]

    def wrapper(*a, **k):
        calls[0] += 1
        n = calls[0]
        if n > 4 and label.endswith("generate"):
            return fn(*a, **k)
        _event(f"{label}#{n}", edge="begin")
        try:
            return fn(*a, **k)
        finally:
            _event(f"{label}#{n}", edge="end")

    wrapper._profiled = True
    wrapper.__wrapped__ = fn
    wrapper.__name__ = getattr(fn, "__name__", attr)
    setattr(owner, attr, wrapper)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name in _seen or (name not in _WATCH and name not in _WRAP):
            return None
        _seen.add(name)
        for finder in sys.meta_path:        # the finders after this one, as importlib would
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader, watch = spec.loader, name in _WATCH

        def exec_module(module, _exec=loader.exec_module):
            if watch:
                _event(f"import {name}", edge="begin")
            try:
                _exec(module)
            finally:
                if watch:
                    _event(f"import {name}", edge="end")
            for path in _WRAP.get(name, ()):
                owner, attr = module, path
                if "." in path:
                    cls, attr = path.split(".")
                    owner = getattr(module, cls)
                _wrap(owner, attr, path)

        loader.exec_module = exec_module
        return spec


if _LOG:
    with open("/proc/self/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        boot = time.time() - float(f.read().split()[0])
    _event("up", start=boot + ticks / os.sysconf("SC_CLK_TCK"), rank=os.environ.get("RANK"),
           cmd=_cmd())
    sys.meta_path.insert(0, _Finder())
    os.register_at_fork(after_in_child=_after_fork)
'''


def load_events(folder: str) -> dict:
    """pid -> its events, in order."""
    out = {}
    for path in glob.glob(os.path.join(folder, "*.jsonl")):
        rows = [json.loads(line) for line in open(path) if line.strip()]
        if rows:
            out[int(os.path.basename(path).split(".")[0])] = rows
    return out


def role(pid: int, rows: list, parent: int) -> str:
    up = rows[0]
    if pid == parent:
        return "megatron (parent)"
    if up.get("rank") is None:
        return f"torchrun agent (pid {pid})"
    if "megatron_grpo.cli" in up["cmd"]:
        return f"rank {up['rank']}"
    return f"child of rank {up['rank']} (pid {pid}): {up['cmd']}"


def print_timeline(events: dict, t0: float, parent: int) -> dict:
    """One table per process; returns role -> rows."""
    by_role = {role(pid, rows, parent): rows for pid, rows in events.items()}
    children = {}    # (rank, command) -> start times of short-lived helper interpreters
    for name in [n for n in by_role if n.startswith("child") and len(by_role[n]) == 1]:
        up = by_role.pop(name)[0]
        children.setdefault((up["rank"], up["cmd"]), []).append(up["start"] - t0)
    for (rank, cmd), starts in sorted(children.items()):
        print(f"rank {rank} started {len(starts)} Python interpreters ({cmd!r}) at "
              f"{min(starts):.1f}-{max(starts):.1f} s")
    for name in sorted(by_role, key=lambda r: by_role[r][0]["start"]):
        rows = by_role[name]
        print(f"\n== {name} (pid start at {rows[0]['start'] - t0:.2f} s)")
        print(f"{'event':44s} {'t s':>7s} {'took s':>7s} {'cpu s':>7s}")
        begins = {}
        for r in rows:
            edge = r.get("edge")
            if edge == "begin":
                begins[r["name"]] = r
                continue
            took = r["t"] - begins[r["name"]]["t"] if r["name"] in begins else \
                r["t"] - r["start"] if r["name"] == "up" else float("nan")
            label = r["name"] if r["name"] != "up" else \
                "forked from the launcher" if r.get("forked") else "interpreter up (start -> site)"
            print(f"{label:44s} {r['t'] - t0:7.2f} {took:7.2f} {r['cpu']:7.2f}")
    return by_role


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "quickstart_cpu.yaml"))
    p.add_argument("--model", help="an HF checkpoint folder (default: the quickstart's tiny "
                                   "Qwen2, built into a temporary folder)")
    p.add_argument("--steps", type=int, default=2, help="--train_iters of the run")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--keep", help="keep the run's folder and the event files here")
    p.add_argument("extra", nargs="*", help="after --: more `megatron rlhf` options")
    a = p.parse_args()
    work = a.keep or tempfile.mkdtemp(prefix="profile_startup_")
    os.makedirs(work, exist_ok=True)
    model = a.model
    if model is None:
        from tools.quickstart import build_tiny

        model = os.path.join(work, "tiny-qwen2")
        if not os.path.isdir(model):
            build_tiny(work)
    events_dir, hook_dir, out = (os.path.join(work, d) for d in ("events", "hook", "run"))
    for d in (events_dir, out):
        shutil.rmtree(d, ignore_errors=True)
    os.makedirs(events_dir)
    os.makedirs(hook_dir, exist_ok=True)
    with open(os.path.join(hook_dir, "sitecustomize.py"), "w") as f:
        f.write(HOOK)
    env = dict(os.environ, NPROC_PER_NODE=str(a.nproc), OMP_NUM_THREADS="1",
               PROFILE_STARTUP_DIR=events_dir,
               PYTHONPATH=os.pathsep.join([hook_dir, ROOT, os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "megatron_grpo.cli", "rlhf", "--config", os.path.abspath(a.config),
           "--model", model, "--output_dir", out, "--train_iters", str(a.steps), *a.extra]
    print("$ NPROC_PER_NODE=%d %s" % (a.nproc, " ".join(cmd)), flush=True)
    load = os.getloadavg()[0]
    t0 = time.time()
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
    rc = proc.wait()
    wall = time.time() - t0
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = cpu.ru_utime + cpu.ru_stime
    by_role = print_timeline(load_events(events_dir), t0, proc.pid)
    if rc != 0:
        sys.exit(f"the run failed (rc {rc}); its output: rerun the command above")
    r0 = by_role.get("rank 0", [])
    steps = [r["t"] for r in r0 if r["name"].startswith("optimizer_step#") and r["edge"] == "end"]
    gen1 = [r["t"] for r in r0 if r["name"] == "rollout_phase#1" and r["edge"] == "begin"]
    print(f"\nload {load:.1f} -> {os.getloadavg()[0]:.1f}")
    print(f"startup total_s={wall:.1f} to_first_rollout_s={gen1[0] - t0:.1f} "
          f"first_step_s={steps[0] - t0:.1f} wrapup_s={t0 + wall - steps[-1]:.1f} "
          f"cpu_s={cpu_s:.1f}")
    if not a.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
