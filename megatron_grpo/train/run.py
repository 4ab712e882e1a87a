"""A run: everything the loop's phases share, built once (`build_run`), and what the loop
records after each optimizer step (`log_and_save`) and at the end (`finish`).

    run = build_run(cfg)      # world, data, policy (+ resume), reference, rewards, vLLM, logger
    ... the loop (trainer.py) ...
    finish(run)               # final_hf/, the curve, vLLM shut down
"""
from __future__ import annotations

import functools
import os
import shutil
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch.distributed as dist

from bridge import export_hf_weights
from bridge.hf_checkpoint import copy_hf_side_files, write_hf_checkpoint
from megatron_grpo.model.lora_peft import gather_adapters, merged_stream, save_peft_adapter, vision_state

from .. import console
from .. import checkpoint as ckpt
from ..config.hf_model import context_length, model_config
from ..config.validate import teacher_servers
from ..data import (PromptSampler, drop_long_prompts, load_datasets, prompt_length,
                    render_prompt)
from ..data.vision import VisionProcessor, is_vision_language
from ..model.lora import lora_settings
from ..memory.measure import MemoryMeter, meter_for_rank
from ..memory.plan import FINAL_BUCKET_BYTES, FINAL_SHARD_BYTES
from ..rewards import build_reward_funcs, load_plugins
from ..rewards.reward_model import reward_model_funcs
from ..rewards.registry import flat_args
from ..rollout.sync import WeightSync
from ..rollout.teacher import ServedTeacher
from ..rollout.trajectory import MultiTurnRollout
from .engine import LossOptions
from .evaluate import build_evaluator
from .rollout_step import eval_teacher_kl
from .logger import RunLogger
from .setup import (Policy, build_parallel, build_policy, build_ref, build_sampler,
                    build_teacher,
                    loss_options, seed_everything, total_steps)


@dataclass
class Run:
    cfg: Any                     # config.GRPOConfig
    loss: LossOptions            # the loss options, built once
    policy: Policy               # chunks, optimizer, scheduler
    ref: Optional[list]          # frozen reference chunks (beta != 0), else None
    engine: Any                  # rollout.engine.RolloutEngine (colocated or a server client)
    sync: Any                    # rollout.sync.WeightSync: weights into vLLM, memory hand-over
    tokenizer: Any
    render: Callable             # (tokenizer, messages) -> prompt text
    dataset: Any                 # training prompts
    sampler: Any                 # data.PromptSampler: the next generation batch's prompts
    reward_funcs: list
    reward_names: list
    logger: Any                  # train.logger.RunLogger
    evaluator: Any               # train.evaluate.Evaluator, or None
    total_steps: int
    step: int                    # optimizer steps done (the resumed one after a resume)
    dp: int                      # data-parallel size and this rank's DP rank
    dp_rank: int
    multi_turn: Any = None       # rollout.trajectory.MultiTurnRollout (--multi_turn_scheduler)
    vision: Any = None           # data.vision.VisionProcessor (a dataset with images), or None
    # (RolloutBatch, index in the loop's schedule of its next step): the generation batch a
    # checkpoint saved mid-batch was training, for the loop to finish first; else None.
    pending: Any = None
    teacher: Optional[list] = None   # frozen teacher chunks (--teacher_model), else None
    served_teacher: Any = None       # rollout.teacher.ServedTeacher (--teacher_model_server)
    teacher_is_policy: bool = False  # OPSD without a teacher: `teacher` is the policy itself
    ref_is_other: bool = False       # --ref_model: `ref` is another model (own routing, R3)
    # Each phase's peak memory on this rank (memory/measure.py); a disabled one measures nothing
    memory: MemoryMeter = field(default_factory=lambda: MemoryMeter(enabled=False))

    @property
    def has_teacher(self) -> bool:
        return self.teacher is not None or self.served_teacher is not None

    @property
    def per_step(self) -> int:
        """Completions per optimizer step (= global_batch_size)."""
        g = self.cfg.grpo
        return g.generation_batch_size // g.steps_per_generation

    @property
    def dp_group(self) -> int:
        """Consecutive samples kept together on one DP rank (train/batch.py's layout):
        whole groups for loss_type real, whose loss compares a group's rows; else 1."""
        g = self.cfg.grpo
        return g.num_generations if g.loss_type == "real" else 1

    @property
    def kl_in_reward(self) -> bool:
        return bool(self.cfg.grpo.kl_in_reward) and self.cfg.grpo.beta != 0.0

    @property
    def teacher_offloaded(self) -> bool:
        """--offload_teacher_model with a teacher of its own (not the policy's base): held
        off the device except while it scores a rollout (rollout_step.fill_logps)."""
        return _teacher_offloaded(self.cfg, self.teacher, self.policy)

    @property
    def need_old_logps(self) -> bool:
        """Old log-probs: off-policy steps, kl_in_reward (the sampling policy's log-probs
        before the first update), or a teacher (its advantage term compares with them)."""
        g = self.cfg.grpo
        return (g.steps_per_generation > 1 or g.num_iterations > 1 or self.kl_in_reward
                or self.has_teacher)


