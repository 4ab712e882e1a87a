"""`megatron rlhf --dry_run true`: every check without starting a process, then the plan."""
import json
import os
import re

import pytest

from tests import cli_zygote
from tests.harness import run_together

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COUNTDOWN = os.path.join(ROOT, "megatron_grpo", "data", "builtin", "countdown.jsonl")


@pytest.fixture(scope="module")
def model(tiny_model):
    # 2 layers, 4 attention heads, 2 kv heads
    return str(tiny_model(family="qwen2", hidden_size=128))   # head size 32: vLLM-CPU takes it


def _dry_run_argv(model, out, *extra, nproc=4, nnodes=1):
    argv = ["--rlhf_type", "grpo", "--dry_run", "true", "--model", model,
            "--dataset", f"{COUNTDOWN}#100", "--reward_funcs", "countdown", "--output_dir", out,
            *extra]
    env = cli_zygote.env(NPROC_PER_NODE=str(nproc), NNODES=str(nnodes), NODE_RANK="0")
    return cli_zygote.command("rlhf", *argv), env


# Each dry run is one single-threaded process (no ranks, no engine). In a new interpreter it
# imports torch and Megatron (~7 s), through the CLI zygote it finds them imported (~0.5 s);
# the module's runs start together either way.
DRY_RUNS = {
    "plan": (("--tensor_model_parallel_size", "2", "--num_generations", "4",
              "--global_batch_size", "8", "--micro_batch_size", "2",
              "--steps_per_generation", "2", "--num_iterations", "2", "--train_iters", "20",
              "--report_to", "none"), dict(nproc=2, nnodes=2)),
    "pp4": (("--pipeline_model_parallel_size", "4", "--num_generations", "4"), {}),
    "epochs": (("--num_generations", "4", "--global_batch_size", "8", "--micro_batch_size", "2",
                "--steps_per_generation", "2", "--num_iterations", "2",
                "--num_train_epochs", "1", "--report_to", "none"), dict(nproc=2)),
    "eval": (("--num_generations", "4", "--global_batch_size", "8", "--train_iters", "10",
              "--eval_steps", "4", "--split_dataset_ratio", "0.1", "--report_to", "none"),
             dict(nproc=1)),
}


@pytest.fixture(scope="module")
def dry_runs(model, tmp_path_factory):
    """name -> (CompletedProcess, its --output_dir) of every DRY_RUNS entry."""
    root = tmp_path_factory.mktemp("dry_runs")
    outs = {name: str(root / name) for name in DRY_RUNS}
    results = run_together({name: _dry_run_argv(model, outs[name], *extra, **kw)
                            for name, (extra, kw) in DRY_RUNS.items()}, cwd=ROOT)
    return {name: (r, outs[name]) for name, r in results.items()}


def _line(stdout, key):
    return next(line for line in stdout.splitlines() if line.strip().startswith(key + " "))


