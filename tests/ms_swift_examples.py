"""ms-swift's Megatron GRPO example scripts as data, and what a CPU box changes in them.

The flag lists below are those of modelscope/ms-swift's examples/megatron/grpo/
{dense_colocate,dense_server,sapo,real,moe_colocate_full,moe_colocate_lora}.sh at commit
3602360a (Apache-2.0), copied as the scripts write them; ENV holds each script's
environment (its world size: NPROC_PER_NODE). `adapt` makes only the substitutions a CPU
box needs, each listed in SUBSTITUTIONS:

  hub ids -> local folders and files: the models become tiny models of their families
    (Qwen2.5-VL -> a tiny qwen2_5_vl, Qwen2.5 -> qwen2, Qwen3-MoE -> qwen3_moe), the
    datasets local files of the same shape (the `#N` sampling kept), the paths inside
    ms-swift's repository (its plugin and system prompt) files of this one
  --attention_backend flash -> auto (flash needs Transformer Engine on a GPU)
  --report_to wandb / swanlab -> none where that package is not installed
  CUDA_VISIBLE_DEVICES, PYTORCH_CUDA_ALLOC_CONF dropped from the environment (env_of): they
    select and configure GPUs, which a CPU box has none of

tests/test_example_ms_swift.py runs each with `--dry_run true --check_memory false`: the dry
run starts nothing, so 8-GPU scripts check on a CPU box at their own world size, and the
memory plan (of this box, not of the GPUs the script was written for) is printed without
being enforced.

Not supported yet, so refused by name (REFUSED), and checked without them (WITHOUT): the
MoE full-parameter script's optimizer CPU offload and precision-aware optimizer, and the
MoE LoRA script's default --target_modules all-linear, which puts adapters on the experts.
"""
from __future__ import annotations

import importlib.util
import shlex
from typing import Dict, List

