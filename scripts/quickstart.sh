#!/usr/bin/env bash
# CPU quickstart: installs into ./.venv, then runs the quickstart on 2 CPU processes.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
exec env OMP_NUM_THREADS=1 "$ROOT/.venv/bin/python" tools/quickstart.py "$@"