@pytest.mark.slow  # a CLI process each
def test_dry_run_prints_the_plan_and_starts_nothing(dry_runs):
    r, out = dry_runs["plan"]
    assert r.returncode == 0, r.stderr
    assert not os.path.exists(out)               # nothing ran: no output folder
    # world 2 x 2 = 4; DP = 4 / TP 2 = 2; rollout = 8 x 2 = 16 completions = 4 prompts of 4;
    # per step 8 = mbs 2 x DP 2 x 2 micro-batches; 2 x 2 = 4 steps per rollout; 20 / 4 = 5.
    assert "4 processes = NPROC_PER_NODE 2 x NNODES 2" in _line(r.stdout, "world")
    assert "DP 2 x TP 2 x PP 1 x CP 1" in _line(r.stdout, "parallel")
    assert "colocate: 4 engines x vLLM TP 1, 1 prompt each" in _line(r.stdout, "vLLM")
    rollout = _line(r.stdout, "rollout")
    assert "4 prompts x 4 completions = 16 completions" in rollout
    assert "2 prompts per DP rank" in rollout
    assert "8 completions (2 prompts) per optimizer step = micro_batch_size 2 x DP 2 x " \
           "2 micro-batches per rank" in _line(r.stdout, "step")
    schedule = _line(r.stdout, "schedule")
    assert "4 optimizer steps per rollout" in schedule and "20 optimizer steps" in schedule
    assert "5 rollouts" in schedule
    model_line = _line(r.stdout, "model")
    assert "qwen2 (Qwen2ForCausalLM), 2 layers" in model_line and "2 kv heads" in model_line
    assert re.search(r"100 prompts from 1 file; reward columns: nums, solution, target",
                     _line(r.stdout, "dataset"))
    # The defaults it relies on where they are not ms-swift's (config/swift_defaults.py);
    # not those of the flags it passes (--rlhf_type, --output_dir, --report_to, ...).
    block = r.stdout.split("defaults that differ from ms-swift's (flags not passed):\n")[1]
    flags = [line.split()[0] for line in block.splitlines() if line.startswith("  --")]
    assert flags == ["--attention_backend", "--padding_free", "--vllm_mode", "--max_length"]
    assert "--max_length ours unset, ms-swift 512 (" in block, block


@pytest.mark.slow
def test_dry_run_checks_the_model_against_the_parallel_sizes(dry_runs):
    # 2 layers cannot be split into 4 pipeline stages; the error names the option.
    r, _ = dry_runs["pp4"]
    assert r.returncode == 2, r.stdout
    assert "--pipeline_model_parallel_size 4" in r.stderr and "2 layers" in r.stderr
    assert "Traceback" not in r.stderr and "dry_run: every check passed" not in r.stdout


@pytest.mark.slow  # a CLI process (dry run)
def test_epochs_count_every_pass_of_num_iterations(dry_runs):
    """num_train_epochs covers every prompt once per epoch: 100 prompts / 4 per rollout = 25
    rollouts, each trained num_iterations 2 x steps_per_generation 2 = 4 steps -> 100."""
    r, _ = dry_runs["epochs"]
    assert r.returncode == 0, r.stderr
    assert "4 optimizer steps per rollout" in _line(r.stdout, "schedule"), r.stdout
    assert "100 optimizer steps in all (1 epochs)" in _line(r.stdout, "schedule"), r.stdout


@pytest.mark.slow  # a CLI process (dry run)
def test_dry_run_mentions_the_evaluation(dry_runs):
    r, _ = dry_runs["eval"]
    assert r.returncode == 0, r.stdout + r.stderr
    lines = {line.split()[0]: line for line in r.stdout.splitlines()[1:] if line.strip()}
    assert "90 prompts from 1 file (10 more held out for evaluation)" in lines["dataset"]
    assert ("every 4 optimizer steps and after the last (3 evaluations): all 10 validation "
            "prompts (held out of --dataset by --split_dataset_ratio 0.1, never trained on) x 4 "
            "completions") in lines["eval"], lines["eval"]


