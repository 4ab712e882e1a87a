"""The GRPO loop (DESIGN.md "One training step"):

    generate -> score -> advantages -> old/ref log-probs -> train -> sync -> log/save

Every rank holds the whole generation batch (train/rollout_step.py); data-parallel
rank d trains on every dp-th completion of each optimizer step. Megatron-specific
scaling lives in train/engine.py; the math in algorithms/.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import time

import torch
import torch.distributed as dist

from .algorithms import count_partials, finalize_metrics, loss_normalizer
from .algorithms.policy_loss import LossTypeParams
from .train import (LossOptions, forward_logprobs, micro_batches, reduce_partials,
                    step_entropy_threshold)
from .train.batch import collate, split_completion_values
from .train.engine import is_last_stage, train_micro_batches
from .train.evaluate import build_evaluator
from .model.kv_replication import sync_replicated_kv_grads
from .train.logger import RunLogger
from .train.rollout_step import (all_gather_objects, collect_rollouts, finish_batch,
                                 generate_and_score)
from .train.setup import (build_parallel, build_policy, build_reference, build_sampler,
                          seed_everything, total_steps)


def _loss_options(cfg) -> LossOptions:
    g, r = cfg.grpo, cfg.rollout
    return LossOptions(
        loss_type=g.loss_type, epsilon=g.epsilon, epsilon_high=g.epsilon_high, delta=g.delta,
        importance_sampling_level=g.importance_sampling_level, beta=g.beta,
        kl_estimator=g.kl_estimator, kl_in_reward=bool(g.kl_in_reward),
        top_entropy_quantile=g.top_entropy_quantile, overlong_filter=g.overlong_filter,
        rollout_importance_sampling_mode=g.rollout_importance_sampling_mode,
        rollout_importance_sampling_threshold=g.rollout_importance_sampling_threshold,
        temperature=r.temperature, log_entropy=g.log_entropy,
        loss_params=LossTypeParams(**{f.name: getattr(g, f.name) for f in dataclasses.fields(LossTypeParams)}))


def _per_token(chunks, batches, samples, field, temperature, vocab_size):
    """Fill samples' `field` with per-token log-probs (last pipeline stage only)."""
    outs = forward_logprobs(chunks, batches, temperature=temperature, vocab_size=vocab_size)
    if outs is None:
        return
    mbs = len(samples) // len(batches)
    for b, (batch, out) in enumerate(zip(batches, outs)):
        for i, values in enumerate(split_completion_values(out["logps"], batch)):
            setattr(samples[b * mbs + i], field, values)


def fill_logps(policy_chunks, ref, mine, mbs: int, pad: int, *, need_old: bool,
               temperature: float, vocab_size: int) -> None:
    """Old (sampling-policy) and reference log-probs of this rank's samples (`mine`: one
    list per optimizer step), before any update of the generation batch."""
    for part in mine:
        batches = micro_batches(part, mbs, pad_to_length=pad)
        if need_old:
            _per_token(policy_chunks, batches, part, "old_logps", temperature, vocab_size)
        if ref is not None:
            _per_token(ref, batches, part, "ref_logps", temperature, vocab_size)


def reward_kl_values(mine, n: int, per_step: int, dp: int, dp_rank: int) -> torch.Tensor:
    """The sequence KL of every sample of the generation batch ([n] float64, the same on
    every rank), for `kl_in_reward`: sum over the completion of old - ref log-probs.

    `mine[k]` are this data rank's samples of optimizer step k (every dp-th one), whose
    old_logps / ref_logps `fill_logps` set on the last pipeline stage; sample i of
    mine[k] is sample k * per_step + dp_rank + dp * i of the batch. One rank per data
    rank (last stage, TP and CP rank 0) contributes its values; all ranks gather them.
    """
    from megatron.core import parallel_state as ps

    from .algorithms import sequence_kl_for_reward

    local = {}
    if is_last_stage() and ps.get_tensor_model_parallel_rank() == 0 and \
            ps.get_context_parallel_rank() == 0:
        for k, part in enumerate(mine):
            for i, s in enumerate(part):
                old, ref = s.old_logps.double()[None], s.ref_logps.double()[None]
                kl = sequence_kl_for_reward(old, ref, torch.ones_like(old, dtype=torch.bool))
                local[k * per_step + dp_rank + dp * i] = float(kl[0])
    merged = {}
    for part in all_gather_objects(local):
        merged.update(part)
    missing = [j for j in range(n) if j not in merged]
    if missing:
        raise RuntimeError(f"kl_in_reward: no sequence KL for samples {missing[:8]} of {n}")
    return torch.tensor([merged[j] for j in range(n)], dtype=torch.float64)