def build_run(cfg) -> Run:
    """The run's pieces, in start-up order; vLLM holds the (resumed) policy afterwards."""
    from megatron.core import parallel_state as ps
    from transformers import AutoTokenizer

    g, t, log = cfg.grpo, cfg.training, cfg.logging
    loss = loss_options(cfg)   # first: a bad sapo/fipo option fails before any start-up
    build_parallel(cfg)
    seed_everything(t.seed, dist.get_rank())
    dataset, val_dataset = load_datasets(cfg.data, cfg.evaluation, seed=t.seed)   # val: or None
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.model)
    render = functools.partial(render_prompt, enable_thinking=cfg.data.enable_thinking)
    vision = _vision_processor(cfg, dataset, val_dataset)
    dataset = _drop_long_prompts(cfg, dataset, prompt_length(dataset, tokenizer, render, vision))
    served_teacher = _served_teacher(cfg, [d for d in (dataset, val_dataset) if d is not None])
    opsd = _teacher_prompts(dataset, val_dataset, vision)
    sampler = PromptSampler(len(dataset), g.generation_batch_size // g.num_generations,
                            seed=t.seed, shuffle=cfg.data.dataset_shuffle)
    steps = total_steps(cfg, len(dataset))
    policy = build_policy(cfg, steps)
    # LoRA: the reference is the policy with its adapters off (rollout_step.fill_logps), and
    # so is a teacher that is --model itself (ms-swift: no second model).
    lora = t.tuner_type in ("lora", "lora_llm")
    ref, ref_is_other = build_ref(cfg, policy, lora)
    teacher = build_teacher(cfg, policy, lora)
    teacher_is_policy = teacher is None and served_teacher is None and opsd
    has_teacher = teacher_is_policy or teacher is not None or served_teacher is not None
    if teacher_is_policy:     # ms-swift's dynamic self-distillation: the current weights
        teacher = policy.chunks
        if dist.get_rank() == 0:
            console.say("[megatron] teacher: the policy itself, scoring on each row's "
                        "teacher_prompt (OPSD, dynamic)")
    load_plugins(cfg.reward.external_plugins or [])
    reward_funcs = build_reward_funcs(cfg.reward.reward_funcs, cfg)
    reward_funcs += reward_model_funcs(cfg.reward.reward_models or [])
    reward_names = [f.name for f in reward_funcs]
    step = 0
    resume_from = resume_path(log.resume, log.output_dir)
    state = resume_from and ckpt.load_checkpoint(resume_from, policy.chunks, policy.optimizer,
                                                 policy.scheduler, finetune=log.finetune)
    pending = None
    if state:   # None: a fresh run, or --finetune (the weights only; step 0)
        step = int(state["step"])
        sampler.load_state_dict(state["sampler"])
        pending = _pending_batch(state.get("batch"), resume_from, has_teacher)
    # A fresh run keeps vLLM's seeding of the generators (every fresh run's stream); a resumed
    # one the states its checkpoint restored.
    engine = build_sampler_keeping_generators(cfg) if state else build_sampler(cfg)
    sync = WeightSync(policy, engine, cfg.rollout)
    # vLLM must hold the loaded policy, not the HF start (a start from a PEFT adapter too)
    if resume_from or sync.is_server or t.adapters:
        sync()
    logger = RunLogger(log.output_dir, steps, report_to=log.report_to,
                       logging_steps=log.logging_steps, log_completions=log.log_completions,
                       enabled=dist.get_rank() == 0, start_step=step,
                       last_row=state.get("metrics") if state else None,
                       wandb_project=log.wandb_project, wandb_exp_name=log.wandb_exp_name,
                       swanlab_project=log.swanlab_project, swanlab_exp_name=log.swanlab_exp_name)
    multi_turn = build_multi_turn(cfg, tokenizer)
    teacher_kl = functools.partial(
        eval_teacher_kl, policy_chunks=policy.chunks, teacher=teacher,
        micro_batch_size=t.micro_batch_size, temperature=loss.temperature,
        vocab_size=policy.args.vocab_size,
        offload_teacher=_teacher_offloaded(cfg, teacher, policy),
        teacher_is_policy=teacher_is_policy, pad_multiple=policy.pad_multiple) \
        if has_teacher else None
    evaluator = build_evaluator(cfg, val_dataset, engine=engine, tokenizer=tokenizer,
                                render=render, reward_funcs=reward_funcs,
                                reward_names=reward_names, total_steps=steps,
                                sync=sync, logger=logger, multi_turn=multi_turn, vision=vision,
                                served_teacher=served_teacher, teacher_kl=teacher_kl)
    return Run(cfg, loss, policy, ref, engine, sync, tokenizer, render, dataset, sampler,
               reward_funcs, reward_names, logger, evaluator, steps, step,
               ps.get_data_parallel_world_size(), ps.get_data_parallel_rank(),
               multi_turn=multi_turn, vision=vision, pending=pending, teacher=teacher,
               served_teacher=served_teacher, teacher_is_policy=teacher_is_policy,
               ref_is_other=ref_is_other, memory=meter_for_rank(dist.get_rank()))


