"""Building a run from its config, in order.

    dims = build_parallel(cfg)                       # torch.distributed + Megatron groups
    model = build_policy(cfg)                        # chunks (DDP), optimizer, scheduler
    ref = build_reference(cfg, model) if beta > 0    # frozen chunks, same layout
    teacher = build_teacher(cfg, model, lora)        # --teacher_model: frozen, same layout
    engine = build_sampler(cfg)                      # colocated vLLM or a server client

Options travel whole: `loss_options(cfg)` and `engine_settings(cfg)` read each stage's
options once, by field name, into the frozen object that stage takes.
"""
from __future__ import annotations

import dataclasses
import os
import random
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.distributed as dist

from bridge import load_hf_weights
from bridge.mappings.vision import sync_filter

from .. import console
from ..algorithms import LossTypeParams
from ..config.hf_model import model_config, num_experts
from ..data.vision import resolve_max_pixels
from ..model import build_model, build_transformer_config, wrap_ddp
from ..model.freeze import check_and_summarise, freeze_parameters
from ..model.kv_replication import count_kv_once_in_grad_norm
from ..model.lora import LoraSettings, apply_lora, parse_modules_to_save, parse_target_modules
from ..model.moe import MoEOptions
from ..platform import ParallelDims, init_parallel, init_process_group
from ..rollout.colocate import ColocateEngine, EngineSettings
from ..rollout.kv_cache import sequences_per_engine
from ..rollout.offload import offload_model
from .engine import LossOptions


@dataclass
class Policy:
    config: Any          # TransformerConfig
    args: Any            # ModelArgs
    chunks: list         # DDP-wrapped GPTModel chunks of this rank
    optimizer: Any
    scheduler: Any
    # HF names a weight sync streams (bridge.export_hf_weights `include`); None: all. A
    # vision-language model's frozen vision weights never change: left out.
    sync_include: Any = None

    @property
    def pad_multiple(self) -> int:
        """What a micro-batch's length is a multiple of: the TP size under sequence
        parallelism (the sequence is split over the TP ranks), else 1."""
        return self.config.tensor_model_parallel_size if self.config.sequence_parallel else 1


def loss_options(cfg) -> LossOptions:
    """The loss options of the run: every `LossOptions` / `LossTypeParams` field from the
    grpo options of the same name, the temperature from the rollout options. A bad value
    fails here, before any start-up."""
    g = cfg.grpo
    names = {f.name for f in dataclasses.fields(LossOptions)} - {"loss_params", "temperature"}
    values = {name: getattr(g, name) for name in names}
    values["kl_in_reward"] = bool(g.kl_in_reward)          # None (unset): off
    params = LossTypeParams(**{f.name: getattr(g, f.name) for f in dataclasses.fields(LossTypeParams)})
    return LossOptions(**values, temperature=cfg.rollout.temperature, loss_params=params)


def build_parallel(cfg):
    init_process_group()
    dims = ParallelDims.from_options(cfg.parallel, dist.get_world_size())
    return init_parallel(dims, seed=cfg.training.seed)


def _dtype(cfg) -> str:
    if cfg.training.bf16:
        return "bfloat16"
    return "float32"


def transformer_config(cfg, model: Optional[str] = None):
    """(TransformerConfig, ModelArgs) of --model in the run's layout, or of `model` (the
    teacher) in the same one: forward only (no recompute), its experts, if any, over the
    same EP and routing for themselves. The trainer's and the dry run's."""
    p, t = cfg.parallel, cfg.training
    option = "model" if not model else \
        "teacher_model" if model == cfg.model.teacher_model else "ref_model"
    hf = model_config(model or cfg.model.model, option)      # errors name the option
    experts = dict(ep=p.expert_model_parallel_size, etp=p.expert_tensor_parallel_size,
                   moe=MoEOptions.from_config(cfg))
    if model:
        experts = (dict(experts, moe=dataclasses.replace(experts["moe"], routing_replay=False))
                   if num_experts(hf.language) else {})
    return build_transformer_config(
        hf, tp=p.tensor_model_parallel_size,
        pp=p.pipeline_model_parallel_size, vpp=p.virtual_pipeline_model_parallel_size,
        cp=p.context_parallel_size, sequence_parallel=p.sequence_parallel, dtype=_dtype(cfg),
        recompute=None if model else dict(
            recompute_granularity=t.recompute_granularity, recompute_method=t.recompute_method,
            recompute_num_layers=t.recompute_num_layers, recompute_modules=recompute_modules_of(t)),
        attention_backend=cfg.model.attention_backend, **experts)


