"""ms-swift's defaults of the flags this project shares with it, and where ours differ.

A script written for `swift megatron rlhf` relies on ms-swift's defaults for every flag it
leaves out; here those flags default to the same values, except for the few listed in
DIFFERENCES (each with the reason), which the dry run names when a script relies on them:

    defaults that differ from ms-swift's (flags not passed):
      --padding_free ours false, ms-swift true (...)

MS_SWIFT_DEFAULTS holds each shared flag's default as ms-swift's argument dataclasses
declare it (`swift megatron rlhf` parses MegatronRLHFArguments; a field declared in
several of its bases takes the first in MRO order), read from modelscope/ms-swift's source
at swift_flags.MS_SWIFT_REVISION (`python tools/ms_swift_flags.py --defaults GIT_DIR`
re-reads them and lists what changed). Where ms-swift computes a default in its
`__post_init__` or trainer, RULES states the rule, and its value for a run here where
that value can be named. tests/test_swift_defaults.py compares ours with both.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Dict, Iterable, List, NamedTuple, Optional, Tuple

from .groups import ALIASES
from .hf_model import json_config, model_max_len, num_experts

# Declared defaults at swift_flags.MS_SWIFT_REVISION, under ms-swift's names (lr_warmup_fraction
# and custom_register_path are aliases here), by the class that declares them.
MS_SWIFT_DEFAULTS: Dict[str, Any] = {
    # MegatronRLHFArguments
    'rlhf_type': 'dpo', 'loss_scale': 'last_round', 'truncation_strategy': None,
    # MegatronArguments
    'torch_dtype': None, 'micro_batch_size': 1, 'global_batch_size': 16, 'recompute_granularity': 'selective',
    'recompute_method': None, 'recompute_num_layers': None, 'recompute_modules': ['core_attn'],
    'train_iters': None, 'num_train_epochs': None, 'attention_backend': 'flash', 'seed': 42,
    'dataloader_num_workers': 4, 'dataloader_pin_memory': True,
    'dataloader_persistent_workers': False, 'dataloader_prefetch_factor': 2,
    'padding_free': True, 'lr': None, 'lr_decay_style': 'cosine', 'lr_decay_iters': None,
    'lr_warmup_iters': 0, 'lr_warmup_fraction': None, 'min_lr': 0, 'weight_decay': 0.1,
    'clip_grad': 1.0, 'adam_beta1': 0.9, 'adam_beta2': 0.95, 'adam_eps': 1e-08,
    'output_dir': None, 'save_steps': 500, 'no_save_optim': False, 'no_save_rng': False,
    'finetune': True, 'save_total_limit': None, 'dist_ckpt_optim_fully_reshardable': False,
    'distrib_optim_fully_reshardable_mem_efficient': False, 'use_distributed_optimizer': True,
    'tensor_model_parallel_size': 1, 'pipeline_model_parallel_size': 1,
    'sequence_parallel': False, 'context_parallel_size': 1,
    'virtual_pipeline_model_parallel_size': None, 'expert_model_parallel_size': 1,
    'expert_tensor_parallel_size': 1, 'report_to': ['tensorboard'], 'logging_steps': 5,
    'wandb_project': 'megatron-swift', 'wandb_exp_name': None,
    'swanlab_project': 'megatron-swift', 'swanlab_exp_name': None, 'eval_iters': -1,
    'eval_steps': None, 'bf16': None, 'moe_router_load_balancing_type': None,
    'moe_router_dtype': 'fp32', 'moe_token_dispatcher_type': 'alltoall',
    'moe_grouped_gemm': True, 'moe_permute_fusion': False, 'moe_aux_loss_coeff': 0.0,
    'moe_z_loss_coeff': None, 'moe_layer_recompute': False, 'moe_expert_capacity_factor': None,
    'moe_pad_expert_input_to_capacity': False, 'moe_token_drop_policy': 'probs', 'model': None,
    'save_safetensors': True, 'adapters': [], 'ref_model': None, 'ref_adapters': [],
    'merge_lora': None,
    # RLHFMegatronArgumentsMixin
    'loss_type': None, 'beta': None, 'teacher_model': None, 'teacher_model_server': None,
    'teacher_tag_key': 'dataset', 'offload_teacher_model': False, 'teacher_kl_coef': 1.0,
    'temperature': 0.9, 'generation_batch_size': None, 'steps_per_generation': None,
    'num_generations': 8, 'num_generations_eval': None, 'max_completion_length': 512,
    'importance_sampling_level': 'token', 'tau_pos': 1.0, 'tau_neg': 1.05, 'real_tau': 0.5,
    'fipo_decay_rate': 32.0, 'fipo_clip_range': 0.2, 'fipo_clip_high_only': True,
    'fipo_safety_threshold': 4.0, 'epsilon': 0.2, 'epsilon_high': None, 'delta': None,
    'top_k': -1, 'top_p': 1.0, 'repetition_penalty': 1.0, 'use_vllm': True, 'vllm_mode': None,
    'vllm_enable_prefix_caching': True, 'vllm_gpu_memory_utilization': 0.9,
    'vllm_tensor_parallel_size': 1, 'vllm_max_model_len': None, 'vllm_enforce_eager': False,
    'vllm_limit_mm_per_prompt': None, 'vllm_max_num_seqs': None, 'vllm_engine_kwargs': None,
    'vllm_enable_lora': False, 'sleep_level': 0, 'offload_optimizer': False,
    'offload_model': False, 'offload_bridge': False, 'vllm_server_base_url': None,
    'vllm_server_host': None, 'vllm_server_port': [8000], 'vllm_server_timeout': 240.0,
    'reward_funcs': [], 'reward_weights': None, 'cosine_min_len_value_wrong': -0.5,
    'cosine_max_len_value_wrong': 0.0, 'cosine_min_len_value_correct': 1.0,
    'cosine_max_len_value_correct': 0.5, 'cosine_max_len': None, 'repetition_n_grams': 3,
    'repetition_max_penalty': -1.0, 'soft_max_length': None, 'soft_cache_length': None,
    'dynamic_sample': False, 'max_resample_times': 3, 'overlong_filter': False,
    'scale_rewards': 'group', 'advantage_estimator': 'grpo', 'kl_in_reward': False,
    'log_completions': False, 'rollout_importance_sampling_mode': None,
    'rollout_importance_sampling_threshold': 2.0, 'log_rollout_offpolicy_metrics': False,
    'off_policy_sequence_mask_delta': None, 'log_entropy': False, 'top_entropy_quantile': 1.0,
    'router_replay_mode': 'disabled', 'reward_model': None, 'reward_model_plugin': None,
    'move_model_batches': None, 'multi_turn_scheduler': None,
    'max_turns': None, 'completion_length_limit_scope': 'per_round',
    'vllm_server_pass_dataset': False, 'use_gym_env': None, 'gym_env': None,
    'num_iterations': 1, 'dataset_shuffle': True,
    # MegatronTunerMixin
    'tuner_type': 'full', 'freeze_llm': False, 'freeze_vit': True, 'freeze_aligner': True,
    'freeze_parameters': [], 'freeze_parameters_regex': None, 'freeze_parameters_ratio': 0.0,
    'trainable_parameters': [], 'trainable_parameters_regex': None,
    'target_modules': ['all-linear'], 'modules_to_save': [], 'lora_rank': 8, 'lora_alpha': 32,
    'lora_dropout': 0.05, 'use_rslora': False,
    # BaseArguments
    'external_plugins': [], 'custom_register_path': [],
    # DataArguments
    'dataset': [], 'val_dataset': [], 'split_dataset_ratio': 0.0, 'dataset_num_proc': 1,
    'load_from_cache_file': False, 'val_dataset_shuffle': False, 'columns': None,
    # TemplateArguments
    'system': None, 'max_length': None, 'max_pixels': None, 'enable_thinking': None,
}


class Rule(NamedTuple):
    """A default ms-swift computes: the rule in words, and value(cfg, ours): what it comes
    to for a run of this project (cfg a finalized GRPOConfig, ours this project's value
    there), in this project's terms. Where the option has no effect on that run, ms-swift's
    value is taken to be ours. value None: this project resolves it by the same rule, or
    only the trainer knows it."""
    text: str
    value: Optional[Callable[[Any, Any], Any]] = None


def _model_max_len(cfg) -> Optional[int]:
    try:
        return model_max_len(cfg.model.model)
    except (OSError, ValueError, KeyError):
        return None


def _is_moe(cfg) -> bool:
    try:
        return num_experts(json_config(cfg.model.model)) > 0
    except (OSError, ValueError, KeyError):
        return False


def _float16_model(cfg) -> bool:
    """config.json names float16 (its text part's for a vision-language model)."""
    try:
        hf = json_config(cfg.model.model)
    except (OSError, ValueError, TypeError):
        return False
    name = hf.get("torch_dtype") or hf.get("dtype")
    return str(name).replace("torch.", "") == "float16"


def _resume_path(cfg) -> bool:
    return cfg.logging.resume not in (None, "auto", "false")


RULES: Dict[str, Rule] = {
    # None and [] both name no reward model (ours are lists, empty when unset)
    "reward_model": Rule("None: no reward model", lambda cfg, ours: []),
    "reward_model_plugin": Rule("None: the classifier's score for each reward model",
                                lambda cfg, ours: []),
    "truncation_strategy": Rule("left for GRPO (delete for the other RLHF types)"),
    "num_train_epochs": Rule("unset: --train_iters is needed", lambda cfg, ours: None),
    "lr": Rule("1e-5 for full-parameter training, 1e-4 for LoRA (tuner_type lora, lora_llm)",
               lambda cfg, ours: 1e-5 if cfg.training.tuner_type == "full" else 1e-4),
    "output_dir": Rule("megatron_output/<model folder name>, in which each launch makes a "
                       "new v<N>-<date>-<time> folder (--add_version true)",
                       lambda cfg, ours: os.path.join(ours, "v<N>-<date>-<time>")),
    "report_to": Rule("tensorboard", lambda cfg, ours: ["tensorboard"]),
    "wandb_exp_name": Rule("output_dir (its absolute path)"),
    "swanlab_exp_name": Rule("output_dir (its absolute path)"),
    "eval_steps": Rule("save_steps"),
    "bf16": Rule("the model's config.json dtype: bfloat16 trains in bf16, float16 in fp16 "
                 "(--fp16), float32 in fp32",
                 lambda cfg, ours: "false (--fp16 true)" if _float16_model(cfg) else ours),
    "moe_router_load_balancing_type": Rule("Megatron's: aux_loss",
                                           lambda cfg, ours: "aux_loss"),
    "moe_grouped_gemm": Rule("true", lambda cfg, ours: True if _is_moe(cfg) else ours),
    "merge_lora": Rule("save_safetensors (true)",
                       lambda cfg, ours: True if cfg.training.tuner_type != "full" else ours),
    "loss_type": Rule("grpo"),
    "beta": Rule("0.04 for GRPO"),
    "finetune": Rule("true", lambda cfg, ours: True if _resume_path(cfg) else ours),
    "loss_scale": Rule("last_round; for a scheduler that returns token ids (a token-exact "
                       "trajectory) every model token trains whatever it says",
                       lambda cfg, ours: ("last_round" if cfg.rollout.multi_turn_scheduler
                                          else ours)),
    "generation_batch_size": Rule("global_batch_size x steps_per_generation"),
    "steps_per_generation": Rule("1, or generation_batch_size / global_batch_size"),
    "num_generations_eval": Rule("num_generations"),
    "epsilon_high": Rule("epsilon"),
    "vllm_mode": Rule("unset: refused when the trainer starts (every script sets it)",
                      lambda cfg, ours: None),
    "vllm_max_num_seqs": Rule("colocate: the completions one engine samples per rollout "
                              "(generation_batch_size / world size x vllm_tensor_parallel_size); "
                              "server: the server's (vLLM's 256)"),
    "cosine_max_len": Rule("max_completion_length"),
    "soft_max_length": Rule("max_completion_length"),
    "scale_rewards": Rule("group for every advantage_estimator; none with loss_type real",
                          lambda cfg, ours: "none" if cfg.grpo.loss_type == "real" else "group"),
    "kl_in_reward": Rule("false for every advantage_estimator", lambda cfg, ours: False),
    "use_gym_env": Rule("true when --gym_env is given"),
    "max_length": Rule("the model's context length (config.json max_position_embeddings)",
                       lambda cfg, ours: _model_max_len(cfg)),
    "vllm_server_host": Rule("unset: server mode without --vllm_server_base_url fails when "
                             "the trainer starts",
                             lambda cfg, ours: None if cfg.rollout.vllm_mode == "server"
                             else ours),
}

# Flags whose default here is not ms-swift's, on purpose: (ours in words, why); the doc's
# column and the dry run's block.
DIFFERENCES: Dict[str, Tuple[str, str]] = {
    "rlhf_type": ("grpo", "only GRPO is implemented here"),
    "loss_scale": ("default: every model token trains",
                   "multi-turn trajectories here are token-exact, for which ms-swift trains "
                   "every model token whatever --loss_scale says; last_round is accepted"),
    "num_train_epochs": ("3 without --train_iters (transformers' default)",
                         "a command line with neither --num_train_epochs nor --train_iters "
                         "runs"),
    "bf16": ("true for a bfloat16 or float16 checkpoint", "fp16 training is not supported "
             "here; bf16 has fp16's precision and fp32's range"),
    "attention_backend": ("auto: flash where Transformer Engine is installed",
                          "flash needs Transformer Engine on a GPU"),
    "padding_free": ("false", "false until the Transformer Engine (GPU) path of packed "
                              "sequences has run on a GPU; on CPU both give the same loss"),
    "output_dir": ("megatron_output/<model folder name>", "one fixed folder, so that --resume "
                   "auto continues the run in it; --add_version true is not supported"),
    "report_to": ("tensorboard where the tensorboard package is installed, else none",
                  "metrics.jsonl is always written; the package is optional"),
    "wandb_exp_name": ("output_dir's folder name", "a short run name; ms-swift's is "
                       "output_dir's absolute path"),
    "swanlab_exp_name": ("output_dir's folder name", "a short experiment name; ms-swift's "
                         "is output_dir's absolute path"),
    "moe_grouped_gemm": ("on where Transformer Engine is installed",
                         "grouped GEMM needs Transformer Engine on a GPU"),
    "finetune": ("false", "--resume PATH continues that run unless --finetune true; ms-swift's "
                          "true matters where it loads a Megatron checkpoint (--mcore_model)"),
    "scale_rewards": ("by advantage_estimator: grpo group, rloo none, reinforce_plus_plus batch",
                      "as ms-swift's `swift rlhf` and the RLOO and REINFORCE++ papers"),
    "kl_in_reward": ("by advantage_estimator: grpo false, rloo and reinforce_plus_plus true",
                     "as ms-swift's `swift rlhf` and the RLOO and REINFORCE++ papers"),
    "vllm_mode": ("colocate", "a short command line runs"),
    "vllm_server_host": ("127.0.0.1 in server mode", "a server on this machine needs no "
                         "flag"),
    "max_length": ("unset: prompts are not cut", "prompt and completion are bounded by "
                   "vLLM's max model length, the model's context length unless "
                   "--vllm_max_model_len"),
}


def ms_swift_value(name: str, cfg) -> Any:
    """ms-swift's default of flag `name` for the run `cfg` describes, in this project's
    terms (the declared default, or its rule's value); ours where neither names one."""
    ours = _ours(cfg, name)
    rule = RULES.get(name)
    if rule is not None:
        return ours if rule.value is None else rule.value(cfg, ours)
    return MS_SWIFT_DEFAULTS[name]


def _ours(cfg, name: str) -> Any:
    """This project's value of flag `name` (ms-swift's spelling allowed) in cfg."""
    name = ALIASES.get(name, name)
    for group in vars(cfg).values():
        if hasattr(group, name):
            return getattr(group, name)
    raise KeyError(name)


def show_value(value: Any) -> str:
    """A value as the dry run and docs/ms-swift.md write it: unset, true, a b c."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return " ".join(map(str, value)) or "none"
    return str(value)


def differing_defaults(cfg, given: Iterable[str]) -> List[str]:
    """One line per flag of DIFFERENCES that the command line / config file did not set
    (`given`: canonical option names) and whose value in cfg is not ms-swift's default."""
    given = {ALIASES.get(n, n) for n in given}
    lines = []
    for name, (_, why) in DIFFERENCES.items():
        if ALIASES.get(name, name) in given:
            continue
        ours, theirs = _ours(cfg, name), ms_swift_value(name, cfg)
        if ours != theirs:
            lines.append(f"--{name} ours {show_value(ours)}, ms-swift {show_value(theirs)} "
                         f"({why})")
    return lines


def format_differing_defaults(cfg, given: Iterable[str]) -> str:
    """The dry run's block of differing_defaults; empty when there is none."""
    lines = differing_defaults(cfg, given)
    if not lines:
        return ""
    return "\n".join(["defaults that differ from ms-swift's (flags not passed):"]
                     + [f"  {line}" for line in lines])