@pytest.mark.slow  # two CLI processes (dry runs)
def test_dry_run_checks_the_teacher_in_the_run_layout(model, tiny_model, tmp_path):
    """--teacher_model: the plan names the teacher; a teacher that the run's layout cannot
    split (1 layer over PP=2) fails the dry run naming --teacher_model. Served teachers
    (--teacher_model_server): the plan names them; a prompt that no teacher's tags take
    fails before any start-up. A teacher_prompt column: the plan says it is OPSD. The plan
    names a --ref_model."""
    teacher = str(tiny_model(family="qwen2", hidden_size=128, seed=1))
    shallow = str(tiny_model(family="qwen2", hidden_size=128, num_layers=1, seed=1))

    opsd = tmp_path / "opsd.jsonl"      # OPSD: a teacher_prompt column
    opsd.write_text("".join(json.dumps({"query": f"Make {n}", "target": n, "nums": [n],
                                        "teacher_prompt": f"Make {n}: it is {n}"}) + "\n"
                            for n in range(8)))

    def served(*tags):
        return json.dumps([{"url": "http://t1:8000", "tags": [tags[0]]},
                           {"url": "http://t2:8001", "tags": [tags[1]]}])

    results = run_together({
        "ok": _dry_run_argv(model, str(tmp_path / "ok"), "--teacher_model", teacher,
                            "--teacher_kl_coef", "0.5", "--num_generations", "4", nproc=2),
        "pp2": _dry_run_argv(model, str(tmp_path / "pp2"), "--teacher_model", shallow,
                             "--pipeline_model_parallel_size", "2", "--num_generations", "4",
                             nproc=2),
        "served": _dry_run_argv(model, str(tmp_path / "served"), "--teacher_model_server",
                                served("math.jsonl", COUNTDOWN), "--num_generations", "4",
                                nproc=2),
        "unrouted": _dry_run_argv(model, str(tmp_path / "unrouted"), "--teacher_model_server",
                                  served("math.jsonl", "code.jsonl"), "--num_generations", "4",
                                  nproc=2),
        "opsd": _dry_run_argv(model, str(tmp_path / "opsd"), "--dataset", str(opsd),
                              "--num_generations", "4", nproc=2),
        "ref": _dry_run_argv(model, str(tmp_path / "ref"), "--ref_model", teacher, "--beta",
                             "0.04", "--num_generations", "4", nproc=2)}, cwd=ROOT)
    assert results["ref"].returncode == 0, results["ref"].stderr
    assert f"reference {teacher} (frozen, same layout)" in _line(results["ref"].stdout, "model")
    assert results["opsd"].returncode == 0, results["opsd"].stderr
    assert "reward columns: nums, target, teacher_prompt; teacher_prompt: OPSD, the teacher scores " \
           "behind it (no teacher flag: the policy itself)" in \
        _line(results["opsd"].stdout, "dataset"), results["opsd"].stdout
    ok, pp2 = results["ok"], results["pp2"]
    assert results["served"].returncode == 0, results["served"].stderr
    assert "teacher served at http://t1:8000, http://t2:8001 (teacher_kl_coef 1)" in \
        _line(results["served"].stdout, "model")
    unrouted = results["unrouted"]
    assert unrouted.returncode == 2, unrouted.stdout
    assert f"--teacher_model_server: a prompt of {COUNTDOWN} has --dataset entry " \
           f"{COUNTDOWN!r}, which no teacher's tags hold (['code.jsonl', 'math.jsonl'])" in \
        unrouted.stderr, unrouted.stderr
    assert ok.returncode == 0, ok.stderr
    assert f"teacher {teacher} (frozen, same layout, teacher_kl_coef 0.5)" in _line(ok.stdout, "model")
    assert pp2.returncode == 2, pp2.stdout
    assert f"--teacher_model {shallow!r}" in pp2.stderr and "--pipeline_model_parallel_size 2" \
        in pp2.stderr, pp2.stderr
    assert "Traceback" not in pp2.stderr


def test_dry_run_reads_a_vl_config_as_transformers_writes_it(tmp_path):
    """A Qwen2.5-VL checkpoint whose config.json the installed transformers wrote (the text
    model's sizes under text_config) passes the dry run as the flat one does, memory plan
    included (a KeyError on num_attention_heads before)."""
    import subprocess

    from transformers import AutoConfig

    from tools.make_tiny_vl_model import make_tiny_vl_model

    path = make_tiny_vl_model(tmp_path / "vl")
    AutoConfig.from_pretrained(path).save_pretrained(path)       # today's format
    saved = json.loads((path / "config.json").read_text())
    assert "num_attention_heads" in saved["text_config"]
    assert "num_attention_heads" not in saved
    cmd, env = _dry_run_argv(str(path), str(tmp_path / "out"), "--num_generations", "4",
                             nproc=1)
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "4 heads" in r.stdout and "memory plan (per rank" in r.stdout