def build_chunks(cfg, load_weights: bool = True, model: Optional[str] = None):
    """Megatron chunks of this rank with the HF weights loaded by the bridge: of --model, or
    of `model` (the teacher) in the same layout (`transformer_config`)."""
    config, args = transformer_config(cfg, model)
    chunks = build_model(config, args, padding_free=cfg.training.padding_free)
    if load_weights:
        load_hf_weights(chunks, config, args, model or cfg.model.model)
    return config, args, chunks


def recompute_modules_of(t) -> list:
    """--recompute_modules, with moe when --moe_layer_recompute asks for it (ms-swift)."""
    extra = ["moe"] if t.moe_layer_recompute and "moe" not in t.recompute_modules else []
    return [*t.recompute_modules, *extra]


def lora_settings_of(cfg):
    """The run's LoraSettings: from --adapters' adapter_config.json, else the lora_* options."""
    t = cfg.training
    if t.adapters:
        from megatron_grpo.model.lora_peft import peft_settings

        return peft_settings(t.adapters[0], seed=t.seed)
    return LoraSettings(rank=t.lora_rank, alpha=float(t.lora_alpha), dropout=t.lora_dropout,
                        targets=parse_target_modules(t.target_modules), rslora=t.use_rslora,
                        seed=t.seed, modules_to_save=parse_modules_to_save(t.modules_to_save))


def apply_tuner(cfg, config, args, chunks) -> None:
    """--tuner_type lora: freeze `chunks`, add the adapters (on the tower's / merger's
    linears too with --freeze_vit / --freeze_aligner false), load --adapters if given;
    lora_llm: the same, and the vision tower and merger train in full (model/lora.py)."""
    if cfg.training.tuner_type not in ("lora", "lora_llm"):
        return
    t = cfg.training
    lora = t.tuner_type == "lora"       # ms-swift: --freeze_vit / --freeze_aligner false put
    settings = dataclasses.replace(     # adapters on the tower's / merger's linears
        lora_settings_of(cfg), train_vision=t.tuner_type == "lora_llm",
        tower=lora and not t.freeze_vit, aligner=lora and not t.freeze_aligner)
    apply_lora(chunks, config, args, settings)
    if cfg.training.adapters:
        from megatron_grpo.model.lora_peft import load_peft_adapter

        load_peft_adapter(chunks, cfg.training.adapters[0])


def total_steps(cfg, num_prompts: int) -> int:
    """Optimizer steps of the run: train_iters, or num_train_epochs over the prompts.

    Each rollout of generation_batch_size completions (generation_batch_size /
    num_generations prompts) trains num_iterations passes of steps_per_generation steps.
    """
    g = cfg.grpo
    if cfg.training.train_iters:
        return int(cfg.training.train_iters)
    prompts_per_generation = g.generation_batch_size // g.num_generations
    generations = max(1, int(num_prompts * cfg.training.num_train_epochs
                             // prompts_per_generation))
    return generations * g.steps_per_generation * g.num_iterations


def build_policy(cfg, steps: int) -> Policy:
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    t = cfg.training
    config, args, chunks = build_chunks(cfg)
    from ..model.vision import apply_freeze    # vision-language: what trains

    apply_freeze(chunks, freeze_vit=t.freeze_vit, freeze_aligner=t.freeze_aligner,
                 freeze_llm=t.freeze_llm)
    freeze_by_name(cfg, chunks)                # --freeze_parameters* (full training)
    apply_tuner(cfg, config, args, chunks)     # LoRA: base frozen before DDP sees it
    chunks = wrap_ddp(config, chunks,
                      use_distributed_optimizer=cfg.parallel.use_distributed_optimizer)
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay,
        adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2, adam_eps=t.adam_eps,
        clip_grad=t.clip_grad, bf16=config.bf16, params_dtype=config.params_dtype,
        use_distributed_optimizer=cfg.parallel.use_distributed_optimizer), chunks)
    count_kv_once_in_grad_norm(optimizer, chunks, config, args)  # replicated kv heads
    warmup = t.lr_warmup_iters or int(round((t.warmup_ratio or 0.0) * steps))
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if warmup else t.lr, max_lr=t.lr, min_lr=t.min_lr,
        lr_warmup_steps=warmup, lr_decay_steps=max(t.lr_decay_iters or steps, warmup + 1),
        lr_decay_style=t.lr_decay_style, start_wd=t.weight_decay, end_wd=t.weight_decay,
        wd_incr_steps=max(steps, 1), wd_incr_style="constant")
    sync_include = vision_sync_include(cfg) if args.family.vision else None
    return Policy(config, args, chunks, optimizer, scheduler, sync_include)