def _teacher_prompts(dataset, val_dataset, vision) -> bool:
    """Whether a row of the datasets has a `teacher_prompt` (OPSD: the teacher scores its
    samples behind that prompt); refused with images (their tokens are in the prompt)."""
    opsd = any(v for d in (dataset, val_dataset) if d is not None
               for v in d.columns.get("teacher_prompt") or ())
    if opsd and vision is not None:
        raise ValueError("a dataset row has a teacher_prompt (OPSD) and the prompts have images: "
                         "OPSD takes text prompts only here. Fix: drop the teacher_prompt column")
    return opsd


def _teacher_offloaded(cfg, teacher, policy) -> bool:
    return bool(cfg.rollout.offload_teacher_model and teacher is not None
                and teacher is not policy.chunks)


def _served_teacher(cfg, datasets):
    """--teacher_model_server's teachers, reachable and long enough for the samples, one for
    every prompt of `datasets`; None without them. Before the models: a quick failure."""
    if cfg.model.teacher_model_server is None:
        return None
    v, g = cfg.rollout, cfg.grpo
    # The longest sample: the sampler's context, or (single-turn) a whole prompt and completion
    longest = v.vllm_max_model_len or context_length(model_config(cfg.model.model).language,
                                                     cfg.model.model)
    if v.multi_turn_scheduler is None and cfg.data.max_length:
        longest = min(longest, cfg.data.max_length + g.max_completion_length)
    teacher = ServedTeacher(teacher_servers(cfg.model.teacher_model_server), datasets,
                            tag_key=cfg.model.teacher_tag_key, timeout=v.vllm_server_timeout,
                            max_sequence=longest)
    if dist.get_rank() == 0:
        console.say(f"[megatron] teacher: served at {teacher.describe()} (scores at temperature "
                    f"1{'' if v.temperature == 1 else f'; sampling at {v.temperature:g}'})")
    return teacher


def _layout() -> dict:
    """What a saved generation batch depends on: this rank's place in the world (its DP
    share and log-probs, the micro-batch padding under sequence parallelism)."""
    from megatron.core import parallel_state as ps

    return {"world": dist.get_world_size(), "rank": dist.get_rank(),
            "tp": ps.get_tensor_model_parallel_world_size(),
            "pp": ps.get_pipeline_model_parallel_world_size(),
            "dp": ps.get_data_parallel_world_size()}


def _pending_batch(saved: Optional[dict], path: str, teacher: bool = False):
    """(RolloutBatch, next schedule index) from a checkpoint saved in the middle of a
    generation batch, when this run's layout is the saving one's and it has a teacher
    (--teacher_model, --teacher_model_server, OPSD's) where that batch's samples have the
    teacher's log-probs; else None."""
    if saved is None:
        return None
    scored = saved.get("teacher") is not None      # (the same on every rank)
    if saved["layout"] != _layout():
        why = f"by another layout ({saved['layout']}, now {_layout()})"
    elif scored != teacher:
        why = (f"{'with' if scored else 'without'} a teacher, and this run has "
               f"{'none' if scored else 'one'}")
    else:
        return saved["rollout"], saved["next"]
    if dist.get_rank() == 0:
        console.warn(f"[megatron] warning: {path} was saved in the middle of a generation batch "
                     f"{why}: the rest of that batch is not trained; the run continues with a new "
                     "rollout")
    return None