SCRIPTS: Dict[str, str] = {
    "dense_colocate": """
    --rlhf_type grpo
    --model Qwen/Qwen2.5-VL-3B-Instruct
    --save_safetensors true
    --context_parallel_size 1
    --tensor_model_parallel_size 1
    --pipeline_model_parallel_size 1
    --dataset AI-ModelScope/clevr_cogen_a_train#10000
    --num_train_epochs 1
    --global_batch_size 128
    --micro_batch_size 4
    --steps_per_generation 4
    --num_generations 8
    --external_plugins examples/train/grpo/plugin/plugin.py
    --reward_funcs external_r1v_acc format
    --use_vllm true
    --vllm_mode colocate
    --vllm_gpu_memory_utilization 0.7
    --vllm_max_model_len 10240
    --max_length 8192
    --max_completion_length 2048
    --tuner_type full
    --lr 1e-6
    --bf16 true
    --beta 0.001
    --importance_sampling_level token
    --epsilon 0.2
    --epsilon_high 0.2
    --dynamic_sample false
    --overlong_filter true
    --loss_type grpo
    --sleep_level 2
    --offload_model true
    --offload_bridge false
    --offload_optimizer true
    --logging_steps 1
    --recompute_granularity selective
    --finetune
    --dataloader_num_workers 8
    --dataset_num_proc 8
    --no_save_optim
    --no_save_rng
    --attention_backend flash
    --temperature 1.0
    --system examples/train/grpo/prompt.txt
    --padding_free true
    --log_completions true
    --report_to wandb
    --train_iters 100
    --eval_steps 1000
    --save_steps 1000
    """,
    "dense_server": """
    --rlhf_type grpo
    --model Qwen/Qwen2.5-VL-3B-Instruct
    --save_safetensors true
    --context_parallel_size 1
    --tensor_model_parallel_size 1
    --pipeline_model_parallel_size 1
    --dataset AI-ModelScope/clevr_cogen_a_train#10000
    --num_train_epochs 1
    --global_batch_size 96
    --micro_batch_size 4
    --steps_per_generation 4
    --num_generations 8
    --external_plugins examples/train/grpo/plugin/plugin.py
    --reward_funcs external_r1v_acc format
    --use_vllm true
    --vllm_mode server
    --vllm_server_host 127.0.0.1
    --vllm_server_port 8000
    --max_length 8192
    --max_completion_length 2048
    --tuner_type full
    --lr 1e-6
    --bf16 true
    --beta 0.001
    --importance_sampling_level token
    --epsilon 0.2
    --epsilon_high 0.2
    --dynamic_sample false
    --overlong_filter true
    --loss_type grpo
    --sleep_level 2
    --offload_model true
    --offload_bridge false
    --offload_optimizer true
    --logging_steps 1
    --recompute_granularity selective
    --finetune
    --dataloader_num_workers 8
    --dataset_num_proc 8
    --no_save_optim
    --no_save_rng
    --attention_backend flash
    --temperature 1.0
    --system examples/train/grpo/prompt.txt
    --padding_free true
    --log_completions true
    --report_to wandb
    --train_iters 100
    --eval_steps 1000
    --save_steps 1000
    """,
    "sapo": """
    --rlhf_type grpo
    --loss_type sapo
    --tau_pos 1
    --tau_neg 1.05
    --model Qwen/Qwen2.5-VL-3B-Instruct
    --context_parallel_size 1
    --tensor_model_parallel_size 1
    --pipeline_model_parallel_size 1
    --dataset AI-ModelScope/clevr_cogen_a_train
    --save_safetensors true
    --external_plugins examples/train/grpo/plugin/plugin.py
    --reward_funcs external_r1v_acc format
    --dynamic_sample false
    --steps_per_generation 4
    --micro_batch_size 2
    --global_batch_size 128
    --num_generations 8
    --use_vllm true
    --vllm_mode colocate
    --vllm_gpu_memory_utilization 0.7
    --vllm_max_model_len 8192
    --max_length 4096
    --max_completion_length 4096
    --tuner_type full
    --bf16 true
    --importance_sampling_level token
    --epsilon 0.2
    --epsilon_high 0.2
    --overlong_filter true
    --num_train_epochs 1
    --eval_steps 1000
    --save_steps 1000
    --sleep_level 2
    --offload_model true
    --offload_optimizer true
    --logging_steps 1
    --recompute_granularity selective
    --finetune
    --lr 1e-6
    --dataloader_num_workers 8
    --dataset_num_proc 8
    --no_save_optim
    --no_save_rng
    --attention_backend flash
    --temperature 1.0
    --system examples/train/grpo/prompt.txt
    --beta 0.001
    --padding_free true
    --report_to wandb
    """,
    "real": """
    --rlhf_type grpo
    --model Qwen/Qwen2.5-0.5B-Instruct
    --save_safetensors true
    --context_parallel_size 1
    --tensor_model_parallel_size 1
    --pipeline_model_parallel_size 1
    --dataset 'AI-MO/NuminaMath-TIR#4000'
    --num_train_epochs 1
    --micro_batch_size 8
    --global_batch_size 128
    --num_generations 8
    --reward_funcs accuracy
    --use_vllm true
    --vllm_mode server
    --vllm_server_host 127.0.0.1
    --vllm_server_port 8000
    --max_completion_length 2048
    --tuner_type full
    --gradient_accumulation_fusion false
    --lr 2e-6
    --bf16 true
    --beta 0.001
    --dynamic_sample false
    --loss_type real
    --logging_steps 1
    --recompute_granularity selective
    --finetune
    --dataloader_num_workers 8
    --dataset_num_proc 8
    --padding_free true
    --attention_backend flash
    --no_save_optim
    --no_save_rng
    --temperature 0.6
    --system \"\"\"You are a helpful math assistant. Solve the problem step by step and put your final answer within \\\\boxed{}.\"\"\"
    --log_completions true
    --eval_steps 100
    --save_steps 100
    """,
    "moe_colocate_full": """
    --rlhf_type grpo
    --model Qwen/Qwen3-30B-A3B-Instruct-2507
    --save_safetensors true
    --context_parallel_size 1
    --tensor_model_parallel_size 4
    --expert_model_parallel_size 4
    --pipeline_model_parallel_size 2
    --dataset open-r1/DAPO-Math-17k-Processed
    --num_train_epochs 1
    --global_batch_size 8
    --micro_batch_size 1
    --steps_per_generation 1
    --num_generations 8
    --reward_funcs accuracy format
    --use_vllm true
    --vllm_mode colocate
    --vllm_gpu_memory_utilization 0.4
    --vllm_tensor_parallel_size 8
    --vllm_max_model_len 16384
    --max_length 8192
    --max_completion_length 8192
    --tuner_type full
    --lr 1e-6
    --bf16 true
    --beta 0.00
    --importance_sampling_level sequence
    --epsilon 3e-4
    --epsilon_high 4e-4
    --dynamic_sample false
    --overlong_filter true
    --loss_type grpo
    --sleep_level 2
    --offload_model true
    --offload_bridge false
    --offload_optimizer true
    --optimizer_cpu_offload true
    --use_precision_aware_optimizer
    --logging_steps 1
    --recompute_granularity selective
    --finetune
    --dataloader_num_workers 8
    --dataset_num_proc 8
    --no_save_optim
    --no_save_rng
    --attention_backend flash
    --temperature 1.0
    --padding_free true
    --sequence_parallel true
    --log_completions true
    --report_to wandb
    """,
    "moe_colocate_lora": """
    --rlhf_type grpo
    --model Qwen/Qwen3-30B-A3B-Instruct-2507
    --save_safetensors true
    --merge_lora false
    --context_parallel_size 2
    --tensor_model_parallel_size 2
    --expert_model_parallel_size 4
    --pipeline_model_parallel_size 2
    --dataset open-r1/DAPO-Math-17k-Processed
    --num_train_epochs 1
    --global_batch_size 64
    --micro_batch_size 2
    --steps_per_generation 2
    --num_generations 8
    --reward_funcs accuracy format
    --use_vllm true
    --vllm_mode colocate
    --vllm_gpu_memory_utilization 0.3
    --vllm_tensor_parallel_size 4
    --vllm_max_model_len 16384
    --max_length 8192
    --max_completion_length 8192
    --tuner_type lora
    --lr 5e-5
    --bf16 true
    --beta 0.00
    --importance_sampling_level sequence
    --epsilon 3e-4
    --epsilon_high 4e-4
    --dynamic_sample false
    --overlong_filter true
    --loss_type grpo
    --sleep_level 2
    --offload_model true
    --offload_bridge false
    --offload_optimizer true
    --logging_steps 1
    --recompute_granularity selective
    --finetune
    --dataloader_num_workers 8
    --dataset_num_proc 8
    --no_save_optim
    --no_save_rng
    --attention_backend flash
    --temperature 1.0
    --padding_free true
    --sequence_parallel true
    --log_completions true
    --report_to wandb
    """,
}

