"""Output reward models (`--reward_model`, rewards/reward_model.py): tiny
Qwen2ForSequenceClassification checkpoints written by the installed transformers.

The scores equal an independent forward of the same model (the decoder's last hidden
state of each conversation alone, unpadded, times the score head) in float32; the
option checks refuse what cannot be a reward model before anything starts; the weights
cover the reward functions first, then the models."""
import contextlib
import json
import os
import shutil

import pytest
import torch

from megatron_grpo.config import build_config
from megatron_grpo.rewards import load_plugins
from megatron_grpo.rewards.reward_model import (RewardModel, check_reward_model,
                                                reward_model_funcs)
from tools.make_tiny_model import make_tiny_reward_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATASET = os.path.join(ROOT, "megatron_grpo/data/builtin/arithmetic.jsonl")
JUDGE = os.path.join(ROOT, "examples/plugins/llm_judge.py")


def judge_grade(answer: str) -> float:
    """What the stub judge grades an answer: its digits, at most 10, over 10."""
    return min(sum(c.isdigit() for c in answer), 10) / 10


@contextlib.contextmanager
def stub_judge(fail_first: int = 0):
    """A tiny OpenAI-compatible server: /v1/models names "judge"; /v1/chat/completions
    replies "Grade: N", N the digits of the conversation's last assistant answer (at most
    10); its first `fail_first` chat requests answer HTTP 500. Yields (url, requests)."""
    import http.server
    import threading

    seen = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _reply(self, code, body):
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._reply(200, {"data": [{"id": "judge"}]})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append(body)
            if len(seen) <= fail_first:
                return self._reply(500, {"error": "warming up"})
            answer = body["messages"][-1]["content"].rsplit("assistant: ", 1)[-1]
            grade = min(sum(c.isdigit() for c in answer), 10)
            self._reply(200, {"choices": [{"message": {"role": "assistant",
                                                       "content": f"Grade: {grade}"}}]})

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()


@pytest.fixture(scope="module")
def policy(tiny_model):
    return str(tiny_model(family="qwen2", hidden_size=128))


@pytest.fixture(scope="module")
def rm(policy, tmp_path_factory):
    return str(make_tiny_reward_model(tmp_path_factory.mktemp("rm") / "helpful", policy))


