"""Where the time of one GRPO step goes, for the CPU quickstart.

Runs `NPROC_PER_NODE=2 megatron rlhf --config configs/quickstart_cpu.yaml` (DP=2
Megatron-Core with the distributed optimizer and a colocated vLLM engine on 2 processes,
the tiny Qwen2 of the quickstart; `-- --tensor_model_parallel_size 2` for TP=2) for a few steps in a scratch folder, then reads the per-step timings the
trainer writes to metrics.jsonl:

    timing/generate  vLLM sampling (and gathering the completions)
    timing/score     reward functions
    timing/logprobs  old / reference log-prob forwards (0 when none is needed)
    timing/train     forward + backward + optimizer step
    timing/sync      streaming the new weights into vLLM
    timing/step      wall time between consecutive steps (everything above, plus
                     batching, metrics and logging: the "other" row)

The first `--warmup` steps (first-call allocations, oneDNN packing) are left out. Prints
a table (median and mean seconds per phase, share of the step time) and as its last line

    e2e step_s=<median step seconds> sync_share=<total sync time / total step time>
        startup_s=<process start -> first step begins>

Start-up is read as bench_peer.py reads it: the moment metrics.jsonl gets its first line
(polled) less the first step's own time. The 1-minute load average at start and end is
printed too, and `cpu_s`: the CPU seconds (user + system) of all the run's processes,
start-up included, which load distorts far less than wall time. On a shared machine
compare runs only in interleaved pairs.

Usage: python tools/bench_e2e.py [--steps 14] [--warmup 2] [--keep DIR] [-- RLHF FLAGS...]
(flags after `--` go to `megatron rlhf`, e.g. `-- --sleep_level 1 --offload_model true`)
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PHASES = ("generate", "score", "logprobs", "train", "sync")


def _first_line_time(path: str, proc: subprocess.Popen, out: dict) -> None:
    """Poll `path` until it holds a line; record the perf_counter() of that moment."""
    while proc.poll() is None:
        try:
            if os.path.getsize(path) > 0:
                out["t"] = time.perf_counter()
                return
        except OSError:
            pass
        time.sleep(0.02)


def run_quickstart(work: str, steps: int, extra: list[str]) -> tuple[str, float, float]:
    """Returns (output folder, wall seconds, seconds until the first metrics line)."""
    from tools.quickstart import build_tiny

    model_dir = build_tiny(work)
    out = os.path.join(work, "grpo")
    cmd = [sys.executable, "-m", "megatron_grpo.cli", "rlhf",
           "--config", os.path.join(ROOT, "configs", "quickstart_cpu.yaml"),
           "--model", model_dir, "--output_dir", out, "--train_iters", str(steps),
           # steady-state loop: no intermediate checkpoint inside the measured steps
           "--save_steps", str(steps), "--log_completions", "false", *extra]
    env = dict(os.environ, NPROC_PER_NODE="2", OMP_NUM_THREADS="1")
    print(f"[bench_e2e] {' '.join(cmd[2:])} (NPROC_PER_NODE=2)", flush=True)
    seen: dict = {}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT)
    watcher = threading.Thread(target=_first_line_time,
                               args=(os.path.join(out, "metrics.jsonl"), proc, seen))
    watcher.start()
    rc = proc.wait()
    watcher.join()
    if rc != 0:
        raise SystemExit(f"bench_e2e: the run failed (exit {rc})")
    return out, time.perf_counter() - t0, seen.get("t", t0) - t0


def summarize(rows: list[dict], warmup: int) -> dict:
    rows = rows[warmup:]
    if not rows:
        raise SystemExit("bench_e2e: no steps left after --warmup; raise --steps")
    step = [r["timing/step"] for r in rows]
    table = {}
    for phase in PHASES:
        vals = [r.get(f"timing/{phase}") or 0.0 for r in rows]
        table[phase] = vals
    table["other"] = [s - sum(table[p][i] for p in PHASES) for i, s in enumerate(step)]
    table["step"] = step
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--warmup", type=int, default=2, help="first steps left out of the figures")
    ap.add_argument("--keep", default=None, help="run in this folder and keep it (default: a temp dir)")
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    a = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if a.steps <= a.warmup:
        raise SystemExit(f"--steps {a.steps} must be larger than --warmup {a.warmup}")
    work = a.keep or tempfile.mkdtemp(prefix="bench_e2e_")
    load0 = os.getloadavg()[0]
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        out, wall, first_line = run_quickstart(work, a.steps, extra)
        rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    finally:
        if a.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    startup = first_line - rows[0]["timing/step"]
    table = summarize(rows, a.warmup)
    total = sum(table["step"])
    print(f"\n{len(rows)} steps in {wall:.1f} s (start-up included); figures over steps "
          f"{a.warmup + 1}..{len(rows)}; load average {load0:.1f} -> {os.getloadavg()[0]:.1f}")
    if os.environ.get("VLLM_CPU_KVCACHE_SPACE", "") != "":   # see rollout/kv_cache.py
        print(f"note: VLLM_CPU_KVCACHE_SPACE={os.environ['VLLM_CPU_KVCACHE_SPACE']} in the "
              "environment replaced the KV cache the run sizes (a larger cache lengthens the sync)")
    print(f"{'phase':<10} {'median s':>9} {'mean s':>9} {'share':>7}")
    for name, vals in table.items():
        share = sum(vals) / total if total > 0 else float("nan")
        print(f"{name:<10} {statistics.median(vals):>9.4f} {statistics.fmean(vals):>9.4f} "
              f"{share:>7.1%}")
    sync_share = sum(table["sync"]) / total
    print(f"e2e step_s={statistics.median(table['step']):.4f} sync_share={sync_share:.4f} "
          f"startup_s={startup:.1f} cpu_s={cpu:.1f}")


if __name__ == "__main__":
    main()
