"""Where one GRPO step of ours spends its time, per phase and per rank.

Runs our trainer (`megatron rlhf`, the shape's config from tools/bench_peer.py SHAPES,
default the quickstart as shipped: 2 processes, colocated vLLM) under torchrun for
`--step` generation batches, and profiles, in every rank, each phase of the last one:

    generate       collect_rollouts: vLLM sampling, gathering, reward scoring
    old_logprobs   an old-log-prob forward of the rank's samples (fill_logps with
                   need_old=True on a copy of the batch), run as a probe even when the
                   config needs none (on-policy, beta 0): what an off-policy step pays
    logprobs       the trainer's own fill_logps call (nothing to do when on-policy)
    train_fwd_bwd  train_micro_batches: forward, fused log-prob kernel, loss, backward
    optimizer      the Megatron optimizer step (grad clipping, Adam, param copy)
    metrics        step_metrics: reducing the step's partials over ranks
    sync           WeightSync.__call__: bridge export -> vLLM in-place load

The trainer itself is unchanged: the worker replaces those names in the
modules of megatron_grpo.train (and WeightSync.__call__) with wrappers that profile the call of the chosen batch
and pass every other call through. Profilers:

    --mode cprofile  (default) Python functions, self ("tottime") and cumulative time;
                     shows interpreter overhead: scheduling, per-sample Python, gloo
                     calls, vLLM's scheduler. Adds overhead to Python-heavy code.
    --mode torch     torch.profiler (CPU activities): aten ops and collectives by self
                     CPU time; also writes a Chrome trace per rank and phase.

Prints, for every phase, the wall time of each rank and the top `--top` entries of
the chosen rank; the raw files stay in `--out` (rank{r}_{phase}.prof / .txt / .json).

Usage:
    python tools/profile_step.py [--shape quickstart] [--step 3] [--mode cprofile]
        [--rank 0] [--top 15] [--nproc 2] [--out DIR] [-- RLHF FLAGS...]
e.g. `-- --tensor_model_parallel_size 1` (DP=2), `-- --num_iterations 2` (old log-probs
for real). Leave VLLM_CPU_KVCACHE_SPACE unset: it overrides the KV cache the run sizes for
itself (rollout/kv_cache.py), and a larger cache makes the sync's prefix-cache reset longer.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PHASES = ("generate", "old_logprobs", "logprobs", "train_fwd_bwd", "optimizer", "metrics",
          "sync")


# --------------------------------------------------------------------------- worker side
def _short(path: str) -> str:
    """site-packages/vllm/v1/core/sched/scheduler.py -> vllm/v1/core/sched/scheduler.py"""
    for marker in ("site-packages/", ROOT + "/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


def cprofile_table(stats, top: int) -> str:
    """The top entries by self time and by cumulative time, one line each."""
    rows = []
    for (file, line, func), (cc, nc, tt, ct, _callers) in stats.stats.items():
        where = func if file == "~" else f"{func} ({_short(file)}:{line})"
        rows.append((tt, ct, nc, where))
    out = [f"{'self s':>8} {'cum s':>8} {'calls':>8}  function (by self time)"]
    out += [f"{tt:8.4f} {ct:8.4f} {nc:8d}  {w}" for tt, ct, nc, w in
            sorted(rows, key=lambda r: -r[0])[:top]]
    out.append(f"{'self s':>8} {'cum s':>8} {'calls':>8}  function (by cumulative time)")
    out += [f"{tt:8.4f} {ct:8.4f} {nc:8d}  {w}" for tt, ct, nc, w in
            sorted(rows, key=lambda r: -r[1])[:top]]
    return "\n".join(out)


class StepProfiler:
    """Profiles the phases of generation batch `target` (1-based) in this rank."""

    def __init__(self, out: str, target: int, mode: str, top: int, rank: int) -> None:
        self.out, self.target, self.mode, self.top, self.rank = out, target, mode, top, rank
        self.batch = 0
        self.walls: dict = {}

    def active(self) -> bool:
        return self.batch == self.target

    def call(self, phase: str, fn, *a, **k):
        if not self.active():
            return fn(*a, **k)
        base = os.path.join(self.out, f"rank{self.rank}_{phase}")
        t0 = time.perf_counter()
        if self.mode == "cprofile":
            import cProfile
            import pstats

            prof = cProfile.Profile()
            prof.enable()
            try:
                result = fn(*a, **k)
            finally:
                prof.disable()
            wall = time.perf_counter() - t0
            prof.dump_stats(base + ".prof")
            table = cprofile_table(pstats.Stats(prof), self.top)
        else:
            import torch

            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                result = fn(*a, **k)
            wall = time.perf_counter() - t0
            prof.export_chrome_trace(base + ".json")
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=self.top)
        self.walls[phase] = self.walls.get(phase, 0.0) + wall
        with open(base + ".txt", "a") as f:
            f.write(table + "\n")
        with open(os.path.join(self.out, f"rank{self.rank}_walls.json"), "w") as f:
            json.dump(self.walls, f)
        return result


def install(prof: StepProfiler) -> None:
    """Wrap the trainer's phase functions where the loop looks them up at call time
    (module globals of train/rollout_step.py, train/step.py, train/run.py; the weight
    sync's __call__)."""
    import megatron_grpo.train.rollout_step as R
    import megatron_grpo.train.run as Run
    import megatron_grpo.train.step as S
    from megatron_grpo.rollout.sync import WeightSync

    collect, fill, train_mb, sync, metrics, build = (
        R.collect_rollouts, R.fill_logps, S.train_micro_batches, WeightSync.__call__,
        S.step_metrics, Run.build_policy)

    def collect_rollouts(*a, **k):
        prof.batch += 1
        return prof.call("generate", collect, *a, **k)

    def fill_logps(policy_chunks, ref, mine, *a, **k):
        if prof.active():    # the probe: an old-log-prob forward on a copy of the batch
            probe = copy.deepcopy(mine)
            prof.call("old_logprobs", fill, policy_chunks, None, probe, *a,
                      **dict(k, need_old=True))
        return prof.call("logprobs", fill, policy_chunks, ref, mine, *a, **k)

    def build_policy(*a, **k):
        policy = build(*a, **k)
        step = policy.optimizer.step
        policy.optimizer.step = lambda *sa, **sk: prof.call("optimizer", step, *sa, **sk)
        return policy

    R.collect_rollouts = collect_rollouts
    R.fill_logps = fill_logps
    S.train_micro_batches = lambda *a, **k: prof.call("train_fwd_bwd", train_mb, *a, **k)
    WeightSync.__call__ = lambda self, *a, **k: prof.call("sync", sync, self, *a, **k)
    S.step_metrics = lambda *a, **k: prof.call("metrics", metrics, *a, **k)
    Run.build_policy = build_policy


def worker(a: argparse.Namespace, rlhf: list[str]) -> None:
    """One torchrun rank: our trainer with the phase wrappers installed."""
    from megatron_grpo.config import parse_rlhf_args, validate_world
    from megatron_grpo.trainer import train

    cfg = parse_rlhf_args(rlhf)
    validate_world(cfg, int(os.environ["WORLD_SIZE"]))
    install(StepProfiler(a._worker, a.step, a.mode, a.top, int(os.environ["RANK"])))
    train(cfg)


# --------------------------------------------------------------------------- parent side
def report(out: str, nproc: int, rank: int) -> None:
    walls = {}
    for r in range(nproc):
        path = os.path.join(out, f"rank{r}_walls.json")
        walls[r] = json.load(open(path)) if os.path.exists(path) else {}
    print(f"\n{'phase':<14}" + "".join(f"{f'rank {r} s':>10}" for r in range(nproc)))
    for phase in PHASES:
        print(f"{phase:<14}" + "".join(f"{walls[r].get(phase, float('nan')):>10.4f}"
                                       for r in range(nproc)))
    for phase in PHASES:
        path = os.path.join(out, f"rank{rank}_{phase}.txt")
        if os.path.exists(path):
            print(f"\n=== {phase} (rank {rank}, {walls[rank].get(phase, 0.0):.4f} s) ===")
            print(open(path).read().rstrip())


def main() -> None:
    from tools.bench_peer import CONFIG, SHAPES, build_model

    argv = sys.argv[1:]
    rlhf = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="quickstart", help=f"one of {', '.join(SHAPES)}")
    ap.add_argument("--step", type=int, default=3,
                    help="profile this generation batch (1-based; later ones skip warm-ups)")
    ap.add_argument("--mode", default="cprofile", help="cprofile or torch")
    ap.add_argument("--rank", type=int, default=0, help="the rank whose tables are printed")
    ap.add_argument("--top", type=int, default=15, help="entries per table")
    ap.add_argument("--nproc", type=int, default=None, help="processes (default: the shape's)")
    ap.add_argument("--out", default=None, help="keep the run and the profiles in this folder")
    ap.add_argument("--_worker", help=argparse.SUPPRESS)
    a = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if a._worker:
        return worker(a, rlhf)
    if a.shape not in SHAPES:
        ap.error(f"--shape {a.shape!r} is not a shape; allowed: {', '.join(SHAPES)}")
    if a.mode not in ("cprofile", "torch"):
        ap.error(f"--mode {a.mode!r} is not allowed; use cprofile or torch")
    if a.step < 1:
        ap.error(f"--step {a.step} must be >= 1")
    shape = SHAPES[a.shape]
    nproc = a.nproc or shape.nproc
    if not 0 <= a.rank < nproc:
        ap.error(f"--rank {a.rank} must be in 0..{nproc - 1}")
    work = a.out or tempfile.mkdtemp(prefix="profile_step_")
    try:
        os.makedirs(work, exist_ok=True)
        prof_dir = os.path.join(work, "profiles")
        shutil.rmtree(prof_dir, ignore_errors=True)
        os.makedirs(prof_dir)
        model_dir = build_model(shape, work)
        run_dir = os.path.join(work, "run")
        shutil.rmtree(run_dir, ignore_errors=True)
        # Run up to the profiled batch (steps_per_generation 1 assumed for the step count;
        # the wrappers count generation batches either way).
        flags = ["--config", CONFIG, "--model", model_dir, "--output_dir", run_dir,
                 *shape.rlhf_args, "--train_iters", str(a.step), "--save_steps", str(a.step),
                 "--log_completions", "false", *rlhf]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={nproc}", os.path.abspath(__file__), "--_worker", prof_dir,
               "--step", str(a.step), "--mode", a.mode, "--top", str(a.top), "--", *flags]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
        print(f"[profile_step] {a.shape}: {nproc} processes, profiling generation batch "
              f"{a.step} ({a.mode}); megatron rlhf {' '.join(flags)}", flush=True)
        with open(os.path.join(work, "run.log"), "w") as log:
            rc = subprocess.call(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        if rc != 0:
            raise SystemExit(f"profile_step: the run failed (exit {rc}); see {work}/run.log "
                             "(--out DIR keeps it)")
        report(prof_dir, nproc, a.rank)
    finally:
        if a.out is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