def reference_scores(path, conversations):
    """Each conversation alone through transformers: the last token's hidden state times
    the score head (no padding, no batching)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for messages in conversations:
            ids = tok(tok.apply_chat_template(messages, tokenize=False), return_tensors="pt",
                      add_special_tokens=False)["input_ids"]
            hidden = model.model(input_ids=ids).last_hidden_state[0, -1]
            out.append(float(hidden @ model.score.weight[0]))
    return out


def test_scores_equal_transformers_forward_of_each_conversation(rm):
    convs = [[{"role": "user", "content": "1+2="}, {"role": "assistant", "content": a}]
             for a in ("3", "three, I think", "", "12345 67 8 9 and a longer answer here")]
    scorer = RewardModel(rm, batch_size=3)       # batches of 3 and 1, padded
    got = scorer([c[-1]["content"] for c in convs], messages=convs)
    want = reference_scores(rm, convs)
    assert got == pytest.approx(want, abs=1e-5)
    assert len(set(round(x, 4) for x in got)) == 4      # the scores tell them apart


def test_what_cannot_be_a_reward_model_is_refused(policy, rm, tmp_path):
    assert check_reward_model(rm) is None
    assert "no config.json" in check_reward_model(str(tmp_path / "missing"))
    assert "not a sequence classifier" in check_reward_model(policy)   # a causal LM
    two = tmp_path / "two_labels"
    shutil.copytree(rm, two)
    cfg = json.loads((two / "config.json").read_text())
    cfg["id2label"] = {"0": "bad", "1": "good"}
    (two / "config.json").write_text(json.dumps(cfg))
    assert "has 2 labels" in check_reward_model(str(two))
    bare = tmp_path / "no_template"
    shutil.copytree(rm, bare)
    tc = json.loads((bare / "tokenizer_config.json").read_text())
    tc.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(tc))
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    assert "no chat template" in check_reward_model(str(bare))


def test_weights_cover_functions_then_models_and_names_stay_apart(policy, rm, tmp_path):
    base = ["--model", policy, "--dataset", DATASET, "--reward_funcs", "format"]
    cfg, problems = build_config([*base, "--reward_model", rm, "--reward_weights", "1", "0.5"])
    assert not problems, problems.messages
    assert cfg.reward.reward_model == [rm]
    _, problems = build_config([*base, "--reward_model", rm, "--reward_weights", "1"])
    assert "--reward_weights [1.0] has 1 values but --reward_funcs ['format'] and " \
           f"--reward_model ['{rm}'] name 2" in "\n".join(problems.messages)
    assert cfg.reward.reward_weights == [1.0, 0.5]
    clash = tmp_path / "format"
    shutil.copytree(rm, clash)
    _, problems = build_config([*base, "--reward_model", str(clash)])
    assert "its name 'format' is already a reward function's" in "\n".join(problems.messages)
    _, problems = build_config(["--model", policy, "--dataset", DATASET, "--reward_model", policy])
    assert "not a sequence classifier" in "\n".join(problems.messages)
    cfg, problems = build_config(["--model", policy, "--dataset", DATASET, "--reward_model", rm])
    assert not problems, problems.messages     # a reward model alone is enough


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("layout", [
    [], ["--tensor_model_parallel_size", "2", "--use_distributed_optimizer", "false"]],
    ids=["dp2", "tp2"])
def test_two_reward_models_a_judge_and_a_function_score_a_run(policy, rm, tmp_path, layout):
    """`megatron rlhf` on 2 processes (DP=2 or TP=2, colocated vLLM) with two reward models, a
    generative judge (--reward_model_plugin llm_judge against a stub server) and one
    reward function, weighted: every completion's score from each classifier equals the
    independent forward of that model on the conversation (its prompt's messages and the
    completion), the judge's is its grade, and the step's reward is the weighted sum."""
    import subprocess

    from megatron_grpo.data import load_datasets
    from tests import cli_zygote
    from tests.harness import free_port

    safety = str(make_tiny_reward_model(tmp_path / "safety", policy, seed=1))
    judge_dir = tmp_path / "judge"
    shutil.copytree(policy, judge_dir)         # the judge's folder: its tokenizer only
    out = str(tmp_path / "run")
    argv = ["rlhf", "--model", policy, "--dataset", DATASET, "--reward_funcs", "digits",
            "--external_plugins", os.path.join(ROOT, "examples/plugins/digits_reward.py"), JUDGE,
            "--reward_model", rm, safety, str(judge_dir),
            "--reward_model_plugin", "default", "default", "llm_judge",
            "--reward_weights", "1", "0.5", "2", "1",
            "--num_generations", "4", "--generation_batch_size", "8",
            "--max_completion_length", "8", "--micro_batch_size", "2", "--global_batch_size", "8",
            "--train_iters", "2", "--beta", "0", "--vllm_mode", "colocate",
            "--vllm_max_model_len", "128", "--vllm_enforce_eager", "true", "--top_k", "-1",
            "--output_dir", out, "--log_completions", "true", "--seed", "3", *layout]
    with stub_judge() as (url, _):
        env = dict(os.environ, NPROC_PER_NODE="2", OMP_NUM_THREADS="1",
                   MASTER_PORT=str(free_port()), MGRPO_JUDGE_URL=url)
        r = subprocess.run(cli_zygote.command(*argv), cwd=ROOT, env=cli_zygote.env(env),
                           capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "reward models" in r.stdout         # the memory plan counts them
    with open(os.path.join(out, "completions.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == 16
    cfg, _ = build_config(["--model", policy, "--dataset", DATASET, "--reward_funcs", "format"])
    dataset, _ = load_datasets(cfg.data, cfg.evaluation, seed=3)
    convs = [list(dataset.messages[row["prompt_index"]])
             + [{"role": "assistant", "content": row["completion"]}] for row in rows]
    for name, path in (("helpful", rm), ("safety", safety)):
        assert [row[name] for row in rows] == pytest.approx(reference_scores(path, convs),
                                                            abs=1e-4), name
    with open(os.path.join(out, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f]
    first = [row for row in rows if row["step"] == 1]
    assert [row["judge"] for row in rows] == pytest.approx(
        [judge_grade(row["completion"]) for row in rows], abs=1e-6)
    weighted = [row["digits"] + 0.5 * row["helpful"] + 2 * row["safety"] + row["judge"]
                for row in first]
    assert metrics[0]["reward"] == pytest.approx(sum(weighted) / len(weighted), abs=1e-5)
    for name in ("helpful", "safety"):
        assert metrics[0][f"rewards/{name}/mean"] == pytest.approx(
            sum(row[name] for row in first) / len(first), abs=1e-5)


@pytest.mark.vllm
@pytest.mark.slow
def test_the_reward_model_quickstart_learns(tiny_model, tmp_path):
    """configs/quickstart_rm_cpu.yaml as tools/quickstart.py runs it: a tiny policy learns
    what a tiny reward model (the share of digits, make_digit_reward_model) rewards; the
    quickstart's bar: the mean reward of the last 10 of 30 steps at least 0.3 above the
    first 10's."""
    import subprocess

    from tests import cli_zygote
    from tests.harness import free_port
    from tools.make_tiny_model import make_digit_reward_model
    from tools.quickstart import dtype_args

    config = os.path.join(ROOT, "configs", "quickstart_rm_cpu.yaml")
    model = str(tiny_model(family="qwen2", num_layers=2, hidden_size=128, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=256, vocab_size=999))
    rm_dir = str(make_digit_reward_model(tmp_path / "tiny-digits-rm", model))
    out = str(tmp_path / "run")
    argv = ["rlhf", "--config", config, "--model", model, "--reward_model", rm_dir,
            "--output_dir", out, *dtype_args(config)]
    env = dict(os.environ, NPROC_PER_NODE="2", OMP_NUM_THREADS="1", MASTER_PORT=str(free_port()))
    r = subprocess.run(cli_zygote.command(*argv), cwd=ROOT, env=cli_zygote.env(env),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rewards = [json.loads(line)["rewards/tiny-digits-rm/mean"] for line in f]
    assert len(rewards) == 30
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > first + 0.3, (first, last)


def test_the_guides_reward_config_three_models_names_and_weights(policy, rm, tmp_path):
    """ms-swift's guides' reward_config.yaml shape (safety 0.3, helpfulness 0.5, fluency
    0.2), given as --reward_config FILE and as reward_models: in the run's own YAML: one
    resolved list (names, weights after the functions'), the same either way; unknown keys
    are errors naming them."""
    import yaml

    models = [{"name": "safety", "path": rm, "weight": 0.3},
              {"name": "helpfulness", "path": rm, "weight": 0.5, "batch_size": 4},
              {"name": "fluency", "path": rm, "weight": 0.2, "dtype": "bfloat16"}]
    rc = tmp_path / "reward_config.yaml"
    rc.write_text(yaml.safe_dump({"reward_models": models}))
    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump({"reward": {"reward_funcs": ["format"],
                                              "reward_weights": [2.0],
                                              "reward_models": models}}))
    base = ["--model", policy, "--dataset", DATASET]
    a, problems = build_config([*base, "--reward_funcs", "format", "--reward_weights", "2",
                                "--reward_config", str(rc)])
    assert not problems, problems.messages
    b, problems = build_config([*base, "--config", str(run)])
    assert not problems, problems.messages
    for cfg in (a, b):
        r = cfg.reward
        assert [m["name"] for m in r.reward_models] == ["safety", "helpfulness", "fluency"]
        assert [m["batch_size"] for m in r.reward_models] == [8, 4, 8]
        assert [m["dtype"] for m in r.reward_models] == ["float32", "float32", "bfloat16"]
        assert r.reward_weights == [2.0, 0.3, 0.5, 0.2]
    a2 = type(a).from_flat(a.to_flat())          # a checkpoint's config reads back the same
    assert a2.reward.reward_models == a.reward.reward_models
    assert a2.reward.reward_weights == a.reward.reward_weights
    rc.write_text(yaml.safe_dump({"reward_models": [dict(models[0], temperature=1)],
                                  "judges": []}))
    _, problems = build_config([*base, "--reward_config", str(rc)])
    text = "\n".join(problems.messages)
    assert "unknown key(s) ['judges']; allowed: reward_models" in text
    assert "unknown key(s) ['temperature']; allowed: name, path, weight, batch_size, dtype" in text