def freeze_by_name(cfg, chunks) -> None:
    """ms-swift's --freeze_parameters* / --trainable_parameters* (model/freeze.py), checked
    across the ranks: a rule that names no parameter of the whole model, or one that leaves
    nothing to train, fails on every rank."""
    from megatron.core import parallel_state as ps

    t = cfg.training
    rules = {k: v for k, v in (("freeze_parameters", t.freeze_parameters),
                               ("freeze_parameters_regex", [t.freeze_parameters_regex]
                                if t.freeze_parameters_regex else []),
                               ("trainable_parameters", t.trainable_parameters),
                               ("trainable_parameters_regex", [t.trainable_parameters_regex]
                                if t.trainable_parameters_regex else [])) if v}
    if not rules and not t.freeze_parameters_ratio:
        return
    result = freeze_parameters(chunks, ratio=t.freeze_parameters_ratio,
                               prefixes=t.freeze_parameters, regex=t.freeze_parameters_regex,
                               trainable=t.trainable_parameters,
                               trainable_regex=t.trainable_parameters_regex,
                               tp=ps.get_tensor_model_parallel_world_size())
    first = (ps.get_data_parallel_rank() == 0 and ps.get_tensor_model_parallel_rank() == 0
             and ps.get_context_parallel_rank() == 0)    # one replica, each stage once
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result if first else None)
    line = check_and_summarise([r for r in gathered if r is not None], rules)
    if dist.get_rank() == 0:
        console.say(f"[megatron] {line}")


def vision_sync_include(cfg) -> Optional[Callable[[str], bool]]:
    """Which HF tensors of a vision-language model every sync streams (None: all of them):
    the frozen tower and merger stay out, vLLM holds them from its start. Not with
    lora_llm (it trains the tower), nor at sleep level 2, which drops vLLM's copy of them
    (it keeps buffers only)."""
    t = cfg.training
    if t.tuner_type == "lora_llm" or cfg.rollout.sleep_level == 2:
        return None
    return sync_filter(t.freeze_vit, t.freeze_aligner)


def build_reference(cfg, model: Optional[str] = None) -> list:
    """Frozen reference chunks (beta > 0): the initial HF weights, eval mode, no grads; of
    `model` instead (--ref_model, the teacher of on-policy distillation: --teacher_model)."""
    _, _, chunks = build_chunks(cfg, model=model)
    for c in chunks:
        c.eval()
        for p in c.parameters():
            p.requires_grad_(False)
    return chunks


def build_ref(cfg, policy: Policy, lora: bool) -> tuple[Optional[list], bool]:
    """The KL term's reference (beta > 0; None without), and whether it is another model
    than --model's start (--ref_model: it routes for itself under router replay). --model's
    start under LoRA is the policy with its adapters off (rollout_step.fill_logps)."""
    if cfg.grpo.beta == 0.0:
        return None, False
    path, adapters = cfg.model.ref_model, cfg.training.ref_adapters
    if not adapters and (path is None or
                         os.path.realpath(path) == os.path.realpath(cfg.model.model)):
        return (policy.chunks if lora else build_reference(cfg)), False
    if adapters:       # --ref_adapters: LoRA on a model of its own, the adapter loaded
        from megatron_grpo.model.lora_peft import load_peft_adapter, peft_settings

        config, args, ref = build_chunks(cfg, model=path)
        apply_lora(ref, config, args, peft_settings(adapters[0], seed=cfg.training.seed))
        load_peft_adapter(ref, adapters[0])
        for c in ref:
            c.eval()
            c.requires_grad_(False)
    else:
        ref = build_reference(cfg, path)
    if dist.get_rank() == 0:
        console.say(f"[megatron] reference: {path or cfg.model.model}"
                    f"{' + ' + adapters[0] if adapters else ''} (frozen, same layout)")
    return ref, True


