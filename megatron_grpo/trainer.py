"""The GRPO loop (docs/architecture.md maps each phase to
its module):

    build the run                                        train/run.py
    rollout phase: generate -> score -> old/ref log-probs -> advantages
                                                         train/rollout_step.py
    optimizer steps                                      train/step.py (+ train/engine.py)
    sync: the new weights into vLLM                      rollout/sync.py
    evaluate                                             train/evaluate.py
    log / save                                           train/run.py

Every rank holds the whole generation batch; data-parallel rank d trains on every
dp-th completion of each optimizer step (train/batch.py `dp_shard`).
"""
from __future__ import annotations

import gc
import time

from .train.rollout_step import rollout_phase
from .train.run import build_run, finish, log_and_save
from .train.step import optimizer_step


def train(cfg, close_engine: bool = True):
    """The run of `cfg`, returned when done; `close_engine=False` leaves the vLLM engine
    open at the end, for a process that exits right after (cli.py)."""
    run = build_run(cfg)
    if not gc.isenabled():   # a launched worker's start-up is over (cli.py): what it made
        gc.freeze()          # is set aside, and collection resumes for the steps
        gc.enable()
    g = cfg.grpo
    # Each generation batch trains num_iterations passes of steps_per_generation steps.
    schedule = [(it, k) for it in range(g.num_iterations) for k in range(g.steps_per_generation)]
    t_last = time.perf_counter()     # timing/step: wall time between consecutive steps
    while run.step < run.total_steps:
        # 1-5: rollouts, log-probs, advantages (after a resume mid-batch: the rest of it)
        batch, start = run.pending or (rollout_phase(run), 0)
        run.pending = None
        for n, (_, k) in enumerate(schedule):
            if n < start:
                continue
            if run.step >= run.total_steps:
                break
            metrics = optimizer_step(run, batch, k)     # 6
            if n == 0:                                   # the rollout's times, once
                metrics.update(batch.gen.timing)
            # 7: vLLM needs the weights before the next generation only: after the last
            # step over this batch.
            if n == len(schedule) - 1 or run.step >= run.total_steps:
                t0 = time.perf_counter()
                with run.memory.phase("sync"):
                    run.sync()
                metrics["timing/sync"] = time.perf_counter() - t0
            if run.evaluator:    # held-out prompts, every eval_steps steps and after the last
                fresh = "timing/sync" in metrics        # vLLM holds this step's weights
                metrics.update(run.evaluator.maybe_evaluate(run.step, vllm_fresh=fresh))
            now = time.perf_counter()
            metrics["timing/step"], t_last = now - t_last, now
            log_and_save(run, batch, metrics, first_of_batch=n == 0,
                         next_in_batch=n + 1 if n + 1 < len(schedule) else None)
    finish(run, close_engine=close_engine)
    return run
