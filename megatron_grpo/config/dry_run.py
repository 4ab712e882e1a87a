"""`megatron rlhf --dry_run true ...`: check a job before it is queued, start nothing.

Beyond the option and world-size checks every run gets (validate.py) and the read
of the dataset (the CLI does it), a dry run checks the model against the parallel
layout as the trainer will build it: the architecture is supported, TP divides the
attention heads (and the kv heads, or is divided by them), PP x VPP divides the
layers, vLLM's TP divides the heads. It imports torch and Megatron-Core's config
class for that, but builds no model and starts no process. It then prints the plan:

    parallel  DP 2 x TP 2 x PP 1 x CP 1 = 4 processes
    rollout   4 prompts x 4 completions = 16 completions, over 4 colocated vLLM engines
    step      8 completions = micro_batch_size 2 x DP 2 x 2 micro-batches per rank
    ...
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional

from .hf_model import model_config
from .validate import teacher_servers

if TYPE_CHECKING:
    from . import GRPOConfig
    from .validate import WorldPlan


@dataclass
class ModelFacts:
    family: str
    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    dtype: str


def check_model(cfg: "GRPOConfig") -> ModelFacts:
    """The model's config.json against the parallel sizes; ValueError naming the option."""
    # train/ imports torch and Megatron; this module is imported by the CLI parent
    from ..train.setup import transformer_config

    v = cfg.rollout
    dtype = "bfloat16" if cfg.training.bf16 else "float32"     # as train/setup.py
    _, args = transformer_config(cfg)
    for option in ("teacher_model", "ref_model"):   # in the same layout, as the trainer builds
        path = getattr(cfg.model, option)
        if path and (option != "ref_model" or cfg.grpo.beta):
            try:
                transformer_config(cfg, path)
            except ValueError as e:     # the reader's own errors name the option already
                named = str(e).startswith(f"--{option} ")
                raise ValueError(str(e) if named else f"--{option} {path!r}: {e}") from None
    model = model_config(cfg.model.model)   # as transformer_config read it (cached)
    hf = model.language                      # a vision-language config's language part
    heads = hf["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads") or heads
    if v.vllm_mode == "colocate" and heads % v.vllm_tensor_parallel_size:
        valid = [t for t in range(1, heads + 1) if heads % t == 0]
        raise ValueError(f"--vllm_tensor_parallel_size {v.vllm_tensor_parallel_size} does not divide "
                         f"the model's {heads} attention heads; valid values: {valid}")
    return ModelFacts(family=args.family.name,
                      architecture=(model.architectures or (model.model_type,))[0],
                      num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
                      num_heads=heads, num_kv_heads=kv_heads, vocab_size=hf["vocab_size"],
                      dtype=dtype)


def _experts_line(p, plan) -> str:
    """MoE: the experts' own mesh (EP x ETP, expert data parallel the rest)."""
    if p.expert_model_parallel_size == 1 and p.expert_tensor_parallel_size in (None, 1):
        return ""
    etp = p.expert_tensor_parallel_size or p.tensor_model_parallel_size
    edp = plan.world_size // (etp * p.expert_model_parallel_size * p.pipeline_model_parallel_size)
    return f"; experts EP {p.expert_model_parallel_size} x ETP {etp} x expert DP {edp}"


def _count(n: float, what: str, plural: str = "") -> str:
    n = int(n) if float(n).is_integer() else round(n, 2)
    return f"{n} {what if n == 1 else plural or what + 's'}"