def build_teacher(cfg, policy: Policy, lora: bool) -> Optional[list]:
    """--teacher_model's frozen chunks, None without one. Under LoRA a teacher that is
    --model itself is the policy (its adapters off in rollout_step.fill_logps, as the
    reference); otherwise a model of its own in the run's layout, held off the device
    between rollouts with --offload_teacher_model."""
    path = cfg.model.teacher_model
    if path is None:
        return None
    if lora and os.path.realpath(path) == os.path.realpath(cfg.model.model):
        teacher, what = policy.chunks, "--model with its adapters off (no second model)"
    else:
        teacher, what = build_reference(cfg, path), f"{path} (frozen, same layout"
        if cfg.rollout.offload_teacher_model:
            offload_model(teacher)
            what += ", offloaded between rollouts"
        what += ")"
    if dist.get_rank() == 0:
        console.say(f"[megatron] teacher: {what}")
    return teacher


def build_sampler(cfg):
    """The vLLM side (a rollout.engine.RolloutEngine): a colocated engine in this rank, or
    a client of `megatron rollout`."""
    r = cfg.rollout
    if r.vllm_mode == "server":
        from ..rollout.client import RolloutClient

        # Sampling options from the colocated engine's settings: one source for both modes.
        client = RolloutClient(vllm_server_host=r.vllm_server_host or ["127.0.0.1"],
                               vllm_server_port=r.vllm_server_port or [8000],
                               vllm_server_base_url=r.vllm_server_base_url,
                               vllm_server_timeout=r.vllm_server_timeout, seed=cfg.training.seed,
                               **dataclasses.asdict(engine_settings(cfg).sampling()))
        client.wait_until_ready()
        return client
    return ColocateEngine(cfg.model.model, engine_settings(cfg))


def rollout_logprobs_needed(cfg) -> bool:
    """Whether anything reads the sampler's per-token log-probs: rollout importance
    sampling, the off-policy sequence mask (its behaviour policy), the rollout_correction/*
    metrics (ms-swift logs them only with one of --rollout_importance_sampling_mode,
    --log_rollout_offpolicy_metrics) and multi-turn trajectories. Otherwise the engine
    samples without them (on CPU ~10% of a tiny model's generate)."""
    g = cfg.grpo
    return (g.rollout_importance_sampling_mode is not None or g.log_rollout_offpolicy_metrics
            or g.off_policy_sequence_mask_delta is not None
            or cfg.rollout.multi_turn_scheduler is not None)


def engine_settings(cfg):
    """The colocated engine's settings: every `EngineSettings` field from the rollout or
    grpo option of the same name; the seed, dtype and sequences in flight derived."""
    import torch.distributed as dist

    r, g = cfg.rollout, cfg.grpo
    world = dist.get_world_size() if dist.is_initialized() else 1
    max_pixels = resolve_max_pixels(cfg.data.max_pixels)     # --max_pixels, else MAX_PIXELS
    derived = dict(
        mm_processor_kwargs={"max_pixels": max_pixels} if max_pixels is not None else None,
        seed=cfg.training.seed, dtype="bfloat16" if cfg.training.bf16 else "float32",
        return_routed_experts=cfg.model.router_replay_mode == "R3",
        logprobs=rollout_logprobs_needed(cfg),
        sequences_in_flight=sequences_per_engine(g.generation_batch_size, g.num_generations, world,
                                                 r.vllm_tensor_parallel_size, r.vllm_max_num_seqs))
    named = {f.name: getattr(r if hasattr(r, f.name) else g, f.name)
             for f in dataclasses.fields(EngineSettings) if f.name not in derived}
    return EngineSettings(**named, **derived)


def seed_everything(seed: int, rank: int) -> None:
    random.seed(seed + rank)
    np.random.seed((seed + rank) % 2**32)
    torch.manual_seed(seed + rank)
    os.environ.setdefault("PYTHONHASHSEED", str(seed))
