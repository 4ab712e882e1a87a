#!/usr/bin/env bash
# Multi-turn GRPO with a tool: the built-in `calculator` scheduler on the arithmetic prompts.
# The model may write <tool_call>EXPR</tool_call>; the scheduler evaluates EXPR and appends
# the result as a tool message (loss mask 0), and the model's next turn continues from the
# exact token ids so far. A turn without a tool call (or --max_turns) ends the trajectory;
# the accuracy reward reads the last model message.
#
#   MODEL=path/to/tiny_qwen2 bash examples/multi_turn_calculator.sh
#   MODEL=... bash examples/multi_turn_calculator.sh --train_iters 2       # flags override
#
# A gym environment instead (the number-guessing game; its reward is the gym_reward column):
#   ... --gym_env guess_number --max_turns 4 --reward_funcs format --reward_weights 0 1
# Your own scheduler or environment, as in ms-swift (multi_turns['name'] = cls):
#   ... --external_plugins examples/plugins/react_calculator.py --multi_turn_scheduler react_calculator
#
# A tiny random model writes the call only when the markers are single tokens of its
# vocabulary (as in Qwen2.5's):
#   python tools/make_tiny_model.py --family qwen2 --hidden_size 128 --intermediate_size 256 \
#       --vocab_size 400 --added_tokens '<tool_call>' '</tool_call>' --output_dir runs/tiny_qwen2
# With the format reward (--reward_funcs tool_call_format --external_plugins
# examples/plugins/tool_call_reward.py) and the CPU quickstart's recipe it learns to call
# the calculator within ~30 steps (tests/test_multi_turn_e2e.py has the exact flags); the
# accuracy reward needs a model that can do arithmetic (e.g. a real instruct model).
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=${MODEL:-runs/tiny_qwen2}
MEGATRON=${MEGATRON:-megatron}

NPROC_PER_NODE=${NPROC_PER_NODE:-2} OMP_NUM_THREADS=1 \
$MEGATRON rlhf \
    --rlhf_type grpo \
    --model "$MODEL" \
    --dataset megatron_grpo/data/builtin/arithmetic.jsonl \
    --system "Use the calculator: write <tool_call>EXPRESSION</tool_call> and wait for its result. Give the final answer as a number." \
    --multi_turn_scheduler calculator \
    --max_turns 3 \
    --max_completion_length 48 \
    --max_length 448 \
    --vllm_max_model_len 512 \
    --reward_funcs accuracy \
    --num_generations 4 \
    --generation_batch_size 16 \
    --global_batch_size 16 \
    --micro_batch_size 4 \
    --train_iters 20 \
    --lr 1e-5 \
    --beta 0.0 \
    --loss_type dapo \
    --use_vllm true \
    --vllm_mode colocate \
    --vllm_enforce_eager true \
    --temperature 1.0 \
    --log_completions true \
    --report_to none \
    --output_dir runs/multi_turn_calculator \
    "$@"
