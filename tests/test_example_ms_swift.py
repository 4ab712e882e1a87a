"""examples/ms_swift_dense_colocate.sh: its flags pass every check (`--dry_run true`, no
process started). The 2-step run end to end is a separate (vLLM) test."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow  # the example script runs the CLI (dry run)
def test_dense_colocate_example_dry_run(tmp_path, tiny_model):
    model = str(tiny_model(family="qwen2"))
    env = dict(os.environ, MODEL=model, OUTPUT_DIR=str(tmp_path / "out"),
               MEGATRON=f"{sys.executable} -m megatron_grpo.cli", NNODES="1")
    r = subprocess.run(["bash", "examples/ms_swift_dense_colocate.sh", "--dry_run", "true"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "dry_run: every check passed" in r.stdout
    assert "DP 2 x TP 1 x PP 1 x CP 1" in r.stdout, r.stdout
    assert "16 completions (generation_batch_size)" in r.stdout, r.stdout