def sync_weights(policy, engine, cfg, is_server: bool) -> dict:
    """Stream the policy's HF weights into vLLM (every rank iterates: the export is
    collective); optionally prove vLLM holds them."""
    from bridge import export_hf_weights

    from .rollout.verify import StreamFingerprints, check_weight_sync
    from .rollout.weights import load_weight_stream

    r = cfg.rollout
    if not is_server:   # vLLM slept through training (sleep_level > 0): weights back first
        from .rollout.weights import wake_up

        wake_up(engine, level=r.sleep_level)
    from .platform import device

    params = [p for c in policy.chunks for p in c.parameters()]
    total = sum(p.numel() * p.element_size() for p in params)
    total = torch.tensor(float(total), device=device())   # NCCL reduces device tensors only
    dist.all_reduce(total)   # an upper bound of the HF model's bytes (TP/PP shards summed)
    bucket = int(total.item() // r.move_model_batches) + 1 if r.move_model_batches else 512 << 20
    if policy.staging is None:   # one bucket buffer for every sync (allocating it is slow)
        from bridge import BucketBuffer

        policy.staging = BucketBuffer("cpu" if r.offload_bridge else params[0].device)
    stream = export_hf_weights(policy.chunks, policy.config, policy.args,
                               bucket_size_bytes=bucket, offload_bridge=r.offload_bridge,
                               staging=policy.staging)
    expected = StreamFingerprints() if r.check_weight_sync else None
    if expected is not None:
        stream = expected.watch(stream)
    if is_server and dist.get_rank() != 0:
        for _ in stream:          # take part in the collectives; rank 0 does the upload
            pass
        info = {}
    else:
        info = load_weight_stream(engine, stream)
        if expected is not None:
            check_weight_sync(engine, expected.result)
    dist.barrier()
    return info


def _sink_names(log) -> dict:
    """wandb / swanlab project and run names (ms-swift's options)."""
    return dict(wandb_project=log.wandb_project, wandb_exp_name=log.wandb_exp_name,
                swanlab_project=log.swanlab_project, swanlab_exp_name=log.swanlab_exp_name)


def train(cfg) -> None:
    from transformers import AutoTokenizer

    from .data import PromptSampler, load_datasets, render_prompt
    from .rewards import build_reward_funcs, load_plugins

    g, t = cfg.grpo, cfg.training
    opts = _loss_options(cfg)   # first: a bad sapo/fipo option fails before any start-up
    build_parallel(cfg)
    rank = dist.get_rank()
    seed_everything(t.seed, rank)
    from megatron.core import parallel_state as ps

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    dataset, val_dataset = load_datasets(cfg.data, cfg.evaluation, seed=t.seed)   # val: or None
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.model)
    render_prompt = functools.partial(render_prompt, enable_thinking=cfg.data.enable_thinking)
    if cfg.data.max_length and cfg.data.truncation_strategy == "delete":
        from .data import drop_long_prompts

        dataset, dropped = drop_long_prompts(dataset, lambda m: len(tokenizer(
            render_prompt(tokenizer, m), add_special_tokens=False)["input_ids"]),
            cfg.data.max_length)
        if rank == 0 and dropped:
            print(f"[megatron-grpo] --truncation_strategy delete: dropped {dropped} prompts longer "
                  f"than --max_length {cfg.data.max_length}; {len(dataset)} left", flush=True)
    sampler = PromptSampler(len(dataset), g.generation_batch_size // g.num_generations,
                            seed=t.seed, shuffle=cfg.data.dataset_shuffle)
    steps = total_steps(cfg, len(dataset))
    policy = build_policy(cfg, steps)
    ref = build_reference(cfg) if g.beta != 0.0 else None
    load_plugins(cfg.reward.external_plugins or [])
    reward_funcs = build_reward_funcs(cfg.reward.reward_funcs, cfg)
    reward_names = list(cfg.reward.reward_funcs)
    out_dir = cfg.logging.output_dir
    from . import checkpoint as ckpt

    step = 0
    resume_from = _resume_path(cfg.logging.resume, out_dir)
    state = resume_from and ckpt.load_checkpoint(resume_from, policy.chunks, policy.optimizer,
                                                 policy.scheduler, finetune=cfg.logging.finetune)
    if state:   # None: a fresh run, or --finetune (the weights only; step 0)
        step = int(state["step"])
        sampler.load_state_dict(state["sampler"])
    is_server = cfg.rollout.vllm_mode == "server"
    engine = build_sampler(cfg)
    if resume_from or is_server:   # vLLM must hold the (resumed) policy, not the HF start
        sync_weights(policy, engine, cfg, is_server)
    logger = RunLogger(out_dir, steps, report_to=cfg.logging.report_to,
                       logging_steps=cfg.logging.logging_steps,
                       log_completions=cfg.logging.log_completions, enabled=rank == 0,
                       start_step=step, **_sink_names(cfg.logging))
    evaluator = build_evaluator(cfg, val_dataset, engine=engine, tokenizer=tokenizer,
                                render=render_prompt, reward_funcs=reward_funcs,
                                reward_names=reward_names, policy=policy, total_steps=steps,
                                sync=lambda: sync_weights(policy, engine, cfg, is_server),
                                logger=logger)
    vocab = policy.args.vocab_size
    per_step = g.generation_batch_size // g.steps_per_generation    # = global_batch_size
    mbs = t.micro_batch_size
    kl_reward = bool(g.kl_in_reward) and g.beta != 0.0
    # kl_in_reward needs the sampling policy's log-probs before the first update too.
    need_old = g.steps_per_generation > 1 or g.num_iterations > 1 or kl_reward
    t_last = time.perf_counter()     # timing/step: wall time between consecutive steps
    while step < steps:
        # 1-4: rollouts for the next steps_per_generation optimizer steps.
        _before_generation(cfg, policy, engine)
        gen = collect_rollouts(
            lambda: generate_and_score(
                engine=engine, tokenizer=tokenizer, dataset=dataset,
                prompt_indices=sampler.next_batch(), reward_funcs=reward_funcs,
                num_generations=g.num_generations, render=render_prompt,
                max_prompt_length=cfg.data.max_length),
            g.generation_batch_size // g.num_generations, g.num_generations,
            dynamic_sample=g.dynamic_sample, max_resample_times=g.max_resample_times,
            reward_weights=cfg.reward.reward_weights)
        _after_generation(cfg, policy, engine)
        samples = gen.samples
        steps_data = [samples[k * per_step:(k + 1) * per_step] for k in range(g.steps_per_generation)]
        mine = [sl[dp_rank::dp] for sl in steps_data]
        pad = max(len(s.prompt_ids) + len(s.completion_ids) - 1 for s in samples)
        if policy.config.sequence_parallel:   # the sequence is split over TP ranks
            tp = cfg.parallel.tensor_model_parallel_size
            pad = -(-pad // tp) * tp
        # 5: old (off-policy) and reference log-probs, before any update of this batch
        # (and before the advantages: with kl_in_reward the KL is part of the reward).
        t0 = time.perf_counter()
        fill_logps(policy.chunks, ref, mine, mbs, pad, need_old=need_old,
                   temperature=opts.temperature, vocab_size=vocab)
        kl_values = reward_kl_values(mine, len(samples), per_step, dp, dp_rank) \
            if kl_reward else None
        t_logprobs = time.perf_counter() - t0
        gen = finish_batch(gen, g.num_generations, reward_names=reward_names,
                           reward_weights=cfg.reward.reward_weights,
                           advantage_estimator=g.advantage_estimator,
                           scale_rewards=g.scale_rewards, kl_in_reward=bool(g.kl_in_reward),
                           beta=g.beta, kl_values=kl_values)
        gen_mask = collate(samples)["completion_mask"]
        gen_counts = count_partials(gen_mask, gen_mask)
        # 6: optimizer steps.
        for it in range(g.num_iterations):
            for k in range(g.steps_per_generation):
                if step >= steps:
                    break
                t0 = time.perf_counter()
                full = collate(steps_data[k])
                loss_mask = full["completion_mask"] & ~(full["truncated"][:, None]
                                                        if g.overlong_filter else False)
                norm = loss_normalizer(g.loss_type, count_partials(loss_mask,
                                                                   full["completion_mask"]),
                                       generation_counts=gen_counts,
                                       max_completion_length=g.max_completion_length)
                for c in policy.chunks:
                    c.zero_grad_buffer()
                policy.optimizer.zero_grad()
                batches = micro_batches(mine[k], mbs, pad_to_length=pad)
                # top_entropy_quantile: one threshold for the whole step (a forward pass).
                threshold = step_entropy_threshold(policy.chunks, batches, opts,
                                                   vocab_size=vocab) \
                    if opts.top_entropy_quantile < 1.0 else None
                parts = train_micro_batches(policy.chunks, batches, opts, normalizer=norm,
                                            vocab_size=vocab, entropy_threshold_value=threshold)
                # Replicated kv heads (kv heads < TP) must get the sum of their replicas'
                # gradients before clipping and the update (model/kv_replication.py).
                sync_replicated_kv_grads(policy.chunks, policy.config, policy.args)
                ok, grad_norm, _ = policy.optimizer.step()
                policy.scheduler.step(increment=1)
                step += 1
                metrics = _step_metrics(parts, gen, grad_norm, policy, k)
                metrics["timing/train"] = time.perf_counter() - t0
                metrics["timing/logprobs"] = t_logprobs
                # vLLM needs the weights before the next generation only: after the last
                # step of the last iteration over this batch.
                if (it == g.num_iterations - 1 and k == g.steps_per_generation - 1) \
                        or step >= steps:
                    t0 = time.perf_counter()
                    sync_weights(policy, engine, cfg, is_server)   # 7: vLLM gets the update
                    metrics["timing/sync"] = time.perf_counter() - t0
                if evaluator:    # held-out prompts, every eval_steps steps and after the last
                    fresh = "timing/sync" in metrics            # vLLM holds this step's weights
                    metrics.update(evaluator.maybe_evaluate(step, vllm_fresh=fresh))
                now = time.perf_counter()
                metrics["timing/step"], t_last = now - t_last, now
                logger.log(step, metrics)
                if k == 0 and it == 0:     # once per generation batch
                    index = [s.meta["prompt_index"] for s in samples]
                    extra = {"prompt_index": index}
                    if "solution" in dataset.columns:    # as ms-swift's completions table
                        extra["solution"] = [dataset.columns["solution"][i] for i in index]
                    logger.completions(step, gen.prompts, gen.texts, gen.rewards_per_func.tolist(),
                                       reward_names, extra=extra)
                if step % cfg.logging.save_steps == 0 or step >= steps:
                    ckpt.save_checkpoint(out_dir, step, policy.chunks, policy.optimizer,
                                         policy.scheduler,
                                         {"step": step, "sampler": sampler.state_dict(),
                                          "config": cfg.to_flat()},
                                         save_total_limit=cfg.logging.save_total_limit,
                                         save_optim=not cfg.logging.no_save_optim,
                                         save_rng=not cfg.logging.no_save_rng,
                                         hf_config_dir=cfg.model.model)
    png = logger.close()
    _save_final_hf(policy, cfg, out_dir)
    if rank == 0:
        print(f"[megatron-grpo] done: {step} steps; metrics in {out_dir}/metrics.jsonl"
              + (f", curve {png}" if png else ""), flush=True)
    engine.close()


def _before_generation(cfg, policy, engine) -> None:
    """Colocate mode: free the trainer's memory for vLLM (awake since its last sync)."""
    from .rollout.offload import offload_model, offload_optimizer

    r = cfg.rollout
    if policy.staging is not None and policy.staging.device.type != "cpu":
        policy.staging = None       # the sync's bucket buffer: accelerator memory for vLLM
    if r.vllm_mode != "colocate":
        return                      # a server has its own memory
    if r.offload_model:
        offload_model(policy.chunks)
    if r.offload_optimizer:
        offload_optimizer(policy.optimizer)


def _after_generation(cfg, policy, engine) -> None:
    """Colocate mode: put vLLM to sleep and bring the trainer's state back."""
    from .rollout.offload import onload_model, onload_optimizer
    from .rollout.weights import sleep

    r = cfg.rollout
    if r.vllm_mode != "colocate":
        return
    sleep(engine, r.sleep_level)
    if r.offload_optimizer:
        onload_optimizer(policy.optimizer)
    if r.offload_model:
        onload_model(policy.chunks)


def _resume_path(resume, out_dir: str):
    """--resume PATH, or (unset / true / auto) the newest checkpoint in output_dir."""
    from .checkpoint import find_latest_checkpoint

    if resume in (None, "", "auto", "true", "True", True):
        return find_latest_checkpoint(out_dir) if os.path.isdir(out_dir) else None
    if resume in ("false", "False", False, "none"):
        return None
    if not os.path.isdir(resume):
        raise ValueError(f"--resume {resume!r}: no such checkpoint folder")
    return resume


def _step_metrics(parts, gen, grad_norm, policy, k) -> dict:
    """Reduce the step's partials over DP on the last stage; every rank gets the result."""
    reduced = None
    if is_last_stage():
        summed = reduce_partials(parts)
        reduced = {key: float(v) for key, v in finalize_metrics(summed).items()}
        if "loss" in summed["sum"]:   # the step loss: sum of every micro-batch's share
            reduced["loss"] = float(summed["sum"]["loss"])
    mine = reduced if (is_last_stage() and dist.get_rank() == dist.get_world_size() - 1) else None
    found = [m for m in all_gather_objects(mine) if m is not None]
    metrics = dict(found[0]) if found else {}
    metrics.update(gen.metrics)
    metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
    metrics["learning_rate"] = policy.optimizer.param_groups[0]["lr"]
    metrics.update(gen.timing if k == 0 else {})
    return metrics


def _save_final_hf(policy, cfg, out_dir: str) -> None:
    """The trained model as an HF checkpoint (safetensors + the source's config/tokenizer)."""
    import json
    import shutil

    from bridge import export_hf_weights
    from safetensors.torch import save_file

    final = os.path.join(out_dir, "final_hf")
    rank0 = dist.get_rank() == 0
    if rank0:
        os.makedirs(final + ".tmp", exist_ok=True)
    index, shard = {}, 0
    for bucket in export_hf_weights(policy.chunks, policy.config, policy.args,
                                    bucket_size_bytes=1 << 30):
        if rank0:
            name = f"model-{shard:05d}.safetensors"
            save_file({k: v.contiguous() for k, v in bucket}, os.path.join(final + ".tmp", name),
                      metadata={"format": "pt"})
            index.update({k: name for k, _ in bucket})
        shard += 1
    if rank0:
        with open(os.path.join(final + ".tmp", "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": index}, f, indent=1)
        from bridge.convert import copy_hf_side_files

        copy_hf_side_files(cfg.model.model, final + ".tmp")   # config, tokenizer; no weights
        if os.path.isdir(final):
            shutil.rmtree(final)
        os.replace(final + ".tmp", final)
    dist.barrier()
