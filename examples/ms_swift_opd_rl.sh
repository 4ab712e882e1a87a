#!/usr/bin/env bash
# ms-swift's examples/megatron/grpo/opd_rl.sh, adapted: on-policy distillation as RL
# (OPD-RL). A frozen teacher scores every token the policy samples; its log-ratio to the
# policy is each token's advantage (there is no reward function). Local models and
# dataset; sizes for a CPU (2 processes, tiny models).
#
#   MODEL=path/to/tiny_qwen2 TEACHER=path/to/teacher bash examples/ms_swift_opd_rl.sh
#   MODEL=... TEACHER=... bash examples/ms_swift_opd_rl.sh --dry_run true      # check only
#
# Tiny models with one tokenizer (the teacher: other random weights, or any model of the
# student's vocabulary):
#   python tools/make_tiny_model.py --family qwen2 --hidden_size 128 --output_dir runs/tiny_qwen2
#   python tools/make_tiny_model.py --family qwen2 --hidden_size 128 --seed 1 --output_dir runs/tiny_teacher
# Differences from ms-swift's script, each on purpose:
#   --model / --teacher_model / --dataset   local folders / file (nothing is downloaded)
#   --freeze_vit false       dropped: ms-swift's Qwen3.5 is a vision-language model, the tiny
#                            student is text-only (a Qwen2.5-VL student and teacher take it)
#   --attention_backend      auto (flash needs Transformer Engine on a GPU)
#   --bf16                   false on CPU
#   --global_batch_size 16, --max_length 4096, --max_completion_length 2048,
#   --vllm_max_model_len 12288, --train_iters 1000, --lr 3e-5
#                            4, 512, 32, 512, 2, 1e-4: a tiny model on 2 CPU processes
#   --report_to swanlab      none here (REPORT_TO=swanlab to log there)
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=${MODEL:-runs/tiny_qwen2}
TEACHER=${TEACHER:-runs/tiny_teacher}
DATASET=${DATASET:-megatron_grpo/data/builtin/arithmetic.jsonl#64}
OUTPUT_DIR=${OUTPUT_DIR:-runs/ms_swift_opd_rl}
MEGATRON=${MEGATRON:-megatron}
SYSTEM_PROMPT="You are a helpful math assistant. Solve the problem step by step and put your final answer within \\boxed{}."

# TP 2 (sequence parallel) over 2 processes: DP 1. global_batch_size 4 = micro_batch_size 2 x
# DP 1 x 2 micro-batches; generation_batch_size = 4 x steps_per_generation 2 = 8
# completions, one per prompt (num_generations 1: the teacher's advantages need no group).

NPROC_PER_NODE=${NPROC_PER_NODE:-2} \
$MEGATRON rlhf \
    --rlhf_type grpo \
    --model "$MODEL" \
    --teacher_model "$TEACHER" \
    --enable_thinking false \
    --save_safetensors true \
    --expert_model_parallel_size 1 \
    --tensor_model_parallel_size 2 \
    --pipeline_model_parallel_size 1 \
    --sequence_parallel true \
    --system "$SYSTEM_PROMPT" \
    --dataset "$DATASET" \
    --num_train_epochs 1 \
    --global_batch_size 4 \
    --micro_batch_size 2 \
    --steps_per_generation 2 \
    --num_generations 1 \
    --use_vllm true \
    --vllm_mode colocate \
    --vllm_gpu_memory_utilization 0.6 \
    --vllm_tensor_parallel_size 1 \
    --vllm_max_model_len 512 \
    --sleep_level 1 \
    --max_length 512 \
    --max_completion_length 32 \
    --tuner_type lora \
    --lora_rank 8 \
    --lora_alpha 32 \
    --target_modules all-linear \
    --lr 1e-4 \
    --bf16 false \
    --beta 0 \
    --epsilon 0.2 \
    --epsilon_high 0.2 \
    --loss_type grpo \
    --offload_model true \
    --offload_bridge false \
    --offload_optimizer true \
    --log_rollout_offpolicy_metrics true \
    --logging_steps 1 \
    --recompute_granularity selective \
    --finetune \
    --dataloader_num_workers 8 \
    --dataset_num_proc 8 \
    --no_save_optim \
    --no_save_rng \
    --attention_backend auto \
    --temperature 1 \
    --padding_free false \
    --log_completions true \
    --report_to "${REPORT_TO:-none}" \
    --train_iters 2 \
    --eval_steps 1000 \
    --save_steps 100 \
    --top_k 0 \
    --top_p 1 \
    --output_dir "$OUTPUT_DIR" \
    "$@"