def format_plan(cfg: "GRPOConfig", plan: "WorldPlan", model: ModelFacts, *, nproc_per_node: int,
                nnodes: int, num_prompts: int, num_files: int, reward_columns: List[str],
                num_val_prompts: Optional[int] = None) -> str:
    """The resolved plan of a run, one line per stage. num_prompts: training prompts (after
    a --split_dataset_ratio split); num_val_prompts: validation prompts, None without."""
    from ..train.setup import total_steps  # train/ imports torch (see check_model)

    p, t, g, v = cfg.parallel, cfg.training, cfg.grpo, cfg.rollout
    server = cfg.model.teacher_model_server
    G = g.num_generations
    vpp = p.virtual_pipeline_model_parallel_size
    steps = total_steps(cfg, num_prompts)
    per_rollout = g.steps_per_generation * g.num_iterations
    if v.vllm_mode == "colocate":
        vllm = (f"colocate: {_count(plan.num_vllm_engines, 'engine')} x vLLM TP "
                f"{v.vllm_tensor_parallel_size}, "
                f"{_count(plan.num_rollout_prompts / plan.num_vllm_engines, 'prompt')} each per "
                f"rollout, sleep_level {v.sleep_level}")
    else:
        where = v.vllm_server_base_url or [f"{h}:{port}" for h, port in
                                           zip(v.vllm_server_host, v.vllm_server_port * len(
                                               v.vllm_server_host))]
        vllm = f"server: {', '.join(where)} (started separately with `megatron rollout`)"
    lines = [
        "megatron rlhf --dry_run: every check passed; nothing was started.",
        f"  model      {cfg.model.model}: {model.family} ({model.architecture}), "
        f"{model.num_layers} layers, hidden {model.hidden_size}, {model.num_heads} heads, "
        f"{model.num_kv_heads} kv heads, vocab {model.vocab_size}, {model.dtype}"
        + (f"; teacher {cfg.model.teacher_model} (frozen, same layout, teacher_kl_coef "
           f"{g.teacher_kl_coef:g})" if cfg.model.teacher_model else "")
        + (f"; teacher served at {', '.join(s.url for s in teacher_servers(server))} "
           f"(teacher_kl_coef {g.teacher_kl_coef:g})" if server else "")
        + (f"; reference {cfg.model.ref_model} (frozen, same layout)"
           if cfg.model.ref_model and g.beta else ""),
        f"  dataset    {_count(num_prompts, 'prompt')} from {_count(num_files, 'file')}"
        + (f" ({num_val_prompts} more held out for evaluation)" if num_val_prompts is not None
           and not cfg.evaluation.val_dataset else "") + "; "
        f"reward columns: {', '.join(reward_columns) or 'none'}"
        + ("; teacher_prompt: OPSD, the teacher scores behind it" + (
            "" if cfg.model.has_teacher else " (no teacher flag: the policy itself)")
           if "teacher_prompt" in reward_columns else ""),
        f"  world      {_count(plan.world_size, 'process', 'processes')} = NPROC_PER_NODE {nproc_per_node} x "
        f"NNODES {nnodes}",
        f"  parallel   DP {plan.dp} x TP {p.tensor_model_parallel_size} x PP "
        f"{p.pipeline_model_parallel_size} x CP {p.context_parallel_size} (VPP {vpp or 1}, "
        f"sequence parallel {'on' if p.sequence_parallel else 'off'}, distributed optimizer "
        f"{'on' if p.use_distributed_optimizer else 'off'})" + _experts_line(p, plan),
        f"  vLLM       {vllm}",
        f"  rollout    {_count(plan.num_rollout_prompts, 'prompt')} x {G} completions = "
        f"{g.generation_batch_size} completions (generation_batch_size); "
        f"{_count(plan.prompts_per_dp_rank, 'prompt')} per DP rank",
        f"  step       {t.global_batch_size} completions ({_count(t.global_batch_size / G, 'prompt')})"
        f" per optimizer step = micro_batch_size {t.micro_batch_size} x DP {plan.dp} x "
        f"{_count(plan.num_microbatches, 'micro-batch', 'micro-batches')} per rank",
        f"  schedule   {_count(per_rollout, 'optimizer step')} per rollout (steps_per_generation "
        f"{g.steps_per_generation} x num_iterations {g.num_iterations}); "
        f"{_count(steps, 'optimizer step')} in all"
        + (f" (train_iters), {_count(math.ceil(steps / per_rollout), 'rollout')}"
           if t.train_iters else f" ({t.num_train_epochs:g} epochs)"),
        f"  eval       {_eval_line(cfg, steps, num_val_prompts)}",
        f"  outputs    {cfg.logging.output_dir} (metrics.jsonl"
        + "".join(f", {s}" for s in cfg.logging.report_to) + ")",
    ]
    return "\n".join(lines)


def _eval_line(cfg: "GRPOConfig", steps: int, num_val_prompts: Optional[int]) -> str:
    """When and on what the run evaluates (train/evaluate.py)."""
    e, t = cfg.evaluation, cfg.training
    if num_val_prompts is None:
        return "off (no --val_dataset or --split_dataset_ratio)"
    if e.eval_iters == 0:
        return "off (--eval_iters 0)"
    source = (f"--val_dataset, {_count(len(e.val_dataset), 'file')}" if e.val_dataset else
              f"held out of --dataset by --split_dataset_ratio {e.split_dataset_ratio:g}, never "
              "trained on")
    if e.eval_iters < 0:
        which = f"all {_count(num_val_prompts, 'validation prompt')} ({source})"
    else:
        per = max(1, t.global_batch_size // e.num_generations_eval) * e.eval_iters
        which = (f"{_count(per, 'prompt')} of {num_val_prompts} validation prompts ({source}), "
                 f"eval_iters {e.eval_iters}")
    count = steps // e.eval_steps + (1 if steps % e.eval_steps else 0)
    return (f"every {_count(e.eval_steps, 'optimizer step')} and after the last "
            f"({_count(count, 'evaluation')}): {which} x {e.num_generations_eval} completions "
            "(num_generations_eval), logged as eval/*")
