"""Bad `megatron rlhf` configurations fail fast (< 5 s), in one line naming the option."""
import json
import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def setup_files(tmp_path_factory):
    from tools.make_tiny_model import make_tiny_model

    d = tmp_path_factory.mktemp("cli")
    model = make_tiny_model(d / "m", family="qwen2")
    good = d / "good.jsonl"
    good.write_text("".join(json.dumps({"prompt": f"{i}+1=", "solution": str(i + 1)}) + "\n"
                            for i in range(16)))
    bad = d / "no_prompt.jsonl"
    bad.write_text(json.dumps({"question_text": "1+1=", "solution": "2"}) + "\n")
    return str(model), str(good), str(bad), str(d)


CASES = {
    "unknown reward": (["--reward_funcs", "acuracy"], "reward_funcs", "accuracy"),
    "no prompt column": (["--dataset", "{bad}"], "prompt", "query"),
    "missing model": (["--model", "{dir}/nope"], "--model", "folder not found"),
    "vllm_mode without use_vllm": (["--use_vllm", "false", "--vllm_mode", "colocate"],
                                   "use_vllm", "vllm"),
    "num_generations": (["--num_generations", "3", "--generation_batch_size", "8"],
                        "num_generations", "[2, 4, 8]"),
    "loss_type": (["--loss_type", "ppo"], "loss_type", "dapo"),
    "tp3 on 2 ranks": (["--tensor_model_parallel_size", "3"], "tensor_model_parallel_size",
                       "NPROC_PER_NODE"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_config_fails_fast(case, setup_files):
    model, good, bad, d = setup_files
    extra, option, valid = CASES[case]
    extra = [x.format(bad=bad, dir=d) for x in extra]
    argv = ["--rlhf_type", "grpo", "--model", model, "--dataset", good,
            "--reward_funcs", "accuracy", "--num_generations", "4", "--global_batch_size", "8"]
    # Later flags win, so a case overrides the defaults above.
    t0 = time.time()
    r = subprocess.run([sys.executable, "-m", "megatron_grpo.cli", "rlhf", *argv, *extra],
                       cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, NPROC_PER_NODE="2"))
    elapsed = time.time() - t0
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert option in r.stderr and valid in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert elapsed < 5, f"{case}: {elapsed:.1f} s (must fail before heavy start-up)"