ENV: Dict[str, Dict[str, str]] = {
    "dense_colocate": dict(CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7", NPROC_PER_NODE="8",
                           MAX_PIXELS="602112", MASTER_PORT="29600"),
    "dense_server": dict(CUDA_VISIBLE_DEVICES="0,1,2,3,4,5", NPROC_PER_NODE="6",
                         MAX_PIXELS="602112", MASTER_PORT="29600"),
    "sapo": dict(CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7", NPROC_PER_NODE="8",
                 MAX_PIXELS="602112"),
    "real": dict(CUDA_VISIBLE_DEVICES="0,1", NPROC_PER_NODE="2", MASTER_PORT="29600"),
    "moe_colocate_full": dict(CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7", NPROC_PER_NODE="8",
                              PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True"),
    "moe_colocate_lora": dict(CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7", NPROC_PER_NODE="8",
                              PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True"),
}

GPU_ONLY_ENV = ("CUDA_VISIBLE_DEVICES", "PYTORCH_CUDA_ALLOC_CONF")


def env_of(script: str) -> Dict[str, str]:
    """The script's environment without GPU_ONLY_ENV."""
    return {k: v for k, v in ENV[script].items() if k not in GPU_ONLY_ENV}


# (flag, value in ms-swift's script) -> the value here; `{name}` fields are filled by
# adapt's `paths` (tiny models, local datasets, the system prompt file).
SUBSTITUTIONS: Dict[tuple, str] = {
    ("--model", "Qwen/Qwen2.5-VL-3B-Instruct"): "{qwen2_5_vl}",
    ("--model", "Qwen/Qwen2.5-0.5B-Instruct"): "{qwen2}",
    ("--model", "Qwen/Qwen3-30B-A3B-Instruct-2507"): "{qwen3_moe}",
    ("--dataset", "AI-ModelScope/clevr_cogen_a_train#10000"): "{vl_count}#10000",
    ("--dataset", "AI-ModelScope/clevr_cogen_a_train"): "{vl_count}",
    ("--dataset", "AI-MO/NuminaMath-TIR#4000"): "{math}#4000",
    ("--dataset", "open-r1/DAPO-Math-17k-Processed"): "{math}",
    ("--external_plugins", "examples/train/grpo/plugin/plugin.py"):
        "examples/plugins/r1v_reward.py",
    ("--system", "examples/train/grpo/prompt.txt"): "{prompt}",
    ("--attention_backend", "flash"): "auto",
}
# The system prompt of ms-swift's examples/train/grpo/prompt.txt, in other words.
THINK_ANSWER_PROMPT = ("The user asks a question and the assistant answers it. The assistant "
                       "first reasons, then gives the answer: the reasoning inside <think> "
                       "</think> and the answer inside <answer> </answer>.")


def argv_of(script: str) -> List[str]:
    """The script's `megatron rlhf` arguments as the shell passes them."""
    return shlex.split(SCRIPTS[script])


def adapt(script: str, paths: Dict[str, str]) -> List[str]:
    """The script's arguments with SUBSTITUTIONS made (and a metric sink that is not
    installed replaced by none)."""
    argv = argv_of(script)
    out = []
    for i, token in enumerate(argv):
        flag = argv[i - 1] if i else ""
        new = SUBSTITUTIONS.get((flag, token))
        if new is not None:
            token = new.format(**paths)
        elif flag == "--report_to" and importlib.util.find_spec(token) is None:
            token = "none"
        out.append(token)
    return out


# Scripts refused here: the error lines they get, and the flags whose removal (or, for a
# default, whose replacement) makes the rest pass.
REFUSED: Dict[str, List[str]] = {
    "moe_colocate_full": [
        "--optimizer_cpu_offload is an ms-swift option not supported yet: optimizer CPU offload "
        "and precision-aware optimizer",
        "--use_precision_aware_optimizer is an ms-swift option not supported yet: optimizer CPU "
        "offload and precision-aware optimizer"],
    "moe_colocate_lora": [
        "--tuner_type lora --target_modules all-linear with the mixture-of-experts model"],
}
WITHOUT: Dict[str, tuple] = {
    "moe_colocate_full": (["--optimizer_cpu_offload", "true", "--use_precision_aware_optimizer"],
                          []),
    "moe_colocate_lora": ([], ["--target_modules", "q_proj", "k_proj", "v_proj", "o_proj"]),
}


def without_refused(script: str, argv: List[str]) -> List[str]:
    """argv (adapted) without WITHOUT's flags of `script` and with its additions."""
    drop, add = WITHOUT[script]
    out, i = [], 0
    while i < len(argv):
        n = len(drop) if argv[i:i + len(drop)] == drop and drop else 0
        if n:
            i += n
            continue
        out.append(argv[i])
        i += 1
    return out + add
