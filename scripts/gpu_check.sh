#!/usr/bin/env bash
# The GPU checks (tests/test_gpu.py: Triton kernels compiled for the GPU, Megatron-Core on
# CUDA with NCCL, the bridge's device and pinned-host export, a GRPO step), as one short
# run on a lent GPU machine whose python3 has CUDA torch, Triton and transformers but
# cannot fetch anything.
#
#   here:        bash scripts/gpu_check.sh --fetch     # megatron-core wheel into .whl/
#   GPU machine: bash scripts/gpu_check.sh             # (carry .whl) results in $OUT
#
# Not covered yet (not installable there without carrying large wheels): Transformer
# Engine's layer spec, CUDA vLLM and its sleep levels.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYVER="${GPU_PYTHON_VERSION:-3.12}"
if [ "${1:-}" = "--fetch" ]; then
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$ROOT/.whl" "megatron-core==0.16.1"
  ls -la "$ROOT/.whl"
  exit 0
fi
cd "$ROOT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/mgrpo_site .whl/*.whl
  export PYTHONPATH="/tmp/mgrpo_site:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
fi
OUT="${OUT:-/tmp/mgrpo_gpu_check}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
python3 - <<'PY' 2>&1 | tee "$OUT/versions.txt"
import torch, triton, transformers, megatron.core
print("torch", torch.__version__, "cuda", torch.version.cuda, "device",
      torch.cuda.get_device_name() if torch.cuda.is_available() else None)
print("triton", triton.__version__, "transformers", transformers.__version__,
      "megatron-core", megatron.core.__version__)
PY
set -o pipefail
python3 -m pytest -q -rs -m gpu tests/test_gpu.py -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log"