def _vision_processor(cfg, dataset, val_dataset):
    """The model's processor with the run's pixel budget when a dataset has images (None
    otherwise); checked before the model is built."""
    if all(d is None or d.images is None for d in (dataset, val_dataset)):
        return None
    if not is_vision_language(cfg.model.model):
        raise ValueError(f"--dataset has an `images` column, but --model {cfg.model.model} is not "
                         "a vision-language model (allowed: a Qwen2.5-VL or Qwen2-VL checkpoint; or drop the "
                         "images)")
    if cfg.rollout.multi_turn_scheduler is not None:
        raise ValueError(f"--multi_turn_scheduler {cfg.rollout.multi_turn_scheduler}: multi-turn "
                         "rollouts take no images yet; the dataset has an `images` column")
    vision = VisionProcessor(cfg.model.model, cfg.data.max_pixels)
    vision.check_placeholders(dataset, "--dataset")      # before any model or engine
    vision.check_placeholders(val_dataset, "--val_dataset")
    return vision


def build_multi_turn(cfg, tokenizer):
    """The multi-turn sampler of --multi_turn_scheduler, or None (one completion each)."""
    r = cfg.rollout
    if r.multi_turn_scheduler is None:
        return None
    return MultiTurnRollout(tokenizer, multi_turn_scheduler=r.multi_turn_scheduler,
                            max_turns=r.max_turns, max_length=cfg.data.max_length,
                            gym_env=r.gym_env, enable_thinking=cfg.data.enable_thinking,
                            args=flat_args(cfg),
                            max_total_completion=cfg.grpo.max_completion_length
                            if r.completion_length_limit_scope == "total" else None,
                            loss_scale=r.loss_scale)


def _drop_long_prompts(cfg, dataset, length):
    """--truncation_strategy delete: the prompts longer than --max_length go (an image
    prompt counted with its image tokens: it would stop the run when sampled)."""
    if not (cfg.data.max_length and cfg.data.truncation_strategy == "delete"):
        return dataset
    dataset, dropped = drop_long_prompts(dataset, length, cfg.data.max_length)
    if dist.get_rank() == 0 and dropped:
        console.say(f"[megatron] --truncation_strategy delete: dropped {dropped} prompts longer "
                    f"than --max_length {cfg.data.max_length}; {len(dataset)} left")
    return dataset


def build_sampler_keeping_generators(cfg):
    """build_sampler, the generators (python, numpy, torch, Megatron's tracker) left as they
    were: a colocated vLLM engine seeds this process's (its set_random_seed), which would
    replace the states a checkpoint just restored."""
    states = ckpt.collect_rng_state()
    engine = build_sampler(cfg)
    ckpt.restore_rng_state(states)
    return engine


def resume_path(resume: Optional[str], out_dir: str) -> Optional[str]:
    """The checkpoint to start from for --resume as validated (config/validate.py): a
    checkpoint folder, or the newest of an earlier run's output_dir; None (unset) or
    "auto": the newest in this run's output_dir, if any; "false": none, a new run."""
    if resume in (None, "auto"):
        return ckpt.find_latest_checkpoint(out_dir)
    return None if resume == "false" else ckpt.checkpoint_in(resume)


