"""One optimizer step (docs/architecture.md, step 6): the k-th share of a generation batch through
Megatron's schedule (train/engine.py), the optimizer and the LR scheduler, and the
step's metrics reduced over data-parallel ranks.

The loss of the step is the global quantity of `loss_type` (docs/architecture.md, loss
normalisation): its normaliser comes from the token counts of the whole step (every DP
rank's samples) and, for dapo/cispo, of the whole generation batch.
"""
from __future__ import annotations

import time

import torch.distributed as dist

from ..algorithms import count_partials, finalize_metrics, loss_normalizer
from ..model.kv_replication import sync_replicated_kv_grads
from ..model.moe import step_metrics as moe_step_metrics
from .batch import collate, micro_batches
from .engine import is_last_stage, reduce_partials, step_entropy_threshold, train_micro_batches
from .rollout_step import RolloutBatch, all_gather_objects


def optimizer_step(run, batch: RolloutBatch, k: int) -> dict:
    """Optimizer step `run.step + 1` on the k-th step share of `batch`; advances run.step.
    Returns the step's metrics (the same on every rank). `run`: a train.run.Run."""
    g, policy, opts = run.cfg.grpo, run.policy, run.loss
    vocab = policy.args.vocab_size
    t0 = time.perf_counter()
    full = collate(batch.steps[k])
    loss_mask = full["completion_mask"] & ~(full["truncated"][:, None]
                                            if g.overlong_filter else False)
    counts = count_partials(loss_mask, full["completion_mask"])
    norm = loss_normalizer(g.loss_type, counts, generation_counts=batch.gen_counts,
                           max_completion_length=g.max_completion_length)
    for c in policy.chunks:
        c.zero_grad_buffer()
    policy.optimizer.zero_grad()
    batches = micro_batches(batch.mine[k], run.cfg.training.micro_batch_size,
                            pad_to_length=batch.pad)
    # top_entropy_quantile: one threshold for the whole step (a forward pass).
    threshold = step_entropy_threshold(policy.chunks, batches, opts, vocab_size=vocab) \
        if opts.top_entropy_quantile < 1.0 else None
    with run.memory.phase("train"):
        parts = train_micro_batches(policy.chunks, batches, opts, normalizer=norm,
                                    vocab_size=vocab, entropy_threshold_value=threshold,
                                    step_counts=counts)
    with run.memory.phase("optimizer"):
        # Replicated kv heads (kv heads < TP) must get the sum of their replicas' gradients
        # before clipping and the update (model/kv_replication.py).
        sync_replicated_kv_grads(policy.chunks, policy.config, policy.args)
        _, grad_norm, _ = policy.optimizer.step()
    policy.scheduler.step(increment=1)
    run.step += 1
    metrics = step_metrics(parts, batch.gen, grad_norm, policy)
    metrics.update(moe_step_metrics(policy.config, len(batches)))  # MoE: load_balancing_loss
    metrics["timing/train"] = time.perf_counter() - t0
    metrics["timing/logprobs"] = batch.logprobs_seconds
    return metrics


def step_metrics(parts, gen, grad_norm, policy) -> dict:
    """Reduce the step's partials over DP on the last stage; every rank gets the result.

    Without pipeline parallelism every rank is a last stage and holds the reduction of its
    DP group, the same numbers in every group (TP and CP ranks hold the partials of the
    same completions): nothing more to exchange. With PP the last stage's result reaches
    the other stages in a pickled all-gather."""
    from megatron.core import parallel_state as ps

    reduced = None
    if is_last_stage():
        summed = reduce_partials(parts)
        reduced = {key: float(v) for key, v in finalize_metrics(summed).items()}
        if "loss" in summed["sum"]:   # the step loss: sum of every micro-batch's share
            reduced["loss"] = float(summed["sum"]["loss"])
    if ps.get_pipeline_model_parallel_world_size() == 1:
        metrics = dict(reduced)
    else:
        mine = reduced if (is_last_stage() and dist.get_rank() == dist.get_world_size() - 1) \
            else None
        found = [m for m in all_gather_objects(mine) if m is not None]
        metrics = dict(found[0]) if found else {}
    metrics.update(gen.metrics)
    metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
    metrics["learning_rate"] = policy.optimizer.param_groups[0]["lr"]
    return metrics