def test_a_generative_judge_plugin_grades_through_a_served_llm(policy, monkeypatch):
    """--reward_model_plugin llm_judge (examples/plugins/llm_judge.py) against a tiny local
    OpenAI-compatible server: one grade per completion, read from the reply; a 5xx is
    retried; a server that stays down fails with its URL after the retries."""
    import sys

    from megatron_grpo.rewards import rm_plugins

    load_plugins([JUDGE])
    monkeypatch.setattr(sys.modules[rm_plugins["llm_judge"].__module__], "RETRY_DELAYS",
                        (0.0, 0.0))
    convs = [[{"role": "user", "content": "1+2="}, {"role": "assistant", "content": a}]
             for a in ("3", "no idea", "12 and 34")]
    with stub_judge(fail_first=1) as (url, seen):
        monkeypatch.setenv("MGRPO_JUDGE_URL", url)
        [judge] = reward_model_funcs([{"name": "judge", "path": policy, "batch_size": 8,
                                       "dtype": "float32", "plugin": "llm_judge"}])
        scores = judge.fn([c[-1]["content"] for c in convs], messages=convs,
                          solution=["3", "3", "3"])
    assert scores == [0.1, 0.0, 0.4]
    assert len(seen) == 4 and all(b["model"] == "judge" and b["temperature"] == 0 for b in seen)
    monkeypatch.setenv("MGRPO_JUDGE_URL", "http://127.0.0.1:9")       # nothing listens there
    [judge] = reward_model_funcs([{"name": "judge", "path": policy, "batch_size": 8,
                                   "dtype": "float32", "plugin": "llm_judge"}])
    with pytest.raises(RuntimeError, match="judge http://127.0.0.1:9/v1/models failed 3 times"):
        judge.fn(["3"], messages=convs[:1])