def log_and_save(run: Run, batch, metrics: dict, *, first_of_batch: bool,
                 next_in_batch: Optional[int] = None) -> None:
    """After optimizer step `run.step`: its metrics; the generation batch's completions
    (once per batch); a checkpoint every save_steps steps and after the last.
    `next_in_batch`: the schedule index of the batch's next step, None after its last; a
    checkpoint saved mid-batch holds the batch, so that a resume trains the rest of it (as
    the uninterrupted run does) before the next rollout."""
    log = run.cfg.logging
    if first_of_batch:
        gen = batch.gen
        index = [s.meta["prompt_index"] for s in gen.samples]
        extra = {"prompt_index": index}
        if "solution" in run.dataset.columns:    # as ms-swift's completions table
            extra["solution"] = [run.dataset.columns["solution"][i] for i in index]
        if run.multi_turn is not None:           # the whole trajectory, with roles
            extra["messages"] = [s.meta["messages"] for s in gen.samples]
            extra["num_turns"] = [s.meta["num_turns"] for s in gen.samples]
        if run.vision is not None:               # the prompt's image tokens the trainer fed
            extra["image_tokens"] = [0 if s.images is None else int(s.images.image_mask.sum())
                                     for s in gen.samples]
        run.logger.completions(run.step, gen.prompts, gen.texts, gen.rewards_per_func.tolist(),
                               run.reward_names, extra=extra)
    if run.step % log.save_steps == 0 or run.step >= run.total_steps:
        with run.memory.phase("save"):
            p = run.policy
            # The step's row goes to metrics.jsonl after the save (memory/save is part of
            # it); a crash in between must not lose it: a resume writes this copy.
            state = {"step": run.step, "sampler": run.sampler.state_dict(),
                     "config": run.cfg.to_flat(),
                     "metrics": {**metrics, **run.memory.local_metrics()}}
            if next_in_batch is not None and run.step < run.total_steps:
                state["batch"] = {"rollout": batch, "next": next_in_batch, "layout": _layout(),
                                  "teacher": True if run.has_teacher else None}
            ckpt.save_checkpoint(log.output_dir, run.step, p.chunks, p.optimizer, p.scheduler,
                                 state,
                                 save_total_limit=log.save_total_limit,
                                 save_optim=not log.no_save_optim, save_rng=not log.no_save_rng,
                                 hf_config_dir=run.cfg.model.model,
                                 optim_sharding_type="fully_reshardable"
                                 if log.dist_ckpt_optim_fully_reshardable else "dp_reshardable",
                                 mem_efficient=log.distrib_optim_fully_reshardable_mem_efficient)
    # The step's row after its checkpoint: memory/save is part of it.
    metrics.update(run.memory.step_metrics(run.step))
    run.logger.log(run.step, metrics)


def finish(run: Run, close_engine: bool = True) -> None:
    """The curve, the trained model as final_hf/, vLLM shut down (unless the process
    exits right after: `close_engine=False`)."""
    out_dir = run.cfg.logging.output_dir
    png = run.logger.close()
    with run.memory.phase("export"):
        save_final_hf(run.policy, run.cfg.model.model, out_dir,
                      merge_lora=run.cfg.training.merge_lora)
    peak = run.memory.step_metrics(run.step).get("memory/export")
    if dist.get_rank() == 0:
        console.say(f"[megatron] done: {run.step} steps; metrics in {out_dir}/metrics.jsonl"
                    + (f", curve {png}" if png else "")
                    + (f"; final_hf/ written at a peak of {peak:.2f} GiB per rank" if peak else ""))
    if close_engine:
        run.engine.close()


def save_final_hf(policy: Policy, hf_source: str, out_dir: str, merge_lora: bool = True) -> None:
    """The trained model as an HF checkpoint in out_dir/final_hf (the bridge's one writer:
    safetensors, an index when sharded, plus the source's config and tokenizer files). A
    LoRA model: merged (W + scale B A) with merge_lora, else the PEFT adapter files.
    Collective: every rank iterates the export; rank 0 writes, then renames atomically."""
    final = os.path.join(out_dir, "final_hf")
    rank0 = dist.get_rank() == 0
    if rank0:   # a folder left by a crashed export would add its stale files to this one
        shutil.rmtree(final + ".tmp", ignore_errors=True)
        os.makedirs(final + ".tmp")
    settings = lora_settings(policy.chunks)
    if settings is not None and not merge_lora:   # LoRA: the PEFT adapter, no base weights
        factors = gather_adapters(policy.chunks)
        if rank0:   # lora_llm: rank 0 (first pipeline stage) holds the trained tower
            factors.update(vision_state(policy.chunks))
            save_peft_adapter(final + ".tmp", factors, settings, base_model=hf_source)
    else:
        stream = merged_stream(policy.chunks, export_hf_weights(
            policy.chunks, policy.config, policy.args, bucket_size_bytes=FINAL_BUCKET_BYTES))
        # Rank 0 holds one shard besides the bucket: together less than the training step's
        # transients (the memory plan's "final export" line).
        write_hf_checkpoint(stream, final + ".tmp", max_shard_size=FINAL_SHARD_BYTES, write=rank0)
        if rank0:
            # config (naming the weights' dtype), tokenizer; no weights
            copy_hf_side_files(hf_source, final + ".tmp", dtype=policy.config.params_dtype)
    if rank0:
        if os.path.isdir(final):
            shutil.rmtree(final)
        os.replace(final + ".tmp", final)
    dist.barrier()
